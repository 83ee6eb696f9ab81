"""Programmatic Dependent Launch (PDL) for the decode step's Triton kernels: an opt-in switch, off by default.

Experimental. ``POLYRL_PDL=1`` turns it on; anything else (or unset) leaves every launch exactly as before (the kernels
compile to the same code: their ``PDL`` branch is a constexpr ``False``). Measured once (H100, 2026-12-06,
``scripts/gpu_stage.sh pdl-ab``): rollout B256 0.99x, the eval generation phase 0.97x with it on, so it stays off; the
cuBLAS GEMMs between the decode step's Triton kernels do not take part, so most kernel boundaries keep their gap.

What it does. On Hopper and newer NVIDIA GPUs a kernel launched with the PDL attribute may start while the kernel
before it on the stream is still finishing; its programs then block in ``griddepcontrol.wait`` until that kernel has
completed and its writes are visible. The launch latency and whatever the program does before the wait overlap the
predecessor's tail. Inside a CUDA graph the launch attribute becomes a programmatic edge, so a replayed decode step
(~280 small kernels) can hide part of the gaps between them.

How a kernel takes part (``rmsnorm``'s forward, ``qk_norm_rope_cache``, the paged-attention decode kernel, the general
paged kernel and the split combine, ``swiglu``'s forward):

* it takes a ``PDL: tl.constexpr`` argument and calls ``wait(PDL)`` as its first statement, before loading anything a
  predecessor may have written (and before any store, so it never overwrites what a predecessor still reads);
* it calls ``launch_dependents(PDL)`` after its last load of input data: from then on (once every program got there
  or exited) the next PDL kernel may be scheduled. That is only a scheduling hint: the next kernel's own ``wait``
  still waits for this kernel to complete, so the placement changes timing, never results;
* its Python launcher passes ``**kernel_kwargs(device)``: ``{"PDL": False}`` normally, ``{"PDL": True,
  "launch_pdl": True}`` with the switch on (``launch_pdl`` is Triton's launch option, part of the compile key like
  ``num_warps``; it composes with the other options, e.g. the paged decode kernel's ``maxnreg``).

Kernels launched without the attribute (cuBLAS GEMMs, torch ops, every other Triton kernel) keep the ordinary
stream order: they start only after their predecessor completed, PDL or not. Since every PDL kernel waits before
touching memory, ordering stays transitive: a kernel that completed implies everything before it completed.

``enabled(device)`` decides, per launch: the switch is on, the device is a CUDA device (not ROCm/HIP), of compute
capability 9.0 or more, Triton is not interpreting, and this Triton has both ``gdc_wait`` /
``gdc_launch_dependents`` (``triton.language.extra.cuda``) and the ``launch_pdl`` option (Triton >= 3.4; the H200
machines run 3.6). Anything else runs without PDL, silently; so does a launch traced by ``torch.compile`` (a compiled
training layer: its graph stays as it was, and the decision reads only the variable there, nothing Dynamo cannot
trace). A captured CUDA graph keeps the decision of its capture. Autograd (training) backward kernels are left alone;
the forward kernels above serve training too and take part there as well when the switch is on.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from polyrl.platform import device as platform_device
from polyrl.platform import envvars

try:
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait

    _HAS_GDC = True
except ImportError:  # a Triton without grid dependency control: never called (enabled() is False), but defined
    _HAS_GDC = False

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass


# Compute capability from which the hardware has programmatic dependent launch (Hopper).
MIN_CAPABILITY = (9, 0)


@triton.jit
def wait(PDL: tl.constexpr):
    """First statement of a PDL kernel: block until the previous kernel on the stream completed (a no-op when the
    kernel was not launched with PDL; compiled out when ``PDL`` is False)."""
    if PDL:
        _gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """After a PDL kernel's last load: the next PDL kernel may be scheduled (a hint; compiled out when ``PDL`` is
    False)."""
    if PDL:
        _gdc_launch_dependents()


def requested() -> bool:
    """Whether ``POLYRL_PDL`` asks for PDL (``1``)."""
    return envvars.get(envvars.POLYRL_PDL) == "1"


def interpreting() -> bool:
    """Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(knobs.runtime.interpret)


@functools.cache
def triton_supports_pdl() -> bool:
    """This Triton has the device functions and the NVIDIA backend's ``launch_pdl`` launch option."""
    if not _HAS_GDC:
        return False
    try:
        # lazy: Triton's NVIDIA backend module, which a Triton build without it (or a future layout) may lack
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=16)
def _capability(dev: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``dev`` (asked once per device)."""
    return platform_device.capability(dev.index or 0)


def enabled(device: torch.device | str) -> bool:
    """Whether kernels launched on ``device`` use PDL now (see the module docstring for the rule)."""
    if not requested() or torch.compiler.is_compiling() or interpreting():
        return False
    dev = torch.device(device)
    if dev.type != "cuda" or torch.version.hip is not None or not triton_supports_pdl():
        return False
    cap = _capability(dev)
    return cap is not None and tuple(cap) >= MIN_CAPABILITY


def launch_options(device: torch.device | str) -> dict:
    """Triton launch options: ``{"launch_pdl": True}`` where PDL is enabled on ``device``, else ``{}``."""
    return {"launch_pdl": True} if enabled(device) else {}


def kernel_kwargs(device: torch.device | str) -> dict:
    """The kernel's ``PDL`` constexpr and the matching launch option, from one decision: ``{"PDL": False}`` or
    ``{"PDL": True, "launch_pdl": True}``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
