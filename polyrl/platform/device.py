"""The runtime device interface the rest of polyrl calls (nothing outside ``polyrl.platform`` touches
``torch.cuda`` or a vendor module directly).

Resolution of *which* platform this is lives in ``resolve``; this module only asks torch, lazily,
for the accelerator it exposes: a vendor extension module (``torch.npu``, ``torch.musa``,
``torch.mlu``, ``torch.xpu``) first, then ``torch.cuda`` (CUDA, ROCm and CUDA-compatible stacks),
then MPS, then the CPU. It does not initialise a device at import.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform as _pl
import random
from collections.abc import Callable
from typing import Any

import torch

from polyrl.errors import UserError
from polyrl.platform import envvars, kb
from polyrl.platform.fp8 import fp8_gemm_from_facts

try:
    import numpy as np
except ImportError:  # numpy is optional under torch; its RNG is seeded and saved only when present
    np = None

# Device types probed in order; vendor extensions first because their shims make torch.cuda answer.
_VENDOR_MODULES = ("npu", "musa", "mlu", "xpu")
# Collective backend per torch device type (platform-specific overrides come from the knowledge base).
_COLLECTIVE = {
    "cuda": "nccl",
    "npu": "hccl",
    "musa": "mccl",
    "mlu": "cncl",
    "xpu": "xccl",
    "cpu": "gloo",
    "mps": "gloo",
}


def _module(device_type: str) -> Any | None:
    return getattr(torch, device_type, None)


@functools.lru_cache(maxsize=1)
def device_type() -> str:
    """The accelerator's torch device type ("cuda", "npu", "musa", "mlu", "xpu", "mps") or "cpu"."""
    for name in _VENDOR_MODULES:
        mod = _module(name)
        try:
            if mod is not None and hasattr(mod, "is_available") and mod.is_available():
                return name
        except Exception:  # noqa: BLE001 - a broken vendor module means "not this one"
            continue
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def is_accelerator() -> bool:
    return device_type() != "cpu"


def torch_device(index: int | None = None) -> torch.device:
    dt = device_type()
    if dt == "cpu" or index is None:
        return torch.device(dt) if dt == "cpu" else torch.device(dt, current_index())
    return torch.device(dt, index)


def _mod():
    return _module(device_type())


def _type_count(dt: str) -> int:
    """How many devices of torch device type ``dt`` torch can use here (0: none, or no such backend)."""
    if dt == "cpu":
        return 1
    try:
        if dt == "mps":
            mps = getattr(torch.backends, "mps", None)
            return int(mps is not None and mps.is_available())
        mod = _module(dt)
        if mod is None or not hasattr(mod, "is_available") or not mod.is_available():
            return 0
        return int(mod.device_count()) if hasattr(mod, "device_count") else 1
    except Exception:  # noqa: BLE001 - a broken backend module means "none of these"
        return 0


def parse_device(spec: str, flag: str = "--device") -> torch.device:
    """A device a user named (``cpu``, ``cuda``, ``cuda:1``, ``npu:0``, ...) as a ``torch.device``; a ``UserError``
    naming what this machine has when torch does not know the name, no device of that type is usable here, or the
    index is past the last one (instead of torch's "Expected one of cpu, cuda, ..." traceback, or a failure deep in
    the checkpoint loader)."""
    dt = device_type()
    n = count()
    has = "cpu" if dt == "cpu" else f"cpu or {dt} ({n} device(s): {dt}:0 to {dt}:{max(n - 1, 0)})"
    way_out = f"use {has}, or leave {flag} out for the default ({torch_device()})"
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        raise UserError(f"{flag} {spec!r} is not a device torch knows; {way_out}") from None
    usable = _type_count(dev.type)
    if usable == 0:
        raise UserError(f"{flag} {spec}: this machine has no {dev.type} device torch can use; {way_out}")
    if dev.index is not None and dev.type != "cpu" and dev.index >= usable:
        raise UserError(f"{flag} {spec}: there are only {usable} {dev.type} device(s) here; {way_out}")
    return dev


def count() -> int:
    dt = device_type()
    if dt == "cpu":
        return 0
    if dt == "mps":
        return 1
    return int(_mod().device_count())


def current_index() -> int:
    dt = device_type()
    if dt in ("cpu", "mps"):
        return 0
    return int(_mod().current_device())


def set_device(index: int) -> None:
    if device_type() not in ("cpu", "mps"):
        _mod().set_device(index)


def synchronize() -> None:
    dt = device_type()
    if dt != "cpu":
        _mod().synchronize()


def empty_cache() -> None:
    dt = device_type()
    if dt != "cpu" and hasattr(_mod(), "empty_cache"):
        _mod().empty_cache()


def max_memory_allocated() -> int:
    dt = device_type()
    if dt == "cpu":
        return 0
    fn = getattr(_mod(), "max_memory_allocated", None)
    return int(fn()) if fn else 0


def memory_allocated() -> int:
    dt = device_type()
    if dt == "cpu":
        return 0
    fn = getattr(_mod(), "memory_allocated", None)
    return int(fn()) if fn else 0


def reset_peak_memory_stats() -> None:
    dt = device_type()
    if dt != "cpu" and hasattr(_mod(), "reset_peak_memory_stats"):
        _mod().reset_peak_memory_stats()


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes on the current device; (0, 0) where unknown. With ``POLYRL_DEVICE_MEMORY_SHARE`` = s, the
    device looks s times its size to this process: total * s, and free = what of that share this process has not
    allocated yet (at most the device's free memory plus the unused memory its allocator holds)."""
    dt = device_type()
    fn = getattr(_mod(), "mem_get_info", None) if dt != "cpu" else None
    if not fn:
        return (0, 0)
    free, total = (int(x) for x in fn())
    share = memory_share()
    if share < 1.0:
        total = int(total * share)
        mod = _mod()
        allocated = int(mod.memory_allocated()) if hasattr(mod, "memory_allocated") else 0
        cached = int(mod.memory_reserved()) - allocated if hasattr(mod, "memory_reserved") else 0
        # what this process can still take: its share minus what it uses; the device's free memory plus what this
        # process's allocator holds unused (free blocks it reuses before asking the device) caps it
        free = max(0, min(free + cached, total - allocated))
    return free, total


def memory_share() -> float:
    """``POLYRL_DEVICE_MEMORY_SHARE`` as a fraction in (0, 1] (1 when unset); anything else is a ``UserError``."""
    raw = envvars.get(envvars.POLYRL_DEVICE_MEMORY_SHARE)
    if raw is None:
        return 1.0
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise UserError(f"POLYRL_DEVICE_MEMORY_SHARE must be a fraction in (0, 1], e.g. 0.3; got {raw!r}")
    return share


def name(index: int = 0) -> str:
    dt = device_type()
    if dt == "cpu":
        return _pl.processor() or _pl.machine() or "cpu"
    fn = getattr(_mod(), "get_device_name", None)
    return str(fn(index)) if fn else dt


def capability(index: int = 0) -> tuple[int, int] | None:
    dt = device_type()
    fn = getattr(_mod(), "get_device_capability", None) if dt != "cpu" else None
    try:
        return tuple(fn(index)) if fn else None  # type: ignore[return-value]
    except Exception:  # noqa: BLE001
        return None


@functools.lru_cache(maxsize=16)
def multiprocessors(dev: torch.device, default: int = 1) -> int:
    """Multiprocessors (SMs, CUs) of ``dev``, asked once per device; ``default`` where the backend has no such count
    (the CPU). Kernels size persistent grids and wave counts by it."""
    backend = getattr(torch, dev.type, None)
    if dev.type != "cpu" and backend is not None and hasattr(backend, "get_device_properties"):
        return int(getattr(backend.get_device_properties(dev), "multi_processor_count", default))
    return default


def supports_bf16() -> bool:
    dt = device_type()
    if dt == "cpu":
        return True
    fn = getattr(_mod(), "is_bf16_supported", None)
    try:
        return bool(fn()) if fn else True
    except Exception:  # noqa: BLE001
        return False


def supports_fp8_gemm(index: int = 0) -> bool:
    """Whether this device runs FP8 GEMMs (``torch._scaled_mm``): ``fp8_gemm_from_facts`` on the live device."""
    if device_type() != "cuda":
        return False
    hip = getattr(torch.version, "hip", None) is not None
    arch = None
    if hip:
        try:
            arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", None)
        except Exception:  # noqa: BLE001
            arch = None
    return fp8_gemm_from_facts("cuda", capability(index), hip, arch)


def supports_graphs() -> bool:
    """CUDA graphs: on torch.cuda devices (NVIDIA, ROCm, CUDA-compatible stacks)."""
    return device_type() == "cuda"


def collective_backend() -> str:
    return _COLLECTIVE.get(device_type(), "gloo")


def visible_devices() -> dict[str, str]:
    """The visible-devices variables this device type honours (knowledge-base facts) that are set, with values.

    On ``cuda`` the HIP stacks (ROCm, Hygon) and the CUDA stacks honour different variables; torch.version.hip
    tells them apart. Variables of other platforms are ignored here (``polyrl check`` warns about them).
    """
    dt = device_type()
    hip = bool(getattr(torch.version, "hip", None))
    names: set[str] = set()
    for p in kb.platforms().values():
        if p.device_type == dt and (dt != "cuda" or p.torch_hip == hip):
            names.update(p.visible_devices)
    return {n: os.environ[n] for n in sorted(names) if n in os.environ}


def manual_seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % (2**32))
    dt = device_type()
    if dt != "cpu" and hasattr(_mod(), "manual_seed_all"):
        _mod().manual_seed_all(seed)


def get_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    dt = device_type()
    if dt != "cpu" and hasattr(_mod(), "get_rng_state_all"):
        state["device"] = _mod().get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    dt = device_type()
    if "device" in state and dt != "cpu" and hasattr(_mod(), "set_rng_state_all"):
        _mod().set_rng_state_all(state["device"])


# Peak dense bf16 FLOP/s by device-name substring, for MFU. Datasheet values (dense, no sparsity).
_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("4090", 165e12),
    ("MI300X", 1307e12),
    ("MI250", 362e12),
)


def peak_bf16_flops(index: int = 0) -> float | None:
    """Datasheet dense bf16 FLOP/s for MFU, or None where unknown (the CPU)."""
    if device_type() == "cpu":
        return None
    dev_name = name(index)
    for key, flops in _PEAK_BF16:
        if key in dev_name:
            return flops
    return None


def event(enable_timing: bool = True) -> Any:
    """A device event (``torch.cuda.Event`` and its vendor equivalents); None on the CPU."""
    dt = device_type()
    if dt == "cpu":
        return None
    ev_cls = getattr(_mod(), "Event", None)
    return ev_cls(enable_timing=enable_timing) if ev_cls else None


def graph_api() -> tuple[Any, Any] | None:
    """(CUDAGraph class, graph context manager) where CUDA graphs work, else None.

    The context manager is ``graph_capture``: ``torch.cuda.graph``'s, made safe against a failing capture."""
    if not supports_graphs():
        return None
    return torch.cuda.CUDAGraph, graph_capture


@contextlib.contextmanager
def graph_capture(graph: Any, **kwargs: Any):
    """``torch.cuda.graph(graph, **kwargs)`` that leaves the process usable when the capture fails.

    When captured code does something a capture forbids (a host sync, say), the capture is invalidated and
    ``torch.cuda.graph.__exit__`` raises from ``capture_end`` before it (a) leaves the capture stream, and
    before torch (b) takes the CUDA RNG out of capture mode: every later random op on the device then fails
    with "Offset increment outside graph capture". Here the original error is raised after both are undone:
    the stream context is exited and an empty capture runs a whole prologue/epilogue on the RNG state.
    """
    ctx = torch.cuda.graph(graph, **kwargs)
    ctx.__enter__()
    try:
        yield graph
    except BaseException as exc:
        _abandon_capture(ctx, exc)
        raise
    try:
        ctx.__exit__(None, None, None)
    except BaseException as exc:
        _abandon_capture(ctx, exc, ended=True)
        raise


def _abandon_capture(ctx: Any, exc: BaseException, ended: bool = False) -> None:
    if not ended:
        with contextlib.suppress(Exception):  # ends the stream capture; raises for an invalidated one
            ctx.cuda_graph.capture_end()
    stream_ctx = getattr(ctx, "stream_ctx", None)
    if stream_ctx is not None:
        with contextlib.suppress(Exception):
            stream_ctx.__exit__(type(exc), exc, exc.__traceback__)
    with contextlib.suppress(Exception):  # the capture's own error is the one to report
        _reset_rng_capture_state()


def _reset_rng_capture_state() -> None:
    """A capture that ends cleanly resets the default CUDA generator's capture state (its epilogue)."""
    scratch = torch.zeros(1, device=torch_device())
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        scratch.add_(1)


def is_capturing(t: torch.Tensor | None = None) -> bool:
    """Whether the current stream (of ``t``'s device, when given) is capturing a CUDA graph; False off CUDA."""
    if t is not None and not t.is_cuda:
        return False
    if not supports_graphs():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def stream_api() -> Any | None:
    """The device's stream module namespace (``torch.cuda``-like) for graph warm-up streams, or None."""
    return torch.cuda if supports_graphs() else None


_SIDE_STREAMS: dict[Any, list[Any]] = {}


def run_concurrently(fns: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """``[fn() for fn in fns]`` with each call on its own stream where the device has streams: the first on the
    current stream, the others on side streams forked from it and joined back, so their kernels may overlap (under
    CUDA-graph capture they become parallel branches of the graph). The results are ready for the current stream.
    The calls must only queue device work (no host reads). Sequential on the CPU."""
    api = stream_api()
    if api is None or len(fns) < 2:
        return [fn() for fn in fns]
    main = api.current_stream()
    sides = _SIDE_STREAMS.setdefault(main.device, [])
    while len(sides) < len(fns) - 1:
        sides.append(api.Stream(device=main.device))
    outs: list[Any] = [None] * len(fns)
    for i, fn in enumerate(fns[1:]):
        sides[i].wait_stream(main)
        with api.stream(sides[i]):
            outs[i + 1] = fn()
    outs[0] = fns[0]()
    capturing = bool(torch.cuda.is_current_stream_capturing())
    for i in range(len(fns) - 1):
        main.wait_stream(sides[i])
        if not capturing and isinstance(outs[i + 1], torch.Tensor):
            outs[i + 1].record_stream(main)  # allocated on the side stream, used (and freed) on this one
    return outs
