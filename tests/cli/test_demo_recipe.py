"""`make demo`'s recipe (small preset, the noisy arithmetic task, 125 SFT steps, seed 0) with 45 GRPO steps instead of
the shipped 60 (CI time): GRPO's held-out exact match is clearly above SFT's, and the sampled reward rises. SFT
imitates demonstrations of which 60% are off by one, so its greedy accuracy is capped by what it imitated on any
machine; the gain is RL's. A few minutes on 2 cores: marked slow (still in ``make test``, where pytest-xdist starts
this file first, beside the rest).

The 45 steps, measured 2026-12-02 on this project's 2-core machine at 1 torch thread (as a ``make test`` worker runs
it), held-out exact match after SFT -> after GRPO, mean sampled reward first 5 -> last 5 GRPO steps:
  seed 0: 47.4% -> 96.5% (+49.1 points), reward 0.420 -> 0.877 (+0.458)   <- this test
  seed 1: 33.3% -> 57.9% (+24.6 points), reward 0.273 -> 0.527 (+0.254)
  seed 2: 31.6% -> 75.4% (+43.8 points), reward 0.366 -> 0.734 (+0.369)
(the shipped 60 steps: seed 0 47.4% -> 89.5%, reward 0.420 -> 0.920). 30 steps were too few: seed 1 ended at 52.6%
(+19.3 points, reward +0.180), under both bars. The GRPO schedule is constant after 5 warmup steps, so the first 45
steps of the shipped run are these 45 steps (checked: the same rewards step for step)."""

from __future__ import annotations

import re

import pytest

from polyrl.cli.main import main
from polyrl.data import builtin


def test_noisy_demonstrations_keep_the_answer_and_spare_the_test_split():
    spec = "builtin:arithmetic?max=99&max_b=2&ops=+&test=0.2"
    rows = builtin.generate(spec + "&noise=0.6", n=2000)
    off = [r for r in rows if r["completion"] != r["answer"]]
    assert all(int(r["completion"]) == int(r["answer"]) + 1 for r in off)  # one wrong mode: answer + 1
    assert 0.55 < len(off) / len(rows) < 0.65
    assert all(r["completion"] == r["answer"] for r in builtin.generate(spec + "&noise=0.6@test"))
    assert builtin.generate(spec + "&noise=0", n=50) == builtin.generate(spec, n=50)  # no draw without noise
    assert {r["prompt"] for r in builtin.generate(spec + "&noise=0.6@test")} == {
        r["prompt"] for r in builtin.generate(spec + "@test")
    }  # the same held-out problems


@pytest.mark.slow
def test_demo_recipe_grpo_beats_sft(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--rl-steps", "45"]) == 0
    text = capsys.readouterr().out
    final = re.search(r"held-out accuracy: before training ([\d.]+)%, after SFT ([\d.]+)%, after GRPO ([\d.]+)%", text)
    assert final, text[-2000:]
    before, sft, grpo = (float(x) for x in final.groups())
    assert sft <= 60.0  # SFT imitated the flawed demonstrations
    assert grpo >= sft + 20.0, (sft, grpo)  # RL with the exact-match reward fixed them
    gain = re.search(r"GRPO: mean sampled reward ([\d.]+) \(first \d+ steps\) -> ([\d.]+)", text)
    assert gain and float(gain.group(2)) - float(gain.group(1)) >= 0.2
