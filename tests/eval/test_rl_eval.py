"""Evaluation during RL with ``eval_n`` > 1: a GRPO run's eval records carry the sampled mean reward, unbiased pass@k
(monotone in k, pass@1 = the mean of a 0/1 reward) and mean length, beside the greedy eval reward."""

from __future__ import annotations

import json

import torch

REWARD = "def has_digit(completion, example):\n    return float(any(ch.isdigit() for ch in completion))\n"


def test_grpo_eval_n_reports_pass_at_k(tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config

    torch.set_num_threads(1)
    (tmp_path / "r.py").write_text(REWARD)
    out = tmp_path / "grpo"
    table = {
        "reward": f"{tmp_path / 'r.py'}:has_digit",
        "reward_workers": 0,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "max_new_tokens": 6,
        "eval_prompts": 6,
        "eval_n": 4,
    }
    raw = {
        "algo": "grpo",
        "model": str(tiny_model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 1, "log_every": 100, "eval_every": 1},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "grpo": table,
    }
    runner.run(config.build(raw))
    (rec,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval_reward" in rec  # the greedy evaluation is still there
    p1, p2, p4 = rec["eval_pass@1"], rec["eval_pass@2"], rec["eval_pass@4"]
    assert 0 < p1 < 1 and p1 <= p2 <= p4 <= 1  # a random tiny model writes a digit in some samples
    assert p1 == rec["eval_sampled_reward"]  # 0/1 rewards: pass@1 is the mean reward
    assert 0 < rec["eval_length"] <= 6
