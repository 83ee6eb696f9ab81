"""``polyrl demo`` (``make demo``): SFT on flawed demonstrations, then GRPO fixes them, on the CPU in a few minutes.

It creates a small random model with polyrl's own ``init-model`` (ChatML tokenizer), measures held-out
exact-match accuracy on a builtin arithmetic task with greedy decoding through the rollout engine, trains
it with ``polyrl train --algo sft`` machinery (the same RunConfig and runner) on demonstrations of which 60% are
off by one (the task's ``noise``), measures again,
then trains it further with ``polyrl train --algo grpo`` (exact-match reward on the same task's train prompts),
prints the mean sampled reward curve, and measures a last time. The demo is a list of stages (``STAGES``); each
takes the ``DemoState``, trains or evaluates, and moves ``state.model_dir`` on to the model the next stage starts
from, so another stage is one function appended to the list. Not a benchmark: numbers are for show.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl import run as runner
from polyrl.agents.demo import run_demo
from polyrl.data import builtin
from polyrl.data.config import DataConfig
from polyrl.data.dataset import load_prompts
from polyrl.errors import ConfigError
from polyrl.eval.distill_demo import DistillDemo, run_distill_demo
from polyrl.models.checkpoint import load_model, load_tokenizer
from polyrl.models.presets import create_model_from_preset
from polyrl.run import config as run_config
from polyrl.run.evaluate import exact_match

# The story: SFT on flawed demonstrations, then RL with a verifier fixes what SFT imitated. The task is "What is
# 57 + 2?" (max 99, second operand <= 2), 20% of the problem space held out by hash (57 problems neither stage trains
# on); 60% of the SFT rows demonstrate an answer one too high (``noise=0.6``; the ``answer`` the reward checks stays
# right), so the SFT'd model's most likely answer is mostly the wrong one while it still samples the right one about
# 40% of the time: GRPO's exact-match reward has a strong signal and the greedy answer flips. SFT: 125 steps of 1024
# tokens, constant lr 1e-3 after 10 warmup steps; GRPO: 60 steps of 32 prompts x 8 samples, two optimizer steps per
# batch, lr 3e-4 after 5 warmup steps. Measured with ``polyrl demo --seed S`` on this project's 2-core CPU machine
# (2026-12-02; held-out exact match after SFT -> after GRPO, GRPO mean sampled reward first 5 -> last 5 steps):
#   seed 0: 38.6% -> 91.2%, reward 0.393 -> 0.868
#   seed 1: 29.8% -> 63.2%, reward 0.277 -> 0.698
#   seed 2: 24.6% -> 84.2%, reward 0.362 -> 0.872
# On 2026-12-05's code (``make demo``, a clean clone), seed 0: 42.1% -> 100.0%, reward 0.422 -> 0.850.
# At 40 GRPO steps seed 1 had only reached 42.1% (0.277 -> 0.639); lr 4e-4 instead made it worse than SFT (26.3%):
# 60 steps at 3e-4 keep the gain clear at every seed tried.
# Why: without the noise (2026-11-29 recipe) SFT alone reached 39-81% depending on the seed AND the machine (float
# differences between CPUs change the SFT trajectory), and where it reached ~80% GRPO had nothing left to fix (80.7%
# -> 78.9% on one machine). With flawed demonstrations SFT's greedy accuracy is capped by what it imitated, whatever
# the machine, and the gain is RL's own. (Earlier findings still hold: GRPO lr 1e-3 collapsed the reward, 5e-4 was
# unstable; a wider task than SFT saw gives RL nothing to sample right.)
DEFAULTS = {
    "preset": "small",
    "task": "builtin:arithmetic?max=99&max_b=2&ops=+&test=0.2&noise=0.6",
    "steps": 125,
    "lr": 1e-3,
    "micro_batch_tokens": 1024,
    "eval_size": 100,
    "rl_steps": 60,
    "rl_lr": 3e-4,
    "rl_warmup": 5,
    "rl_prompts": 32,
    "rl_samples": 8,
    "rl_mini_batches": 2,
}


@dataclass
class DemoState:
    """What stages share: the run folder, the model folder the next stage starts from, and the results."""

    root: Path
    args: argparse.Namespace
    model_dir: Path | None = None
    results: list[tuple[str, float]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)


def held_out(state: DemoState) -> list[Any]:
    """The held-out prompts of the task (never trained on: builtin @test problems)."""

    prompts, _ = load_prompts(DataConfig(path=state.args.task.split("@", 1)[0] + "@test"))
    return prompts[: state.args.eval_size]


def evaluate(state: DemoState, label: str, show: int = 0) -> float:
    """Greedy exact-match accuracy of ``state.model_dir`` on the held-out prompts; records and prints it."""

    model = load_model(state.model_dir)
    result = exact_match(model, load_tokenizer(state.model_dir), held_out(state), max_tokens=8, keep_samples=show)
    state.results.append((label, result.accuracy))
    state.log(f"{label}: held-out exact match {result.correct}/{result.total} = {100 * result.accuracy:.1f}%")
    for prompt, text, answer, ok in result.samples:
        print(f"    {prompt!r:28} -> {text.strip()!r:8} (answer {answer}) {'ok' if ok else 'wrong'}")
    return result.accuracy


# ---- stages -------------------------------------------------------------------------------------
def stage_init(state: DemoState) -> None:
    """Create the random model and measure the untrained accuracy."""

    state.model_dir = create_model_from_preset(state.args.preset, state.root / "base", seed=state.args.seed)
    state.log(f"created a random {state.args.preset} model in {state.model_dir} (polyrl init-model)")
    evaluate(state, "before training", show=2)


def _noise(task: str) -> float:
    """The task's fraction of flawed demonstrations (``noise``), 0 when it has none."""
    _, params, _ = builtin.parse_spec(task)
    return float(params.get("noise", 0.0))


def stage_sft(state: DemoState) -> None:
    """SFT on the task's train split, then the accuracy and a few answers."""

    a = state.args
    out = state.root / "sft"
    raw = {
        "algo": "sft",
        "model": str(state.model_dir),
        "out": str(out),
        "seed": a.seed,
        "data": {"path": a.task, "max_seq_len": 128},
        "engine": {"micro_batch_tokens": a.micro_batch_tokens},
        "optim": {"lr": a.lr, "weight_decay": 0.0},
        "schedule": {"warmup_steps": min(10, a.steps // 10), "decay": "constant"},
        "train": {"max_steps": a.steps, "log_every": max(1, a.steps // 6)},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 1},
    }
    cfg = run_config.build(raw)
    flawed = _noise(a.task)
    shown = f", {100 * flawed:.0f}% of its demonstrations off by one" if flawed else ""
    state.log(f"SFT: {a.steps} steps on {a.task}{shown}, lr {a.lr} (polyrl train --algo sft, run dir {out})")
    runner.run(cfg)
    state.model_dir = out / runner.FINAL_DIR
    evaluate(state, "after SFT", show=a.show)


def reward_curve(rewards: list[float], blocks: int = 8) -> list[tuple[int, int, float]]:
    """The sampled rewards averaged over about ``blocks`` equal runs of steps: (first step, last step, mean)."""
    if not rewards:
        return []
    size = max(1, -(-len(rewards) // blocks))
    out = []
    for i in range(0, len(rewards), size):
        chunk = rewards[i : i + size]
        out.append((i + 1, i + len(chunk), sum(chunk) / len(chunk)))
    return out


def stage_grpo(state: DemoState) -> None:
    """GRPO on the SFT'd model with the exact-match reward on the same task's train prompts: the mean sampled
    reward per step (printed coarsely, then first steps -> last steps), then the held-out accuracy."""

    a = state.args
    out = state.root / "grpo"
    steps = a.rl_steps
    raw = {
        "algo": "grpo",
        "model": str(state.model_dir),
        "out": str(out),
        "seed": a.seed,
        "data": {"path": a.task},  # the train split: no held-out prompt
        "engine": {"micro_batch_tokens": a.micro_batch_tokens},
        "optim": {"lr": a.rl_lr, "weight_decay": 0.0},
        "schedule": {"warmup_steps": min(DEFAULTS["rl_warmup"], steps // 4), "decay": "constant"},
        "train": {"max_steps": steps, "log_every": max(1, steps // 4)},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 1},
        "grpo": {
            "reward": "exact_match",
            "prompts_per_step": a.rl_prompts,
            "samples_per_prompt": a.rl_samples,
            "mini_batches": DEFAULTS["rl_mini_batches"],  # two optimizer steps per rollout batch: ratio != 1, clipped
            "max_new_tokens": 8,
            "temperature": 1.0,
            "reward_workers": 0,  # exact match is safe to run in-process; saves a worker start
        },
    }
    cfg = run_config.build(raw)
    state.log(
        f"GRPO: {steps} steps of {a.rl_prompts} prompts x {a.rl_samples} samples, exact-match reward, lr {a.rl_lr} "
        f"(polyrl train --algo grpo, run dir {out})"
    )
    runner.run(cfg)
    rewards = [json.loads(line)["reward"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    print("    mean sampled reward (temperature 1) by steps:")
    for lo, hi, mean in reward_curve(rewards):
        print(f"    steps {lo:3d}-{hi:<3d} {mean:5.3f} {'#' * round(40 * mean)}")
    k = max(1, min(5, len(rewards) // 3))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    state.log(
        f"GRPO: mean sampled reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k} steps), {last - first:+.3f}"
    )
    state.model_dir = out / runner.FINAL_DIR
    evaluate(state, "after GRPO", show=0)


# name, function. Append a stage to extend the demo.
STAGES: list[tuple[str, Callable[[DemoState], None]]] = [
    ("init", stage_init),
    ("sft", stage_sft),
    ("grpo", stage_grpo),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument("--out", default="runs/demo", help="demo folder (replaced; default runs/demo)")
    parser.add_argument("--preset", default=d["preset"], help=f"model preset (default {d['preset']})")
    parser.add_argument("--task", default=d["task"], help=f"builtin task (default {d['task']})")
    parser.add_argument("--steps", type=int, default=d["steps"], help=f"SFT steps (default {d['steps']})")
    parser.add_argument("--lr", type=float, default=d["lr"], help=f"SFT learning rate (default {d['lr']})")
    parser.add_argument("--micro-batch-tokens", type=int, default=d["micro_batch_tokens"])
    parser.add_argument("--eval-size", type=int, default=d["eval_size"], help="held-out problems to score")
    parser.add_argument("--show", type=int, default=5, help="answers to print after training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rl-steps", type=int, default=d["rl_steps"], help=f"GRPO steps (default {d['rl_steps']})")
    parser.add_argument("--rl-lr", type=float, default=d["rl_lr"], help=f"GRPO learning rate (default {d['rl_lr']})")
    parser.add_argument("--rl-prompts", type=int, default=d["rl_prompts"], help="GRPO prompts per step")
    parser.add_argument("--rl-samples", type=int, default=d["rl_samples"], help="GRPO samples per prompt")
    parser.add_argument("--stages", default=",".join(n for n, _ in STAGES), help="comma-separated stages to run")
    parser.add_argument(
        "--agent",
        action="store_true",
        help="the agentic demo instead: SFT warm-up on calculator tool-call transcripts, then GRPO with --env "
        "calculator; prints held-out tool-call rate, tool-error rate, reward and turns before and after RL "
        "(polyrl.agents.demo; --out, --seed apply)",
    )
    parser.add_argument(
        "--distill",
        action="store_true",
        help="the distillation demo instead: a small teacher SFT'd on the arithmetic task (cached under --out), a "
        "tiny student SFT'd on flawed demonstrations, then on-policy distillation; prints held-out accuracy before "
        "and after (polyrl.eval.distill_demo; --out, --seed apply)",
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "agent", False):
        run_demo(args.out if args.out != "runs/demo" else "runs/demo-agent", seed=args.seed)
        return 0
    if getattr(args, "distill", False):
        run_distill_demo(DistillDemo(out=args.out if args.out != "runs/demo" else "runs/demo-distill", seed=args.seed))
        return 0
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    known = dict(STAGES)
    unknown = [s for s in wanted if s not in known]
    if unknown:
        raise ConfigError(f"unknown demo stage(s) {unknown}; choose from {', '.join(known)}")
    root = Path(args.out)
    if root.exists():
        shutil.rmtree(root)
    state = DemoState(root=root, args=args)
    for name, fn in STAGES:
        if name in wanted:
            fn(state)
    print()
    print("held-out accuracy: " + ", ".join(f"{label} {100 * acc:.1f}%" for label, acc in state.results))
    state.log(f"done; runs in {root}")
    return 0
