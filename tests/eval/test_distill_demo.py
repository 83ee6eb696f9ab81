"""The distillation demo (``polyrl demo --distill``), shortened to stay under a minute on the CPU: a tiny teacher
(instead of the small one) SFT'd briefly, a briefly SFT'd student, 10 distillation steps. Asserts the reverse KL to
the teacher falls (the full demo's accuracy numbers are in docs/evaluation.md); the teacher is cached per settings."""

from __future__ import annotations

import json

import torch


def test_short_distill_demo_reverse_kl_falls(tmp_path, capsys):
    from polyrl.eval.distill_demo import DistillDemo, run_distill_demo

    torch.set_num_threads(1)
    d = DistillDemo(
        out=str(tmp_path / "demo"),
        teacher_preset="tiny",
        teacher_steps=100,
        teacher_lr=3e-3,
        student_steps=30,
        distill_steps=10,
        eval_size=10,
    )
    res = run_distill_demo(d)
    kl = [
        json.loads(x)["reverse_kl"] for x in (tmp_path / "demo" / "distill" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(kl) == 10 and all(k > 0 for k in kl)
    # a 150-step tiny teacher measured 0.81, 0.64 (first) -> 0.57, 0.32 (last); 0.85 x leaves room for the noise
    assert res["kl_last"] < 0.85 * res["kl_first"], kl
    assert 0.0 <= res["before"] <= 1.0 and 0.0 <= res["after"] <= 1.0
    out = capsys.readouterr().out
    assert "held-out accuracy: teacher" in out and "reverse KL" in out
    # a second run with the same teacher settings reuses the cached teacher
    stamp = tmp_path / "demo" / "teacher" / "settings.json"
    assert json.loads(stamp.read_text())["preset"] == "tiny"


def test_demo_flag():
    import argparse

    from polyrl.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args(["--distill"]).distill is True
