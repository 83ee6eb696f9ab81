"""``polyrl validate``'s model and task options are checked before the first level runs: an unknown ``--preset``, a
``--model`` without config.json or an unknown ``--task`` used to surface only when the sft level started, after the
platform and ops levels had run (minutes on a device), and the run then wrote no report."""

from __future__ import annotations

import pytest

from polyrl.cli.main import main


@pytest.mark.parametrize(
    "extra, says",
    [
        (["sft", "--preset", "nope"], "unknown model preset 'nope'"),
        (["rl", "--model", "{tmp}/nowhere"], "--model {tmp}/nowhere: no config.json there"),
        (["sft", "--task", "builtin:nope"], "unknown builtin dataset 'nope'"),
        (["rl", "--task", "{tmp}/missing.jsonl"], "data file '{tmp}/missing.jsonl' does not exist"),
        (["eval", "--preset", "tiny-L0"], "unknown model preset 'tiny-L0'"),
    ],
)
def test_model_and_task_mistakes_stop_before_any_level(extra, says, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["validate", "platform", *(a.format(tmp=tmp_path) for a in extra), "--out", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert says.format(tmp=tmp_path) in captured.err
    assert "== platform" not in captured.out  # nothing ran first
    assert not out.exists()


def test_levels_without_the_model_ignore_its_options(capsys):
    assert main(["validate", "platform", "--preset", "nope", "--task", "builtin:nope"]) == 0
    assert "validate: PASS (platform passed)" in capsys.readouterr().out
