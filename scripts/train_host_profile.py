"""Where a training step's wall time goes on the GPU machine: the step of ``polyrl bench sft`` (full, ``--lora`` or
``--qlora``) under cProfile, next to the same step's wall time without the profiler and the device kernel time of
one step. Step wall well above kernel time means the host is the bound, and the cProfile table says where.

    python3 scripts/train_host_profile.py [--shape qwen3-1.7b] [--seq 4096] [--batch 2] [--lora r=16,alpha=32]
                                          [--qlora] [--activation-checkpointing] [--top 30]

Random weights. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from polyrl.bench import sft, sft_lora
from polyrl.bench.profile import kernel_table
from polyrl.platform import device


def main() -> None:
    ap = argparse.ArgumentParser()
    sft.add_arguments(ap)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    dev = device.torch_device()
    cfg = sft.model_config(args.shape)
    tokens = sft.random_tokens(cfg.vocab_size, args.batch, args.seq, args.seed)
    lora = args.lora is not None or args.qlora
    step = sft_lora.ours_step_fn(cfg, tokens, args, dev) if lora else sft.ours_step_fn(cfg, tokens, args, dev)
    for _ in range(3):
        step()
    device.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    device.synchronize()
    wall = (time.perf_counter() - t0) / 3
    kernels = kernel_table(step, 1)["kernel_ms"]
    prof = cProfile.Profile()
    device.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    step()
    device.synchronize()
    prof.disable()
    profiled = time.perf_counter() - t0
    print(
        f"step wall {wall * 1e3:.1f} ms (no profiler), device kernels {kernels:.1f} ms, "
        f"under cProfile {profiled * 1e3:.1f} ms"
    )
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
