"""Sweep the paged-attention decode kernels' launch settings at the rollout engine's shapes (page 16, D 128) and print,
per shape, each path's default (device time, share of the copy bandwidth) against the best settings found.

    python3 scripts/paged_attention_sweep.py [--reps 20] [--shapes ctx116] [--kv-dtype fp8]

Two paths serve a sequence with one new token (``kernels/paged_attention/triton.py``): "rows", the general kernel
(one program per sequence and KV head), timed at its default only, and "heads", ``decode.py`` (one program per
sequence, chunk of HC KV heads and key-range split), timed at its default and over a grid, in two stages per shape:

1. HC (KV heads a program) in {2, 4, 8} (those <= Hk), keys per tile ``block_n`` in {16, 32, 64} (and 8 where HC is
   8), warps {4, 8}, stages {2, 3, 5}, at the default split count. Stage 4 is left out because Triton 3.9 compiles it
   to the same code as 3, and 5 is the first depth that double-buffers K/V (``decode.decode_settings`` says why).
   Settings whose K/V buffers would pass 200 KB of shared memory (``max(1, stages - 3) * 2 * block_n * HC * D * elem``)
   are left out. That leaves 50 settings at qwen3 heads over a bf16 cache (16 at HC 8, 16 at HC 4, 18 at HC 2), 58
   over FP8, plus both defaults.
2. The three best of stage 1 with 1, 2 and 4 key-range splits (9 more).

So ~60 timings a shape and ~170 distinct compilations over the six shapes (shapes with the same heads and split flag
share compiled kernels). Compiling dominates (~1-2 s a kernel, ~3-5 minutes one at a time), so before each stage every
setting's kernels are compiled in parallel threads (``precompile``: Triton's ``AsyncCompileMode`` and compile-only
launches; ``--no-precompile`` turns it off); each shape prints its seconds.

``--kv-dtype fp8``: the same shapes over a float8_e4m3fn cache (RolloutConfig.kv_cache_dtype, half the bytes).
Over FP8 every setting runs with the default register rule (``decode.register_cap``: 128 registers a thread where
that saves a wave of programs); ``{"max_registers": N}`` in a setting (0: no cap) overrides it.

Each timing is CUDA-graph replays of one call with the L2 flushed in between (``bench.common.time_graph``); bytes are
the K and V the call must read. Use the winners to set ``decode.decode_settings`` / ``decode.decode_splits`` (issue
34: the rows path reads the cache at ~57% of the copy bandwidth at the eval generation's ~116-token contexts). Needs
a CUDA device; measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import time

import torch

from polyrl.bench import common
from polyrl.platform import device

# (label, sequences, context per sequence, block-table capacity in tokens, query heads, KV heads): the engine's block
# tables are as wide as max_model_len, which is what the split heuristics see
SHAPES = [
    ("B512 ctx192 (GRPO rollout)", 512, 192, 640, 16, 8),
    ("B256 ctx256 (bench rollout B256)", 256, 256, 400, 16, 8),
    ("B256 ctx116 (bench eval generation)", 256, 116, 2048, 16, 8),
    ("B64 ctx4096 (4k case)", 64, 4096, 4176, 16, 8),
    ("B1 ctx192 (batch 1)", 1, 192, 272, 16, 8),
    ("B256 ctx256 qwen3-8b heads (Hq 32)", 256, 256, 400, 32, 8),
]
D, PAGE = 128, 16
_SMEM_LIMIT = 200 * 1024


def heads_grid(hk: int, elem: int) -> list[dict]:
    """Stage 1's settings of the "heads" kernel (at the default split count)."""
    grid = []
    for hc in (h for h in (2, 4, 8) if h <= hk):
        for bn in (8, 16, 32, 64) if hc == 8 else (16, 32, 64):
            for warps, stages in itertools.product((4, 8), (2, 3, 5)):
                if max(1, stages - 3) * 2 * bn * hc * D * elem <= _SMEM_LIMIT:
                    grid.append({"kv_heads": hc, "block_n": bn, "num_warps": warps, "num_stages": stages})
    return grid


class _CompileOnly:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` compiles (``warmup``) and launches nothing."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


def precompile(calls: list) -> None:
    """Compile the kernels of every call in parallel threads before the timing loop (Triton's ``AsyncCompileMode``
    with each kernel swapped for a compile-only stand-in), so the loop finds them compiled. Best effort: on any error
    it says so and the timing loop compiles whatever is missing itself, one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from polyrl.kernels.paged_attention import decode
    from polyrl.kernels.paged_attention import triton as paged

    swapped = [(m, n, getattr(m, n)) for m, n in ((decode, "_paged_decode_kernel"), (decode, "_combine_splits_kernel"),
                                                  (paged, "_paged_fwd_kernel"))]  # fmt: skip
    t0 = time.perf_counter()
    try:
        from triton import AsyncCompileMode

        with ThreadPoolExecutor(os.cpu_count() or 4) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for module, name, kernel in swapped:
                setattr(module, name, _CompileOnly(kernel))
            for call in calls:
                call()
    except Exception as exc:  # noqa: BLE001 - the timing loop compiles what is missing
        print(f"  precompile stopped ({type(exc).__name__}: {str(exc)[:120]}); compiling in the timing loop")
    finally:
        for module, name, kernel in swapped:
            setattr(module, name, kernel)
    print(f"  precompiled {len(calls)} calls in {time.perf_counter() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="", help="only the shapes whose label contains this text (default: all)")
    ap.add_argument("--kv-dtype", choices=["bfloat16", "fp8"], default="bfloat16", help="the cache's element type")
    ap.add_argument("--no-precompile", action="store_true", help="compile each setting when it is first timed")
    args = ap.parse_args()
    dev = device.torch_device()
    if dev.type != "cuda":
        print("paged_attention_sweep: needs a CUDA device (the Triton kernels compiled); nothing to do here")
        return
    from polyrl.kernels.paged_attention.decode import decode_settings, decode_splits
    from polyrl.kernels.paged_attention.triton import _paged_attention

    bw = common.measure_copy_bandwidth(dev)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    elem = torch.empty((), dtype=kv_dtype).element_size()
    print(f"# copy bandwidth {bw / 1e9:,.0f} GB/s; D {D}, page {PAGE}, bf16 q, {kv_dtype} cache")
    rows_default = {"decode": "rows"}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for label, b, ctx, capacity, hq, hk in [s for s in SHAPES if args.shapes in s[0]]:
        t0 = time.perf_counter()
        width = -(-capacity // PAGE)
        blocks = b * width
        kc = torch.randn(blocks, PAGE, hk, D, generator=gen).to(dev, kv_dtype)
        vc = torch.randn(blocks, PAGE, hk, D, generator=gen).to(dev, kv_dtype)
        tables = torch.randperm(blocks, generator=gen).view(b, width).to(dev, torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
        q = torch.randn(b, hq, D, generator=gen).to(dev, torch.bfloat16)
        moved = 2 * b * ctx * hk * D * elem

        def call_for(s, q=q, kc=kc, vc=vc, tables=tables, lens=lens, cu=cu):
            tuning = None if s is None else {k: v for k, v in s.items() if k != "splits"}
            splits = None if s is None else s.get("splits")
            return functools.partial(_paged_attention, q, kc, vc, tables, lens, cu, 1, None, None, splits, tuning)

        d = decode_settings(hq // hk, hk, D, elem)
        d_splits = decode_splits(b * -(-hk // d.kv_heads), capacity)
        grid = heads_grid(hk, elem)
        print(f"\n## {label}: Hq {hq}, Hk {hk}; heads default {d} splits {d_splits}; {len(grid)} + 2 settings")
        settings = [None, rows_default, *grid]
        if not args.no_precompile:
            precompile([call_for(s) for s in settings])
        timed = common.sweep_settings(label, settings, call_for, moved, bw, dev, args.reps)
        heads_default = next((ms for ms, s in timed if s == "default"), None)
        rows_ms = next((ms for ms, s in timed if s == rows_default), None)
        if rows_ms is not None:
            ratio = f"; heads default x{rows_ms / heads_default:.2f} over it" if heads_default else ""
            print(f"  rows default {rows_ms * 1e3:.1f} us ({moved / (rows_ms * 1e-3) / bw:.0%} of copy){ratio}")
        best = [s for _, s in timed if isinstance(s, dict) and s.get("decode") != "rows"][:3]
        splits = [{**s, "splits": n} for s in best for n in (1, 2, 4)]
        if splits:
            if not args.no_precompile:
                precompile([call_for(s) for s in splits])
            label = f"{label}, splits of the 3 best"
            common.sweep_settings(label, [None, *splits], call_for, moved, bw, dev, args.reps)
        print(f"  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
