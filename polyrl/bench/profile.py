"""Where one call's device time goes: the top kernels of a ``torch.profiler`` trace as a table.

``kernel_table(fn, top)`` runs ``fn`` once under the profiler (after the caller's warm-up) and returns the
``top`` device kernels by self time with their share of all kernel time, plus the call's wall time, and the
``top`` framework ops (``aten::mul``, ``_FusedLoraLinear``, ...) by the device time of the kernels each launched
itself, which says which line of Python a generic kernel (an elementwise add) came from; the bench commands print
both (``--profile N``) and docs/performance.md keeps them. Names are shortened to their first 120 characters. It
measures; it judges nothing.
"""

from __future__ import annotations

import time
from typing import Any

from torch.profiler import ProfilerActivity, profile

from polyrl.platform import device


def kernel_table(fn: Any, top: int = 20) -> dict[str, Any]:
    """{"wall_ms", "kernel_ms", "rows": [{"kernel", "calls", "ms", "share"}], "ops": [{"op", "calls", "ms",
    "share"}]} for one call of ``fn``."""
    activities = [ProfilerActivity.CPU]
    if device.device_type() == "cuda":
        activities.append(ProfilerActivity.CUDA)
    device.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        device.synchronize()
        wall = time.perf_counter() - t0
    rows, ops = [], []
    for ev in prof.key_averages():
        self_us = getattr(ev, "self_device_time_total", None)
        if self_us is None:
            self_us = getattr(ev, "self_cuda_time_total", 0)
        if not self_us:
            continue
        on_device = getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type)
        if on_device:
            rows.append({"kernel": ev.key[:120], "calls": ev.count, "ms": self_us / 1e3})
        else:  # a framework op: the kernels it launched directly
            ops.append({"op": ev.key[:120], "calls": ev.count, "ms": self_us / 1e3})
    total = sum(r["ms"] for r in rows) or 1.0
    for table in (rows, ops):
        table.sort(key=lambda r: -r["ms"])
        for r in table:
            r["share"] = r["ms"] / total
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(r["ms"] for r in rows), "rows": rows[:top], "ops": ops[:top]}


def print_kernel_table(table: dict[str, Any], title: str) -> None:
    print(f"{title}: wall {table['wall_ms']:.1f} ms, kernels {table['kernel_ms']:.1f} ms")
    print(f"| {'kernel':<80} | calls | ms | share |")
    print(f"|{'-' * 82}|------:|---:|------:|")
    for r in table["rows"]:
        print(f"| {r['kernel'][:80]:<80} | {r['calls']} | {r['ms']:.2f} | {r['share']:.1%} |")
    if table.get("ops"):
        print("by framework op (device time of the kernels each op launched itself):")
        print(f"| {'op':<80} | calls | ms | share |")
        print(f"|{'-' * 82}|------:|---:|------:|")
        for r in table["ops"]:
            print(f"| {r['op'][:80]:<80} | {r['calls']} | {r['ms']:.2f} | {r['share']:.1%} |")
