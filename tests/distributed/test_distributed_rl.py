"""``polyrl train --algo grpo --nproc-per-node 2`` (torchrun, gloo, FSDP2, data-parallel rollout) on the tiny preset.

Rollout seeds depend on (seed, step, prompt) only, so two ranks draw the same tokens as one process; rank 0 scores,
every rank trains on its share of each mini-batch with the global normaliser. So the 2-rank run's rewards equal the
one-process run's exactly and its losses within fp32 reduction-order noise, with two optimizer steps per RL step
(mini-batches, KL to a reference, recomputed old log-probs: every collective path). Its sharded checkpoint then
resumes in one process where the one-process run would have been.
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

    # The 2-rank step-2 checkpoint resumes in this one process and takes the one-process run's step 3.
    assert (
        main(["train", "--model", str(tiny_model_dir), "--out", str(two), "--max-steps", "3", "--resume", *args]) == 0
    )
    last = _records(two)[-1]
    assert last["step"] == 3 and last["reward"] == ref[2]["reward"]
    assert last["loss"] == pytest.approx(ref[2]["loss"], abs=TOL)


def test_ppo_under_torchrun_says_what_to_do(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "ppo"
    assert (
        main(
            [
                "train",
                "--model",
                str(tiny_model_dir),
                "--out",
                str(out),
                "--algo",
                "ppo",
                "--max-steps",
                "1",
                "--data",
                "builtin:arithmetic",
            ]
        )
        == 2
    )
    assert "use --algo grpo / gspo under --nproc-per-node" in capsys.readouterr().err
    assert not (out / "checkpoints").exists()
