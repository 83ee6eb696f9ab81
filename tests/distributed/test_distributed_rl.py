"""``polyrl train --algo grpo --nproc-per-node 2`` (torchrun, gloo, FSDP2, data-parallel rollout) on the tiny preset.

Rollout seeds depend on (seed, step, prompt) only, so two ranks draw the same tokens as one process; rank 0 scores,
every rank trains on its share of each mini-batch with the global normaliser. So the 2-rank run's rewards equal the
one-process run's exactly and its losses within fp32 reduction-order noise, with two optimizer steps per RL step
(mini-batches, KL to a reference, recomputed old log-probs: every collective path). Its sharded checkpoint then
resumes in one process where the one-process run would have been. PPO (sharded critic) matches one process too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyrl.cli.main import main

REWARD = """
def digits(completion, example):
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
"""
TOL = 1e-4


def _args(reward: str) -> list[str]:
    args = ["--algo", "grpo", "--data", "builtin:arithmetic?max=9&n=64", "--micro-batch-tokens", "48"]
    args += ["--reward", reward, "--reward-workers", "0", "--n", "4", "--prompts-per-step", "3"]
    args += ["--max-new-tokens", "4", "--mini-batches", "2", "--kl-coef", "0.05", "--old-logprobs", "recompute"]
    args += ["--eval-every", "2", "--eval-data", "builtin:arithmetic?max=9&n=6"]  # data-parallel greedy eval too
    return args + ["--lr", "5e-2", "--lr-decay", "constant", "--log-every", "1", "--seed", "0"]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_grpo_matches_one_process_and_resumes(tiny_model_dir, tmp_path):
    reward = tmp_path / "toy.py"
    reward.write_text(REWARD)
    args = _args(f"{reward}:digits")
    two, one = tmp_path / "two", tmp_path / "one"
    cmd = [sys.executable, "-m", "polyrl.cli.main", "train", "--nproc-per-node", "2", "--model", str(tiny_model_dir)]
    cmd += ["--out", str(two), "--max-steps", "2", "--save-every", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((two / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["sharded"] is True and manifest["world_size"] == 2
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and (two / "final" / "config.json").is_file()

    assert main(["train", "--model", str(tiny_model_dir), "--out", str(one), "--max-steps", "3", *args]) == 0
    ref, got = _records(one), _records(two)
    assert len(got) == 2
    for a, b in zip(ref[:2], got):
        assert b["reward"] == a["reward"] and b["response_length"] == a["response_length"]
        assert b["optimizer_steps"] == a["optimizer_steps"] == 2 * b["step"]
        for key in ("loss", "grad_norm", "kl_before", "mismatch_max", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=TOL), key
    assert got[0]["mismatch_max"] < 1e-3  # fp32: the rollout copy and the sharded trainer agree
    assert "eval_reward" in got[1] and got[1]["eval_reward"] == ref[1]["eval_reward"]

    # The 2-rank step-2 checkpoint resumes in this one process and takes the one-process run's step 3.
    assert (
        main(["train", "--model", str(tiny_model_dir), "--out", str(two), "--max-steps", "3", "--resume", *args]) == 0
    )
    last = _records(two)[-1]
    assert last["step"] == 3 and last["reward"] == ref[2]["reward"]
    assert last["loss"] == pytest.approx(ref[2]["loss"], abs=TOL)


def test_two_rank_ppo_matches_one_process(tiny_model_dir, tmp_path):
    """PPO's sharded critic: values, GAE and global advantage whitening over two ranks give the one-process run."""
    reward = tmp_path / "toy.py"
    reward.write_text(REWARD)
    args = ["--algo", "ppo", "--data", "builtin:arithmetic?max=9&n=64", "--micro-batch-tokens", "48"]
    args += ["--reward", f"{reward}:digits", "--reward-workers", "0", "--n", "2", "--prompts-per-step", "3"]
    args += ["--max-new-tokens", "4", "--mini-batches", "2", "--lr", "2e-3", "--lr-decay", "constant", "--seed", "0"]
    args += ["--set", "ppo.critic_warmup_steps=1", "--set", "ppo.critic_lr=3e-3", "--save-every", "2"]
    two, one = tmp_path / "two", tmp_path / "one"
    cmd = [sys.executable, "-m", "polyrl.cli.main", "train", "--nproc-per-node", "2", "--model", str(tiny_model_dir)]
    proc = subprocess.run(
        [*cmd, "--out", str(two), "--max-steps", "2", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    critic_ckpt = two / "critic" / "checkpoints" / "step-00000002" / "manifest.json"
    assert json.loads(critic_ckpt.read_text())["world_size"] == 2
    assert "ForTokenClassification" in (two / "critic" / "final" / "config.json").read_text()

    assert main(["train", "--model", str(tiny_model_dir), "--out", str(one), "--max-steps", "2", *args]) == 0
    ref, got = _records(one), _records(two)
    assert [r["policy_updated"] for r in got] == [0.0, 1.0]
    for a, b in zip(ref, got):
        assert b["reward"] == a["reward"]
        for key in ("value_loss", "values_mean", "returns_mean", "explained_variance", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=TOL), key
    assert got[1]["loss"] == pytest.approx(ref[1]["loss"], abs=TOL)
