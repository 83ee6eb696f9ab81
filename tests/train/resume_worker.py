"""Subprocess body for the kill-and-resume tests: a tiny deterministic CPU training run with checkpoints.

Prints ``loss <k> <loss as float.hex()>`` after each step (and after that step's checkpoint, if any).
``--handshake`` waits for a line on stdin after every step, so the parent can SIGKILL at an exact step.
``--die-in-commit K`` SIGKILLs itself while writing checkpoint K, after its files are written and
before the rename that publishes it. Data order depends on both the data position (saved) and the
global torch RNG (restored), so a resume that lost either would diverge.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from train_helpers import pack, random_seqs, tiny_lm

from polyrl.train import (
    CheckpointConfig,
    CheckpointManager,
    MetricsLogger,
    OptimConfig,
    PrecisionConfig,
    ScheduleConfig,
    StepConfig,
    TrainEngine,
    checkpoint,
    latest_checkpoint,
    load_checkpoint,
)

CORPUS = random_seqs(40, 24, 64, seed=7)


def batch_for(position: int) -> list:
    picks = torch.randint(0, len(CORPUS), (3,))  # global RNG: must be restored exactly on resume
    seqs = [CORPUS[(position * 5 + int(i)) % len(CORPUS)] for i in picks]
    return [pack(seqs[:2]), pack(seqs[2:])]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--handshake", action="store_true")
    ap.add_argument("--die-in-commit", type=int, default=None)
    args = ap.parse_args()

    if args.die_in_commit is not None:
        original = checkpoint._fsync_tree

        def dying_fsync(path):
            original(path)
            if path.name.startswith(f".tmp-step-{args.die_in_commit:08d}"):
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint._fsync_tree = dying_fsync

    model = tiny_lm(seed=0)
    engine = TrainEngine(
        model,
        OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5),
        ScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.1),
        PrecisionConfig(compute_dtype="fp32"),
        StepConfig(deterministic=True, seed=123),
        total_steps=args.steps,
    )
    manager = CheckpointManager(args.run_dir, CheckpointConfig(every_n_steps=args.every, keep_last_k=2))
    start, data_state = 0, {"position": 0}
    last = latest_checkpoint(args.run_dir) if args.resume else None
    if last is not None:
        loaded = load_checkpoint(last, model, engine)
        start, data_state = loaded.step, loaded.data_state
    print(f"start {start}", flush=True)
    log = MetricsLogger(
        args.run_dir, args.steps, start_step=start, progress=False, log_every=10**6, tensorboard=False, plot_series=()
    )
    for _ in range(start, args.steps):
        stats = engine.step(batch_for(data_state["position"]))
        data_state["position"] += 1
        log.log(stats)
        if manager.should_save(stats.step):
            manager.save(stats.step, model, engine, data_state=data_state, config={"steps": args.steps})
        print(f"loss {stats.step} {stats.loss.hex()}", flush=True)
        if args.handshake and not sys.stdin.readline():
            return 1
    manager.save(args.steps, model, engine, data_state=data_state, config={"steps": args.steps})
    log.close(print_table=False)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
