"""``polyrl validate``'s numeric level options refuse values that cannot mean anything when the command line is
parsed. Before: ``--sft-steps -3`` failed the sft level with an IndexError (read as a platform failure in the
report), ``--sft-steps 6`` failed its loss check by construction (the first and last 5 steps overlap), ``0`` silently
meant the default, ``--rl-prompts -2`` sliced the prompt list from its end (1,998 prompts instead of 2), and
``--sft-lr nan`` stopped the run only once the sft level started."""

from __future__ import annotations

import pytest

from polyrl.cli.main import main


@pytest.mark.parametrize(
    "flag, value, says",
    [
        (
            "--sft-steps",
            "-3",
            "must be at least 10 (the loss check compares the first 5 steps with the last 5), got -3",
        ),
        ("--sft-steps", "0", "must be at least 10"),
        ("--sft-steps", "6", "must be at least 10"),
        ("--sft-batch-tokens", "8", "must be at least 128 (a row is up to 128 tokens), got 8"),
        ("--sft-lr", "nan", "must be a finite number > 0, got nan"),
        ("--sft-lr", "-0.001", "must be a finite number > 0"),
        ("--rl-prompts", "-2", "must be at least 1, got -2"),
        ("--rl-group", "0", "must be at least 1, got 0"),
        ("--rl-max-tokens", "0", "must be at least 1, got 0"),
        ("--collectives-cpu-procs", "-1", "must be at least 0, got -1"),
        ("--rl-prompts", "two", "'two' is not an integer"),
    ],
)
def test_meaningless_numbers_are_refused_before_any_level(flag, value, says, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["validate", "platform", flag, value])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert f"argument {flag}: {says}" in captured.err, captured.err
    assert "== platform" not in captured.out


def test_the_smallest_meaningful_values_parse(capsys):
    argv = ["validate", "platform", "--sft-steps", "10", "--sft-batch-tokens", "128", "--sft-lr", "1e-3"]
    assert main([*argv, "--rl-prompts", "1", "--rl-group", "1", "--rl-max-tokens", "1"]) == 0
    assert "validate: PASS (platform passed)" in capsys.readouterr().out
