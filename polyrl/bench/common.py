"""Measurement helpers shared by the benchmarks: timing, copy bandwidth, matmul peak, peak memory, tables.

Timing is the median of repetitions after warm-up, each bracketed by device events (host timer on the
CPU); between repetitions a 256 MiB buffer is overwritten so no run starts with its operands in L2 (kept
outside the timed region). ``time_fn`` runs the callable eagerly, so for small ops it measures Python and
launch overhead as much as the device; ``time_graph`` captures the callable once into a CUDA graph (after
warm-up on a side stream) and times replays, which is the device time alone; where graphs are unavailable
or the capture fails (a host sync inside, say) it says why and the caller keeps the eager number. Copy
bandwidth counts bytes read + written, the same convention as the kernel targets ("85% of copy
bandwidth"). Peak memory is the allocator's peak above
what was allocated when the callable started; ``free_memory`` clears the device between configs. Also the setup the
SFT benches share (``sft.py`` and ``sft_lora.py``): ``enable_hf_checkpointing``; and ``--decoder-options``, the
``DecoderOptions`` of the model a bench builds (``add_decoder_options`` / ``decoder_options``).

Deliberately not here: what to benchmark (``kernels.py``, ``sft.py``, ...) and any pass/fail policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from polyrl.errors import ConfigError
from polyrl.models.decoder import DecoderOptions
from polyrl.platform import device as dev

_FLUSH: dict[str, torch.Tensor] = {}


def _flush_cache(device: torch.device) -> None:
    if device.type == "cpu":
        return
    key = str(device)
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    _FLUSH[key].zero_()


def time_fn(
    fn: Callable[[], Any],
    device: torch.device,
    warmup: int = 3,
    reps: int = 20,
    flush: bool = True,
) -> dict[str, float]:
    """Median / min / mean milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    dev.synchronize()
    times: list[float] = []
    for _ in range(reps):
        if flush:
            _flush_cache(device)
        start, end = (dev.event(), dev.event()) if device.type != "cpu" else (None, None)
        if start is not None and end is not None:
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            dev.synchronize()
            t0 = time.perf_counter()
            fn()
            dev.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return _stats(times)


def _stats(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "mean_ms": statistics.fmean(times)}


def time_graph(
    fn: Callable[[], Any],
    device: torch.device,
    warmup: int = 3,
    reps: int = 20,
    flush: bool = True,
) -> dict[str, Any]:
    """Like ``time_fn`` but timing replays of a CUDA graph of ``fn()`` (captured once after warm-up on a side
    stream). Where graphs are unavailable or the capture fails, returns ``{"error": reason}`` instead."""
    api, streams = dev.graph_api(), dev.stream_api()
    if device.type == "cpu" or api is None or streams is None:
        return {"error": "no CUDA graphs on this device"}
    graph_cls, graph_ctx = api
    graph = None
    try:
        side = streams.Stream()
        side.wait_stream(streams.current_stream())
        with streams.stream(side):  # lazy init, autotuning and allocator growth happen outside the capture
            for _ in range(max(1, warmup)):
                fn()
        streams.current_stream().wait_stream(side)
        dev.synchronize()
        graph = graph_cls()
        with graph_ctx(graph):
            fn()
        dev.synchronize()
        times: list[float] = []
        for _ in range(reps):
            if flush:
                _flush_cache(device)
            start, end = dev.event(), dev.event()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
    except Exception as exc:  # noqa: BLE001 - not capturable here: the caller keeps the eager timing
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
        try:
            dev.synchronize()
        except Exception:  # noqa: BLE001 - a broken capture can leave an error to clear
            pass
        return {"error": reason}
    finally:
        del graph
        dev.empty_cache()
    return _stats(times)


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    if nbytes is None:
        nbytes = 2**30 if device.type != "cpu" else 2**26
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), device, warmup=3, reps=reps, flush=False)["median_ms"]
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def measure_matmul_flops(device: torch.device, n: int | None = None, dtype: torch.dtype | None = None) -> float:
    """Dense ``n x n x n`` matmul FLOP/s (bf16 on accelerators, fp32 on the CPU)."""
    if dtype is None:
        dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    if n is None:
        n = 8192 if device.type != "cpu" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_fn(lambda: a @ b, device, warmup=3, reps=10, flush=False)["median_ms"]
    return 2 * n**3 / (ms * 1e-3)


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes the allocator's peak rose above what was allocated when ``fn`` started; None on the CPU."""
    if device.type == "cpu":
        return None
    dev.synchronize()
    dev.reset_peak_memory_stats()
    base = dev.memory_allocated()
    fn()
    dev.synchronize()
    return max(0, dev.max_memory_allocated() - base)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    """Aligned plain-text table of ``rows`` (missing cells print as ``-``)."""
    head = list(headers or columns)
    cells = [head] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None) -> None:
    print(format_table(rows, columns, headers))


def free_memory() -> None:
    """Collect garbage, release the allocator's cached device memory and restart the peak counter, so the next
    config's peak is its own (its resident model and steps, not what ran before or its loading temporaries)."""
    gc.collect()
    dev.empty_cache()
    dev.reset_peak_memory_stats()


def enable_hf_checkpointing(model: Any) -> None:
    """Every decoder layer of an HF model recomputed in the backward, non-reentrant (what ``--activation-checkpointing``
    gives our side): ``activation_checkpointing_enable`` where transformers has it, the older name before that."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


_BOOLS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def add_decoder_options(parser: argparse.ArgumentParser) -> None:
    """``--decoder-options name=on|off,...``: the ``DecoderOptions`` of the polyrl model the bench builds."""
    names = ", ".join(f.name for f in dataclasses.fields(DecoderOptions))
    parser.add_argument(
        "--decoder-options",
        default="",
        metavar="SPEC",
        help=f"polyrl's model: DecoderOptions fields to change from their defaults, e.g. "
        f"skip_frozen_down_recompute=off (fields: {names})",
    )


def decoder_options(spec: str | None) -> DecoderOptions:
    """``DecoderOptions`` from a ``--decoder-options`` spec (``"name=on,other=off"``; "" for the defaults)."""
    fields = {f.name for f in dataclasses.fields(DecoderOptions)}
    changes: dict[str, bool] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if name not in fields or value not in _BOOLS:
            raise ConfigError(
                f"--decoder-options: {item.strip()!r} is not NAME=on|off with NAME one of {', '.join(sorted(fields))}"
            )
        changes[name] = _BOOLS[value]
    return DecoderOptions(**changes)


def shape_preset(shape: str, shapes: dict[str, str]) -> str:
    """The model preset a bench ``--shape`` names: a key of ``shapes`` (``qwen3-0.6b`` -> ``qwen3-0.6b-shape``), or
    one with a ``-LN`` suffix keeping the first N layers (``qwen3-30b-a3b-L8``); a clear error otherwise."""
    if shape in shapes:
        return shapes[shape]
    base, sep, layers = shape.rpartition("-L")
    if sep and layers.isdigit() and base in shapes:
        return f"{shapes[base]}-L{layers}"
    raise ConfigError(
        f"unknown --shape {shape!r}; choose one of {', '.join(shapes)} (a -LN suffix keeps the first N layers, "
        "e.g. qwen3-30b-a3b-L8)"
    )


def hf_moe_kwargs(cfg: Any, variant: str) -> dict[str, Any]:
    """transformers' ``from_config`` kwargs for an MoE shape: its experts through ``torch._grouped_mm`` (transformers
    5's default and fastest training path), or the per-expert loop for an ``*eager-experts*`` variant; nothing for a
    dense shape."""
    if not getattr(cfg, "is_moe", False):
        return {}
    return {"experts_implementation": "eager" if "eager-experts" in variant else "grouped_mm"}


def gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**30


def sweep_settings(
    label: str,
    settings: Sequence[Any],
    call_for: Callable[[Any], Callable[[], Any]],
    moved_bytes: int,
    bandwidth: float,
    device: torch.device,
    reps: int = 20,
    top: int = 5,
) -> list[tuple[float, Any]]:
    """Time ``call_for(s)()`` as graph replays for each launch setting ``s`` (None: the kernel's own heuristics,
    printed as "default") and print the default's time and share of the copy bandwidth, then the ``top`` fastest
    with their speed-up over it; a setting that fails (e.g. too much shared memory) is printed with its reason.
    Returns ``[(median_ms, setting)]``, fastest first. For the ``scripts/*_sweep.py`` launch-setting sweeps."""
    rows = []
    for s in settings:
        timed = time_graph(call_for(s), device, warmup=2, reps=reps)
        if "error" in timed:
            print(f"  {s}: {timed['error'][:100]}")
        else:
            rows.append((timed["median_ms"], "default" if s is None else s))
    rows.sort(key=lambda r: r[0])
    default = next((ms for ms, s in rows if s == "default"), None)
    if default is None:
        print(f"{label}: the default setting could not be timed; nothing to compare")
        return rows
    print(f"{label}: default {default * 1e3:.1f} us ({moved_bytes / (default * 1e-3) / bandwidth:.0%} of copy)")
    for ms, s in rows[:top]:
        print(f"  {ms * 1e3:8.1f} us  {moved_bytes / (ms * 1e-3) / bandwidth:5.0%}  x{default / ms:.2f}  {s}")
    return rows
