"""`polyrl demo` wiring on a cut-down setting (tiny preset, a few steps): every stage runs, accuracy is reported
before and after each training stage, the GRPO stage prints its reward curve and first -> last summary, each run
leaves its final model, and the scored problems are never training prompts. Learning itself is `make demo`'s job
(its measured numbers are in ``polyrl.cli.demo.DEFAULTS``'s comment)."""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file

from polyrl.cli.main import main


def test_demo_all_stages(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--preset", "tiny", "--steps", "60", "--lr", "3e-3", "--eval-size", "6"]
    argv += ["--show", "2", "--micro-batch-tokens", "512", "--rl-steps", "3", "--rl-prompts", "2", "--rl-samples", "4"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    accs = re.findall(r"(before training|after SFT|after GRPO): held-out exact match (\d+)/6 = ([\d.]+)%", text)
    assert [a[0] for a in accs] == ["before training", "after SFT", "after GRPO"]
    for _, correct, pct in accs:
        assert float(pct) == pytest.approx(100 * int(correct) / 6, abs=0.05)
    final = re.search(r"held-out accuracy: before training ([\d.]+)%, after SFT ([\d.]+)%, after GRPO ([\d.]+)%", text)
    assert final and [float(x) for x in final.groups()] == [float(a[2]) for a in accs]
    assert len(re.findall(r"\(answer -?\d+\) (ok|wrong)", text)) == 2 + 2  # before training and after SFT

    # the reward curve and the summary are the run's own metrics (3 steps of 2 prompts x 4 samples)
    recs = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in recs]
    assert len(rewards) == 3 and all(r * 8 == round(r * 8) for r in rewards)  # fractions of 8 samples
    curve = re.findall(r"steps +(\d+)-(\d+) +([\d.]+) (#*)", text)
    assert [(int(lo), int(hi)) for lo, hi, _, _ in curve] == [(1, 1), (2, 2), (3, 3)]
    assert [float(m) for _, _, m, _ in curve] == pytest.approx(rewards, abs=5e-4)
    assert [len(bar) for *_, bar in curve] == [round(40 * r) for r in rewards]
    summary = re.search(r"reward ([\d.]+) \(first 1 steps\) -> ([\d.]+) \(last 1 steps\), ([+-][\d.]+)", text)
    assert summary
    first, last, delta = (float(x) for x in summary.groups())
    assert (first, last) == pytest.approx((rewards[0], rewards[-1]), abs=5e-4)
    assert delta == pytest.approx(last - first, abs=1.5e-3)

    # each training stage left a final model; GRPO moved the SFT'd weights exactly when some group's rewards differed
    # (a group whose samples all score the same has zero advantages, hence no gradient)
    sft_w = load_file(str(out / "sft" / "final" / "model.safetensors"))
    grpo_w = load_file(str(out / "grpo" / "final" / "model.safetensors"))
    assert sft_w.keys() == grpo_w.keys()
    informative = any(r["groups_uniform_fraction"] < 1.0 for r in recs)
    assert any(not sft_w[k].equal(grpo_w[k]) for k in sft_w) == informative


def test_demo_init_and_sft_stages_only(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--preset", "tiny", "--steps", "2", "--eval-size", "4", "--show", "0"]
    assert main([*argv, "--stages", "init,sft"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"held-out accuracy: before training [\d.]+%, after SFT [\d.]+%\n", text)
    assert "GRPO" not in text and not (out / "grpo").exists()
    assert (out / "sft" / "final" / "config.json").is_file() and (out / "sft" / "metrics.jsonl").is_file()


def test_demo_unknown_stage_is_an_error(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), "--stages", "init,rl"]) == 2
    assert "unknown demo stage(s) ['rl']" in capsys.readouterr().err


def test_stages_are_registered_in_order():
    from polyrl.cli.demo import STAGES

    assert [name for name, _ in STAGES] == ["init", "sft", "grpo"]


def test_held_out_problems_are_never_training_prompts(tmp_path):
    """Both training stages draw prompts from the task's train split; the demo scores its @test split."""
    import argparse

    from polyrl.cli.demo import DEFAULTS, DemoState, held_out
    from polyrl.data import DataConfig, load_prompts

    args = argparse.Namespace(task=DEFAULTS["task"], eval_size=DEFAULTS["eval_size"])
    scored = {p.messages[-1]["content"] for p in held_out(DemoState(root=tmp_path, args=args))}
    train, _ = load_prompts(DataConfig(path=DEFAULTS["task"]))
    trained = {p.messages[-1]["content"] for p in train}
    assert len(scored) >= 50 and len(trained) >= 200  # 300 problems "What is a + b?", a <= 99, b <= 2; 20% held out
    assert scored.isdisjoint(trained)
    assert all(re.fullmatch(r"What is \d+ \+ [0-2]\?", q) for q in scored | trained)


@pytest.mark.parametrize(
    ("rewards", "blocks", "expected"),
    [
        ([0.1, 0.2, 0.3, 0.4], 2, [(1, 2, 0.15), (3, 4, 0.35)]),
        ([0.5, 0.25, 1.0], 8, [(1, 1, 0.5), (2, 2, 0.25), (3, 3, 1.0)]),
        ([0.0] * 9 + [0.9], 4, [(1, 3, 0.0), (4, 6, 0.0), (7, 9, 0.0), (10, 10, 0.9)]),
        ([], 8, []),
    ],
)
def test_reward_curve_blocks(rewards, blocks, expected):
    from polyrl.cli.demo import reward_curve

    got = reward_curve(rewards, blocks)
    assert [(lo, hi) for lo, hi, _ in got] == [(lo, hi) for lo, hi, _ in expected]
    assert [m for *_, m in got] == pytest.approx([m for *_, m in expected])
