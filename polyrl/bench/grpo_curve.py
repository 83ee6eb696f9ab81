"""``polyrl bench grpo --task arithmetic --curve-samples N``: the reward curve of synchronous vs asynchronous GRPO
over the same number of samples, so "async learns as fast per sample" can be judged.

The demo's arithmetic task and recipe (``polyrl demo``: a short SFT on flawed demonstrations, ``--curve-sft-steps``;
then GRPO with the exact-match reward, 32 prompts x 8 samples, two optimizer steps per batch, 8 new tokens, lr
3e-4), one GRPO run per K (K = 0 and each ``--async`` K; producer ``--async-producer``) from the same SFT'd model
and seed over ``--curve-samples`` samples. Written per K (``--curve-out``: PATH.json, and PATH.png when matplotlib
imports): the mean sampled reward of each step against the samples seen so far. Printed per K: the first step's
reward, the final window's (last quarter of the steps) mean and std, and the difference from K = 0 in standard
errors of the two means (one seed: how far the step-to-step noise of the window reaches; several seeds are the
stronger test). Not here: step times (``bench/grpo_async.py``); any claim: it measures.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from polyrl.bench.common import free_memory, print_table
from polyrl.bench.grpo_async import TimedRun, parse_ks
from polyrl.errors import ConfigError
from polyrl.run import config as run_config

# ``polyrl demo``'s task and recipe (polyrl/cli/demo.py DEFAULTS; bench must not import the CLI)
DEMO_TASK = "builtin:arithmetic?max=99&max_b=2&ops=+&test=0.2&noise=0.6"
CURVE = {"prompts": 32, "n": 8, "gen_len": 8, "lr": 3e-4, "warmup": 5, "mini_batches": 2, "sft_lr": 1e-3}


def _curve_task(task: str) -> str:
    if task == "arithmetic":
        return DEMO_TASK
    if not task.startswith("builtin:arithmetic"):
        raise ConfigError(f"--task takes 'arithmetic' or a builtin:arithmetic?... spec; got {task!r}")
    return task


def _sft(model_dir: Path, task: str, steps: int, out: Path) -> Path:
    """The demo's SFT stage on ``task`` (flawed demonstrations): the model the curve's GRPO runs start from."""
    raw = {
        "algo": "sft",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": task, "max_seq_len": 128},
        "engine": {"micro_batch_tokens": 1024},
        "optim": {"lr": CURVE["sft_lr"], "weight_decay": 0.0},
        "schedule": {"warmup_steps": min(10, steps // 10), "decay": "constant"},
        "train": {"max_steps": steps, "log_every": 10**6},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 1},
    }
    # lazy: polyrl.run imports every loop; the timing mode needs only the online one
    from polyrl import run as runner

    runner.run(run_config.build(raw), io.StringIO())
    return out / runner.FINAL_DIR


def _curve_raw(model_dir: Path, task: str, out: Path, steps: int, k: int, producer: str) -> dict[str, Any]:
    return {
        "algo": "grpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": task},
        "engine": {"micro_batch_tokens": 1024},
        "optim": {"lr": CURVE["lr"], "weight_decay": 0.0},
        "schedule": {"warmup_steps": min(CURVE["warmup"], steps // 4), "decay": "constant"},
        "train": {"max_steps": steps, "log_every": 10**6, "save_final_model": False},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "grpo": {
            "reward": "exact_match",
            "reward_workers": 0,
            "prompts_per_step": CURVE["prompts"],
            "samples_per_prompt": CURVE["n"],
            "mini_batches": CURVE["mini_batches"],
            "max_new_tokens": CURVE["gen_len"],
            "temperature": 1.0,
            "rollouts_to_save": 0,
            "max_staleness": k,
            "async_producer": producer,
        },
    }


def final_window(rewards: list[float]) -> tuple[float, float, int]:
    """Mean and std of the last quarter of the per-step rewards (at least one step), and its length."""
    w = max(1, len(rewards) // 4)
    tail = rewards[-w:]
    return sum(tail) / w, statistics.pstdev(tail) if w > 1 else 0.0, w


def run_curve(model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The reward-curve mode: reward per sample count for K = 0 and each ``--async`` K (see the module docstring)."""
    task = _curve_task(args.task)
    per_step = CURVE["prompts"] * CURVE["n"]
    steps = args.curve_samples // per_step
    if steps < 1:
        raise ConfigError(f"--curve-samples must be at least one step's {per_step} samples; got {args.curve_samples}")
    ks = parse_ks(args.async_k or "0,1,2")
    start = _sft(model_dir, task, args.curve_sft_steps, work / "sft") if args.curve_sft_steps > 0 else model_dir
    print(
        f"# reward curve: {task}, {steps} GRPO steps x {per_step} samples per K, from {args.curve_sft_steps} SFT steps"
    )
    curves: dict[str, Any] = {"task": task, "samples_per_step": per_step, "curves": {}}
    path = Path(args.curve_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for k in ks:
        t0 = time.perf_counter()
        cfg = run_config.build(_curve_raw(start, task, work / f"curve-k{k}", steps, k, args.async_producer))
        run = TimedRun(cfg, cfg.spec.hooks(cfg.algo_config), io.StringIO(), window=(-1, -1))
        error = None
        try:
            run.run()
        except Exception as exc:  # a failed K keeps the steps it ran; the other Ks still run
            error = f"{type(exc).__name__}: {exc}"
        rewards = [float(r["reward"]) for r in run.records]
        del run
        free_memory()
        mean, std, w = final_window(rewards) if rewards else (None, None, 0)
        curves["curves"][f"k{k}"] = {
            "k": k,
            "samples": [(i + 1) * per_step for i in range(len(rewards))],
            "reward": rewards,
            "final_mean": mean,
            "final_std": std,
            "final_steps": w,
            "wall_s": time.perf_counter() - t0,
            **({"error": error} if error else {}),
        }
        shown = f"final {w}-step mean {mean:.3f} std {std:.3f}" if rewards else "no step finished"
        print(
            f"# K={k}: {len(rewards)} steps, {shown}, {time.perf_counter() - t0:.1f}s" + (f"; {error}" if error else "")
        )
        path.with_suffix(".json").write_text(json.dumps(curves, indent=2))  # after every K: a timeout keeps the rest
    _print_curves(curves)
    png = _plot(curves, path.with_suffix(".png"))
    print(f"# curves: {path.with_suffix('.json')}" + (f", {png}" if png else " (no matplotlib: no PNG)"))
    return {"curve": curves}


def _print_curves(curves: dict[str, Any]) -> None:
    ref = curves["curves"].get("k0", {})
    rows = []
    for c in curves["curves"].values():
        row = {**c, "first": c["reward"][0] if c["reward"] else None}
        if c["final_mean"] is not None and ref.get("final_mean") is not None:
            # difference from K=0 in standard errors of the two final-window means (one seed's step-to-step noise)
            se = math.sqrt((c["final_std"] ** 2 + ref["final_std"] ** 2) / max(1, c["final_steps"]))
            row["diff"] = c["final_mean"] - ref["final_mean"]
            row["diff_se"] = row["diff"] / se if se > 0 else None
        rows.append(row)
    cols = ["k", "first", "final_mean", "final_std", "final_steps", "diff", "diff_se", "wall_s"]
    heads = ["K", "reward step 1", "final mean", "final std", "final steps", "- K=0", "in SE", "wall s"]
    print_table(rows, cols, heads)


def _plot(curves: dict[str, Any], path: Path) -> Path | None:
    try:
        # lazy: matplotlib is optional
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        # lazy: pyplot after the backend is chosen
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in curves["curves"].values():
        ax.plot(c["samples"], c["reward"], label=f"K={c['k']}" + (" (sync)" if c["k"] == 0 else ""))
    ax.set_xlabel("samples")
    ax.set_ylabel("mean sampled reward")
    ax.set_title(curves["task"].split("?")[0] + ": GRPO reward per sample, sync vs async")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
