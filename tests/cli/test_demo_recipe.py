"""`make demo`'s recipe (small preset, the noisy arithmetic task, 125 SFT steps, seed 0) with 30 GRPO steps instead of
the shipped 60 (CI time): GRPO's held-out exact match is clearly above SFT's, and the sampled reward rises. SFT
imitates demonstrations of which 60% are off by one, so its greedy accuracy is capped by what it imitated on any
machine; the gain is RL's. A few minutes on 2 cores: marked slow (still in ``make test``, where pytest-xdist starts
this file first, beside the rest).

Seed 0 at 30 GRPO steps, measured 2026-12-04 on this project's 2-core machine at 1 torch thread (as a ``make test``
worker runs it): held-out exact match 43.9% after SFT -> 96.5% after GRPO (+52.6 points against the test's +20),
mean sampled reward 0.422 (first 5 steps) -> 0.828 (last 5), +0.406 against the test's +0.2; 130 s in all (SFT 58 s).
Measured 2026-12-02 at 45 steps: seed 0 47.4% -> 96.5%, seed 1 33.3% -> 57.9%, seed 2 31.6% -> 75.4%; at 30 steps
seed 1 ended at 52.6% (+19.3 points, reward +0.180), under both bars, which is why this test pins seed 0 (the
recipe's own seed) rather than claiming every seed clears them in 30 steps. The GRPO schedule is constant after 5
warmup steps, so the first 30 steps of the shipped run are these 30 steps."""

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
    assert main(["demo", "--out", str(tmp_path / "demo"), "--rl-steps", "30"]) == 0
    text = capsys.readouterr().out
    final = re.search(r"held-out accuracy: before training ([\d.]+)%, after SFT ([\d.]+)%, after GRPO ([\d.]+)%", text)
    assert final, text[-2000:]
    before, sft, grpo = (float(x) for x in final.groups())
    assert sft <= 60.0  # SFT imitated the flawed demonstrations
    assert grpo >= sft + 20.0, (sft, grpo)  # RL with the exact-match reward fixed them
    gain = re.search(r"GRPO: mean sampled reward ([\d.]+) \(first \d+ steps\) -> ([\d.]+)", text)
    assert gain and float(gain.group(2)) - float(gain.group(1)) >= 0.2
