"""The ``sft`` validation level: N training steps on the chosen model and a builtin task, then save + reload.

Checks, each with its number: every loss finite and no step skipped by the NaN/Inf guard; the loss falls
by a stated margin (mean of the last 5 steps < 0.9 x mean of the first 5); the saved HF folder reloads to a
model whose logits on a fixed batch equal the trained model's (max abs diff 0 on the CPU, <= 1e-5 x max
|logit| on an accelerator, where kernels may pick other tiles). Reported: tokens/s (median step after the
first), MFU where the device's peak is known, peak device memory (peak RSS on the CPU), and device
utilisation sampled from the platform's smi tool in a background thread while training (skipped with a
reason where no tool answers).

It runs the training engine directly (``TrainEngine.step`` over ``polyrl.data`` packed batches) rather than
the CLI runner, so it needs no run folder. Not here: convergence to a useful model (a few dozen steps only).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import tempfile
import time
from typing import Any

from polyrl.validate import environment, model_source, smi
from polyrl.validate.arg_types import int_at_least, positive_float
from polyrl.validate.result import check, level_result

STEPS, QUICK_STEPS = 40, 12
BATCH_TOKENS, QUICK_BATCH_TOKENS = 512, 256
WINDOW = 5
SEQ_LEN = 128  # rows are cut to this many tokens
MARGIN = 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sft level")
    group.add_argument(
        "--sft-steps",
        type=int_at_least(2 * WINDOW, f" (the loss check compares the first {WINDOW} steps with the last {WINDOW})"),
        default=None,
        help=f"steps (default {STEPS}, quick {QUICK_STEPS}; at least {2 * WINDOW})",
    )
    group.add_argument(
        "--sft-lr", type=positive_float, default=2e-3, help="learning rate (default 2e-3, for random weights)"
    )
    group.add_argument(
        "--sft-batch-tokens",
        type=int_at_least(SEQ_LEN, f" (a row is up to {SEQ_LEN} tokens)"),
        default=None,
        help=f"tokens per packed batch (default {BATCH_TOKENS}, quick {QUICK_BATCH_TOKENS}; at least {SEQ_LEN})",
    )


def _batches(args: argparse.Namespace, tokenizer: Any, dev: Any):
    # lazy: polyrl.data and torch load only when the level runs (the validate CLI imports every level for its parser)
    from polyrl.data import DataConfig, build_sft

    tokens = args.sft_batch_tokens or (QUICK_BATCH_TOKENS if args.quick else BATCH_TOKENS)
    cfg = DataConfig(path=args.task, max_seq_len=SEQ_LEN, seed=args.seed)
    it = build_sft(cfg, tokenizer, micro_batch_tokens=tokens).iterator()
    while True:
        yield next(it).to(dev)


def _logits(model: Any, batch: Any) -> Any:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch

    from polyrl.train.losses import attention_metadata

    with torch.no_grad():
        return model.compute_logits(model(batch.input_ids, batch.position_ids, attention_metadata(batch)))


def _reload_check(model: Any, tokenizer: Any, batch: Any) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch

    from polyrl.models.checkpoint import load_model, save_model
    from polyrl.platform import device

    dtype = next(model.parameters()).dtype
    with tempfile.TemporaryDirectory(prefix="polyrl-validate-sft-") as tmp:
        save_model(model, tmp + "/saved", tokenizer=tokenizer)
        reloaded = load_model(tmp + "/saved", dtype=dtype, device=device.torch_device())
    model.eval()
    before, after = _logits(model, batch), _logits(reloaded, batch)
    model.train()
    diff = float((before - after).abs().max().item())
    scale = float(before.abs().max().item())
    tol = 0.0 if device.device_type() == "cpu" else 1e-5 * scale
    same_params = all(
        torch.equal(p, q) for (_, p), (_, q) in zip(model.state_dict().items(), reloaded.state_dict().items())
    )
    ok = diff <= tol and bool(torch.isfinite(after).all())
    detail = f"{str(dtype).replace('torch.', '')} weights, parameters bitwise equal: {'yes' if same_params else 'no'}"
    return check("save, reload: identical logits", ok, diff, f"<= {tol:.1e}", detail)


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    from polyrl.platform import device
    from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine

    steps = args.sft_steps or (QUICK_STEPS if args.quick else STEPS)
    model, tokenizer, path = model_source.load(args)
    dev = device.torch_device()
    engine = TrainEngine(
        model,
        OptimConfig(lr=args.sft_lr, weight_decay=0.0),
        ScheduleConfig(warmup_steps=2, decay="constant"),
        PrecisionConfig(),
        StepConfig(seed=args.seed),
        total_steps=steps,
    )
    batches = _batches(args, tokenizer, dev)
    device.reset_peak_memory_stats()
    stats = []
    platform_id = environment.collect()["platform"]["id"]
    t0 = time.perf_counter()
    with smi.UtilizationSampler(platform_id, device.current_index()) as sampler:
        for _ in range(steps):
            stats.append(engine.step([next(batches)]))
    wall = time.perf_counter() - t0
    losses = [s.loss for s in stats]
    first = sum(losses[:WINDOW]) / WINDOW
    last = sum(losses[-WINDOW:]) / WINDOW
    finite = all(math.isfinite(x) for x in losses) and all(math.isfinite(s.grad_norm) for s in stats)
    skipped_steps = stats[-1].skipped_total
    checks = [
        check("losses and grad norms finite", finite, sum(not math.isfinite(x) for x in losses), "0 non-finite"),
        check("no step skipped by the NaN/Inf guard", skipped_steps == 0, skipped_steps, "0"),
        check(
            f"loss falls (last-{WINDOW} mean / first-{WINDOW} mean)",
            finite and last < first * MARGIN,
            last / first if first else None,
            f"< {MARGIN}",
            f"{first:.3f} -> {last:.3f}",
        ),
        _reload_check(model, tokenizer, next(batches)),
    ]
    tps = [s.tokens_per_s for s in stats[1:]] or [stats[0].tokens_per_s]
    mfus = [s.mfu for s in stats[1:] if s.mfu is not None]
    peak = device.max_memory_allocated()
    metrics = {
        "model": model_source.describe(args),
        "parameters": model.num_parameters(),
        "task": args.task,
        "steps": steps,
        "compute_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        f"loss_first{WINDOW}_mean": first,
        f"loss_last{WINDOW}_mean": last,
        "tokens_per_s_median": statistics.median(tps),
        "mfu_median": statistics.median(mfus) if mfus else None,
        "peak_memory_bytes": peak if device.is_accelerator() else None,
        "peak_rss_bytes": None
        if device.is_accelerator()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": wall,
        "losses": losses,
    }
    util = sampler.summary()
    notes = []
    if util["status"] == "measured":
        metrics["device_utilization_mean_percent"] = util["mean_percent"]
        metrics["device_utilization_max_percent"] = util["max_percent"]
    else:
        notes.append(f"device utilisation not measured: {util['reason']}")
    del path
    return level_result("sft", checks, metrics, notes)
