"""Where a rollout's device time goes: one ``LLM.generate`` under ``torch.profiler``, its kernels on a timeline.

    python3 scripts/rollout_device_profile.py --batch 512 --prompt-len 64 --gen-len 256 [--decode-steps 4]
    python3 scripts/rollout_device_profile.py --shape qwen3-8b --batch 256 --prompt-len 128 --gen-len 256 \
        --weight-precision fp8 --kv-dtype fp8_e4m3      # issue 28: where the FP8 decode step's time goes

Prints, for the profiled run: wall time, kernel time, the share of the wall the device is busy (union of kernel
intervals) and the idle time between kernels (gaps of >= 20 us apart: launch boundaries, host waits), kernel time by
kind (GEMM, attention, sampler, norms, ...) per decode step, and the top kernels. Random qwen3-0.6b-shaped weights
(``--shape``: another preset's), every sample generating exactly ``--gen-len`` tokens; ``--weight-precision fp8`` /
``--kv-dtype fp8_e4m3``: the FP8 rollout paths. Measures; asserts nothing (issue 14's "profile of what is left").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict

import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.decoder import build_model
from polyrl.models.presets import preset_config
from polyrl.platform import device

KINDS = (  # first match wins: (kind, substrings of the kernel name, lower case)
    ("attention", ("paged", "attn", "attention", "flash", "fmha")),
    ("sampler", ("sample", "gumbel", "argmax", "_draw")),
    ("fp8 quantise", ("quant", "amax")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul", "splitk", "skinny", "f8f8")),
    ("norm", ("rmsnorm", "norm")),
    ("rope", ("rope", "rotary")),
    ("kv write", ("kv_write", "reshape_and_cache", "store_kv", "_kv_")),
    ("swiglu", ("swiglu", "silu", "_flat_")),
    ("copy / fill", ("copy", "fill", "memcpy", "memset")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other elementwise"


def kernel_events(trace_path: str) -> list[tuple[float, float, str]]:
    with open(trace_path) as f:
        trace = json.load(f)
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((float(ev["ts"]), float(ev.get("dur", 0.0)), ev.get("name", "?")))
    out.sort()
    return out


def analyse(events: list[tuple[float, float, str]], wall_ms: float, steps: int, top: int) -> None:
    busy, gaps, end, prev = 0.0, [], None, ""
    around: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ts, dur, name in events:
        if end is None or ts >= end:
            if end is not None:
                gaps.append(ts - end)
                if ts - end >= 20.0:  # which kernels a long idle sits between (launch boundaries, host waits)
                    pair = around[(kind_of(prev), kind_of(name))]
                    pair[0] += ts - end
                    pair[1] += 1
            busy += dur
            end = ts + dur
        elif ts + dur > end:
            busy += ts + dur - end
            end = ts + dur
        prev = name
    kernel_us = sum(d for _, d, _ in events)
    span_ms = (events[-1][0] + events[-1][1] - events[0][0]) / 1e3 if events else 0.0
    big = [g for g in gaps if g >= 20.0]
    print(f"wall {wall_ms:.1f} ms, device span {span_ms:.1f} ms, kernels {kernel_us / 1e3:.1f} ms, "
          f"busy {busy / 1e3:.1f} ms ({busy / 1e3 / max(span_ms, 1e-9):.0%} of the span)")  # fmt: skip
    print(f"idle gaps: {len(gaps)} total {sum(gaps) / 1e3:.1f} ms; >= 20 us: {len(big)}, {sum(big) / 1e3:.1f} ms")
    if around:
        print("idle >= 20 us, by the kernels around it: | before -> after | gaps | ms |")
        for (a, b), (us, n) in sorted(around.items(), key=lambda kv: -kv[1][0])[:6]:
            print(f"| {a} -> {b} | {n} | {us / 1e3:.1f} |")
    print(f"decode steps {steps}: wall {wall_ms / steps:.3f} ms/step, kernels {kernel_us / 1e3 / steps:.3f} ms/step")
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for _, dur, name in events:
        k = by_kind[kind_of(name)]
        k[0] += dur
        k[1] += 1
        n = by_name[name[:100]]
        n[0] += dur
        n[1] += 1
    print("| kind | kernels | ms | ms/step | share |\n|---|---:|---:|---:|---:|")
    for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {kind} | {n} | {us / 1e3:.1f} | {us / 1e3 / steps:.3f} | {us / max(kernel_us, 1e-9):.1%} |")
    print("| kernel | calls | ms | share |\n|---|---:|---:|---:|")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name} | {n} | {us / 1e3:.1f} | {us / max(kernel_us, 1e-9):.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--shape", default="qwen3-0.6b", help="a preset whose shape the random model takes")
    ap.add_argument("--weight-precision", choices=["model", "fp8"], default="model", help="rollout projection weights")
    ap.add_argument("--kv-dtype", choices=["auto", "fp8_e4m3"], default="auto", help="KV cache dtype")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    dev = device.torch_device()
    from polyrl.models.presets import PRESETS

    shape = args.shape if args.shape in PRESETS else f"{args.shape}-shape"
    model = build_model(preset_config(shape), dtype=torch.bfloat16, device=dev, seed=0).eval()
    kw = {} if args.decode_steps is None else {"decode_steps": args.decode_steps}
    if args.weight_precision == "fp8":
        kw["weight_precision"] = "fp8"
    if args.kv_dtype != "auto":
        kw["kv_cache_dtype"] = args.kv_dtype
    cfg = RolloutConfig(max_num_seqs=args.batch, max_model_len=args.prompt_len + args.gen_len + 8,
                       max_num_blocks=args.batch * (-(-(args.prompt_len + args.gen_len + 8) // 16)), **kw)  # fmt: skip
    llm = LLM(model, None, cfg)
    llm.capture_graphs(args.batch)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, min(150000, llm.vocab_size), (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.gen_len, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: every bucket, every kernel
    llm.reset_prefix_cache()
    steps0 = llm.num_steps
    device.synchronize()
    # Device activity only: recording every host op would slow the host, which is part of what is measured.
    on_gpu = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        device.synchronize()
        wall = time.perf_counter() - t0
    steps = llm.num_steps - steps0
    path = os.path.join(tempfile.mkdtemp(prefix="polyrl-rollout-prof-"), "trace.json")
    prof.export_chrome_trace(path)
    rate = args.batch * args.gen_len / wall
    print(f"# rollout device profile: {shape}, weights {args.weight_precision}, KV {args.kv_dtype}, "
          f"batch {args.batch}, {args.prompt_len} in / {args.gen_len} out, "
          f"decode_steps {llm.config.decode_steps}, {rate:,.0f} tokens/s under the profiler")  # fmt: skip
    analyse(kernel_events(path), wall * 1e3, max(steps, 1), args.top)


if __name__ == "__main__":
    main()
