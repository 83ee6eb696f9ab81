"""GPU busy fraction over a wall-clock window, for benchmarks that overlap work (``bench grpo --async``).

- ``NvmlBusy``: NVML utilisation (the share of NVML's last sample period in which a kernel ran) of some devices,
  sampled every 20 ms in a thread; the fraction of a window = the mean of the samples taken inside it. Needs
  ``pynvml`` (the nvidia-ml-py package; the GPU image has it).
- ``EventBusy``: where NVML is missing, device events bracket the phases a caller marks (``span()``); the fraction of
  a window (two ``mark()`` events) is the union of the spans inside it over its length. An upper bound: idle gaps
  inside a span count as busy, and work on streams other than the recording thread's current one is not seen.
- ``open_busy()``: NVML when it imports, else events, None on the CPU (no accelerator: the fraction is n/a).

Not here: what is run while measuring, or any per-kernel profile (``bench/profile.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from polyrl.platform import device

NVML_PERIOD_S = 0.02


class NvmlBusy:
    """NVML utilisation of devices ``indices`` (torch numbering) sampled every ``period`` s (module docstring)."""

    kind = "nvml"

    def __init__(self, nvml: Any, indices: list[int], period: float = NVML_PERIOD_S) -> None:
        self.nvml, self.period = nvml, period
        nvml.nvmlInit()
        self.handles = [_nvml_handle(nvml, i) for i in indices]
        self.samples: list[tuple[float, list[int]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="polyrl-nvml", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                util = [int(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self.handles]
            except self.nvml.NVMLError as exc:  # not supported here (e.g. a MIG slice): no samples, fraction None
                self.error = str(exc)
                return
            self.samples.append((time.perf_counter(), util))

    def fraction(self, t0: float, t1: float, *marks: Any) -> list[float | None]:
        """Per device: mean utilisation (0..1) of the samples taken in [t0, t1] (perf_counter seconds)."""
        inside = [u for t, u in list(self.samples) if t0 <= t <= t1]
        if not inside:
            return [None] * len(self.handles)
        return [sum(u[i] for u in inside) / len(inside) / 100.0 for i in range(len(self.handles))]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.nvml.nvmlShutdown()


def _nvml_handle(nvml: Any, index: int) -> Any:
    """NVML's handle of torch device ``index``: NVML numbers every GPU of the machine, torch only the visible ones
    (``CUDA_VISIBLE_DEVICES``: indices or UUIDs)."""
    visible = [v.strip() for v in device.visible_devices().get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible):
        entry = visible[index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        try:
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        except nvml.NVMLError:  # a UUID prefix (CUDA accepts one, NVML does not): assume the machine's order
            pass
    return nvml.nvmlDeviceGetHandleByIndex(index)


def union_fraction(spans: list[tuple[float, float]], lo: float, hi: float) -> float | None:
    """Length of the union of ``spans`` clipped to [lo, hi], over ``hi - lo`` (None for an empty window)."""
    if hi <= lo:
        return None
    busy, end = 0.0, lo
    for a, b in sorted((max(lo, a), min(hi, b)) for a, b in spans):
        a = max(a, end)
        if b > a:
            busy, end = busy + b - a, b
    return busy / (hi - lo)


class EventBusy:
    """Busy fraction from device events around marked phases (module docstring)."""

    kind = "events"

    def __init__(self) -> None:
        self.ref = self.mark()
        self.spans: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def mark(self) -> Any:
        ev = device.event()
        ev.record()
        return ev

    @contextmanager
    def span(self) -> Iterator[None]:
        a = self.mark()
        try:
            yield
        finally:
            b = self.mark()
            with self._lock:
                self.spans.append((a, b))

    def fraction(self, t0: float, t1: float, w0: Any = None, w1: Any = None) -> list[float | None]:
        """The union of the spans inside the window of events ``w0`` .. ``w1`` over its length (one device)."""
        if w0 is None or w1 is None:
            return [None]
        device.synchronize()
        at = self.ref.elapsed_time  # ms since the reference event
        return [union_fraction([(at(a), at(b)) for a, b in self.spans], at(w0), at(w1))]

    def close(self) -> None:
        pass


def open_busy() -> NvmlBusy | EventBusy | None:
    """The busy-fraction meter of this machine's current device: NVML when it imports, else device events, None on
    the CPU."""
    if not device.is_accelerator():
        return None
    try:
        # lazy: nvidia-ml-py is optional
        import pynvml
    except ImportError:
        return EventBusy() if device.event() is not None else None
    return NvmlBusy(pynvml, [device.current_index()])


__all__ = ["NVML_PERIOD_S", "EventBusy", "NvmlBusy", "open_busy", "union_fraction"]
