"""What the async-RL test files share (``test_async_rollout``, ``test_partial_rollouts``, ``test_placement``): the toy
reward, a small GRPO-family run config on the tiny preset, running it, its metrics records, the records of a reference
run made once per test process (``shared_records``: several tests and files compare against the same synchronous and
K = 1 thread runs), and a record without the values that depend on the clock (so two runs' records can be compared
for equality)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

REWARDS = '''
def has_digit(completion, example):
    """1 when the completion holds a digit: a random tiny model writes one in about a third of its samples."""
    return float(any(ch.isdigit() for ch in completion))
'''
# wall-clock values of a step record (besides every ``*_s`` key)
CLOCKS = ("rollout_tokens_per_s", "tokens_per_s", "reward/overlap_frac")


def write_reward(folder: Path) -> str:
    """The toy reward as a ``--reward`` spec (``path:has_digit``)."""
    path = folder / "toy_rewards.py"
    path.write_text(REWARDS)
    return f"{path}:has_digit"


def raw_config(model_dir, out, reward, algo="grpo", steps=3, save_every=0, **algo_kw) -> dict[str, Any]:
    """A raw run config: 4 prompts x 4 samples of 4 new tokens a step, ``steps`` steps, a checkpoint every
    ``save_every`` (0: none); ``algo_kw`` goes into the algorithm's table."""
    table = {"reward": reward, "reward_workers": 0, "prompts_per_step": 4, "samples_per_prompt": 4}
    table = {**table, "max_new_tokens": 4, "rollouts_to_save": 0, **algo_kw}  # algo_kw overrides these
    return {
        "algo": algo,
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 5e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100, "save_final_model": False},
        "checkpoint": {"every_n_steps": save_every, "keep_last_k": 0, "save_final": save_every > 0},
        algo: table,
    }


def run(raw: dict[str, Any]) -> dict[str, Any]:
    from polyrl import run as runner
    from polyrl.run import config

    return runner.run(config.build(raw))


# the records of the reference runs made so far in this process (``shared_records``), by their settings
_SHARED: dict[str, list[dict[str, Any]]] = {}


def shared_records(model_dir, folder: Path, **kw) -> list[dict[str, Any]]:
    """The records of the run ``raw_config(model_dir, folder / "shared-<n>", <the toy reward>, **kw)``, made the first
    time these settings are asked for in this test process (the runs are deterministic: every later caller would
    get the same records, the clocks aside, from a run of its own). A copy: a caller may change it freely."""
    key = json.dumps([str(model_dir), kw], sort_keys=True)
    if key not in _SHARED:
        out = folder / f"shared-{len(_SHARED)}"
        run(raw_config(model_dir, out, write_reward(folder), **kw))
        _SHARED[key] = records(out)
    return copy.deepcopy(_SHARED[key])


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_clocks(rec: dict[str, Any], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """``rec`` without its wall-clock values, nor any key containing one of ``drop``."""
    return {k: v for k, v in rec.items() if not k.endswith("_s") and k not in CLOCKS and not any(d in k for d in drop)}
