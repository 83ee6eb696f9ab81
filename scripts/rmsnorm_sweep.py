"""Sweep the RMSNorm backward kernel's launch settings at the SFT step's shapes (qwen3-0.6b, 8 x 4096 tokens) and print,
per shape, the default's device time and bandwidth against the best settings found.

    python3 scripts/rmsnorm_sweep.py [--tokens 32768] [--reps 20]

Issue 15: the backward took 14 ms for 113 launches of one step (H200 profile, docs/performance.md), about twice
its bandwidth time. Each timing is CUDA-graph replays of one call with the L2 flushed in between
(``bench.common.time_graph``); bytes are what the call must move (s, dy and, fused, dsum read; dx written). Settings:
rows per iteration (``block_m``), warps, persistent programs per multiprocessor. Use the winners to set the
heuristics in ``kernels/rmsnorm/triton.py``. Needs a CUDA device; measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from polyrl.bench import common
from polyrl.platform import device

# (label, rows, columns, fused residual (a dsum), weight gradient): the hidden norms (input / post-attention, fused
# residual), the final norm, and Qwen3's q / k norms over heads (16 and 8 heads of 128 at the 0.6b shape)
SHAPES = [
    ("hidden norm, fused residual", 1, 1024, True, True),
    ("q norm (16 heads x 128)", 16, 128, False, True),
    ("k norm (8 heads x 128)", 8, 128, False, True),
    ("hidden norm, frozen weight (LoRA)", 1, 1024, True, False),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = device.torch_device()
    if dev.type != "cuda":
        print("rmsnorm_sweep: needs a CUDA device (the Triton kernel compiled); nothing to do here")
        return
    from polyrl.kernels.rmsnorm.triton import rmsnorm_backward

    bw = common.measure_copy_bandwidth(dev)
    print(f"# copy bandwidth {bw / 1e9:,.0f} GB/s; {args.tokens} tokens, bf16")
    settings = [None] + [
        {"block_m": bm, "num_warps": w, "per_sm": p}
        for bm, w, p in itertools.product((2, 4, 8, 16, 32, 64), (2, 4, 8, 16), (1, 2, 4, 8, 16))
    ]
    gen = torch.Generator(device="cpu").manual_seed(0)
    for label, per_token, cols, fused, need_dw in SHAPES:
        rows = args.tokens * per_token

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

        s, dy = rand(rows, cols), rand(rows, cols)
        dsum = rand(rows, cols) if fused else None
        weight = rand(cols)
        rstd = torch.rand(rows, generator=gen).to(dev) + 0.5
        moved = (4 if fused else 3) * rows * cols * 2
        tiles = [st for st in settings if st is None or st["block_m"] * cols <= 16384]  # at most 16k elements a tile

        def call_for(st, s=s, dy=dy, dsum=dsum, weight=weight, rstd=rstd, need_dw=need_dw):
            return functools.partial(rmsnorm_backward, dy, dsum, s, weight, rstd, need_dw, st)

        common.sweep_settings(f"{label} [{rows}, {cols}]", tiles, call_for, moved, bw, dev, args.reps)


if __name__ == "__main__":
    main()
