"""A reward sum with functions of the user's files trains GRPO on the tiny model (each term logged, the total the
weighted sum, a failing term counted by name), is refused before the model loads when a file term is broken, and
scores ``polyrl eval --reward`` the same way."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main

DATA = "builtin:arithmetic?max=9&n=16"
SMALL = ["--prompts-per-step", "2", "--n", "4", "--max-new-tokens", "6", "--micro-batch-tokens", "256"]
SMALL += ["--report-to", "none", "--log-every", "100", "--lr", "1e-3", "--reward-workers", "1"]
REWARDS = """
def chars(completion, example):
    return len(completion) / 10

def broken(completion, example):
    raise ValueError("no grader for " + example["task"])
"""


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my-rewards.v1.py"
    path.write_text(REWARDS)
    return path


def _train(tiny_model_dir, out, reward, steps):
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out)]
    return main([*argv, "--max-steps", str(steps), "--reward", reward, *SMALL])


def test_grpo_logs_each_term_and_counts_a_failing_one(tiny_model_dir, tmp_path, reward_file, capsys):
    out = tmp_path / "sum"
    assert _train(tiny_model_dir, out, f"exact_match+0.5*{reward_file}:chars", 2) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["reward_failures"] == 0 and r["reward/chars"] > 0
        assert r["reward"] == pytest.approx(r["reward/exact_match"] + 0.5 * r["reward/chars"])

    broken = tmp_path / "broken"
    assert _train(tiny_model_dir, broken, f"exact_match+0.5*{reward_file}:broken", 1) == 0
    rec = json.loads((broken / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["reward_failures_error"] == 8 and rec["reward"] == 0.0 and "reward/broken" not in rec
    summary = json.loads((broken / "summary.json").read_text())
    assert summary["reward_failures"] == {"error": 8, "timeout": 0, "non_number": 0, "crash": 0}
    said = capsys.readouterr()
    assert f"error: {reward_file}:broken: ValueError: no grader for arithmetic (my-rewards.v1.py:6 in broken)" in (
        said.out + said.err
    )


def test_a_broken_file_term_stops_the_run_before_the_model_loads(tmp_path, reward_file, capsys):
    argv = ["train", "--algo", "grpo", "--model", str(tmp_path / "no-model"), "--data", DATA]
    argv += ["--out", str(tmp_path / "out"), "--reward", f"exact_match+0.5*{reward_file}:chars_"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has no function 'chars_' (did you mean chars?); it defines broken, chars" in err and "no-model" not in err


def test_eval_scores_a_sum_with_a_file_term(tiny_model_dir, tmp_path, reward_file):
    out = tmp_path / "eval.json"
    argv = ["eval", "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--model", str(tiny_model_dir)]
    argv += ["--data", DATA, "--limit", "3", "--max-tokens", "6", "--output", str(out)]
    assert main([*argv, "--reward", f"0.5*{reward_file}:chars+length_penalty"]) == 0
    report = json.loads(out.read_text())
    assert report["reward_failures"] == 0 and len(report["samples"]) == 3
    assert any(s["completion"] for s in report["samples"])
    for s in report["samples"]:  # 0.5 * len / 10 - len / 1000
        assert s["reward"] == pytest.approx(0.049 * len(s["completion"]))
