"""Sweep the paged-attention decode kernel's launch settings at the rollout engine's shapes (qwen3-0.6b heads, page 16)
and print, per shape, the default's device time and bandwidth against the best setting found.

    python3 scripts/paged_attention_sweep.py [--reps 20] [--kv-dtype fp8]

``--kv-dtype fp8``: the same shapes over a float8_e4m3fn cache (RolloutConfig.kv_cache_dtype, half the bytes).

Each timing is CUDA-graph replays of one call with the L2 flushed in between (``bench.common.time_graph``); bytes are
the K and V the call must read. Settings: keys per tile (``block_n``), warps, pipeline stages, key-range splits. Use
the winners to set the heuristics in ``kernels/paged_attention/triton.py`` (issue 14: attention reads the cache at
78% of the copy bandwidth at 256-token contexts, 90% at 2k). Needs a CUDA device; measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from polyrl.bench import common
from polyrl.platform import device

# (label, sequences, context per sequence, block-table capacity in tokens): the engine's block tables are as wide as
# max_model_len, which is what the split heuristic sees
SHAPES = [
    ("B512 ctx192 (GRPO rollout)", 512, 192, 640),
    ("B256 ctx256 (bench rollout B256)", 256, 256, 400),
    ("B256 ctx116 (bench eval generation)", 256, 116, 2048),
    ("B64 ctx4096 (4k case)", 64, 4096, 4176),
    ("B1 ctx192 (batch 1)", 1, 192, 272),
]
HQ, HK, D, PAGE = 16, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="", help="only the shapes whose label contains this text (default: all)")
    ap.add_argument("--kv-dtype", choices=["bfloat16", "fp8"], default="bfloat16", help="the cache's element type")
    args = ap.parse_args()
    dev = device.torch_device()
    if dev.type != "cuda":
        print("paged_attention_sweep: needs a CUDA device (the Triton kernel compiled); nothing to do here")
        return
    from polyrl.kernels.paged_attention.triton import _paged_attention

    bw = common.measure_copy_bandwidth(dev)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    elem = torch.empty((), dtype=kv_dtype).element_size()
    print(f"# copy bandwidth {bw / 1e9:,.0f} GB/s; Hq {HQ}, Hk {HK}, D {D}, page {PAGE}, bf16 q, {kv_dtype} cache")
    settings = [None] + [
        {"block_n": bn, "num_warps": w, "num_stages": st, "splits": sp}
        for bn, w, st, sp in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (None, 1, 2, 4))
    ]
    gen = torch.Generator(device="cpu").manual_seed(0)
    for label, b, ctx, capacity in [s for s in SHAPES if args.shapes in s[0]]:
        width = -(-capacity // PAGE)
        blocks = b * width
        kc = torch.randn(blocks, PAGE, HK, D, generator=gen).to(dev, kv_dtype)
        vc = torch.randn(blocks, PAGE, HK, D, generator=gen).to(dev, kv_dtype)
        tables = torch.randperm(blocks, generator=gen).view(b, width).to(dev, torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
        q = torch.randn(b, HQ, D, generator=gen).to(dev, torch.bfloat16)
        moved = 2 * b * ctx * HK * D * elem

        def call_for(s, q=q, kc=kc, vc=vc, tables=tables, lens=lens, cu=cu):
            tuning = None if s is None else {k: v for k, v in s.items() if k != "splits"}
            splits = None if s is None else s["splits"]
            return functools.partial(_paged_attention, q, kc, vc, tables, lens, cu, 1, None, None, splits, tuning)

        common.sweep_settings(label, settings, call_for, moved, bw, dev, args.reps)


if __name__ == "__main__":
    main()
