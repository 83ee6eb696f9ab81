"""`polyrl demo` wiring on a cut-down setting (tiny preset, a few steps): the init and SFT stages run, accuracy is
reported before and after, the SFT run leaves its final model. Learning itself is `make demo`'s job."""

from __future__ import annotations

import re

import pytest

from polyrl.cli.main import main


def test_demo_init_and_sft_stages(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--preset", "tiny", "--steps", "3", "--eval-size", "6", "--show", "2"]
    argv += ["--micro-batch-tokens", "512", "--stages", "init,sft"]  # later stages have their own tests
    assert main(argv) == 0
    text = capsys.readouterr().out
    accs = re.findall(r"(before training|after SFT): held-out exact match (\d+)/6 = ([\d.]+)%", text)
    assert [a[0] for a in accs] == ["before training", "after SFT"]
    assert re.search(r"held-out accuracy: before training [\d.]+%, after SFT [\d.]+%", text)
    assert len(re.findall(r"\(answer -?\d+\) (ok|wrong)", text)) == 2 + 2
    assert (out / "sft" / "final" / "config.json").is_file() and (out / "sft" / "metrics.jsonl").is_file()


def test_demo_unknown_stage_is_an_error(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), "--stages", "init,rl"]) == 2
    assert "unknown demo stage(s) ['rl']" in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["init", "sft"])
def test_stages_are_registered_in_order(stage):
    from polyrl.cli.demo import STAGES

    assert stage in [name for name, _ in STAGES]
    assert [name for name, _ in STAGES][:2] == ["init", "sft"]
