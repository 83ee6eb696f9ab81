"""The harness of ``polyrl bench kernels``: a case (``Case``: an op at one shape, its ``Candidate`` implementations)
built by a function registered with ``@bench(name)`` in ``BENCHES`` from the run's ``Ctx``, and the candidate
builders (``fwd_bwd``, ``forward_only``, ``candidate``). The cases: ``kernels.py`` (and ``kernels_moe.py``, which
it imports); timing and printing: ``kernels.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.kernels import registry
from polyrl.kernels.ops import dtype_name


@dataclass
class Ctx:
    device: torch.device
    dtype: torch.dtype
    shape: dict[str, int]
    tokens: int
    baselines: set[str]
    copy_bw: float
    warmup: int = 3
    reps: int = 20
    graphs: bool = True  # graph-time the cases that ask for it (where the device has CUDA graphs)


@dataclass
class Candidate:
    name: str
    run: Callable[[], Any] | None = None
    skip: str = ""
    note: str = ""


@dataclass
class Case:
    op: str
    case: str
    candidates: list[Candidate]
    bytes_moved: float | None = None
    flops: float | None = None
    target: Callable[[dict[str, dict[str, Any]], Ctx], tuple[str, bool | None]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    base: str = "eager"  # the candidate the "x base" column divides by (speed-up over it)
    graph: bool = False  # also time CUDA-graph replays (launch-bound elementwise ops: device time alone)


BENCHES: dict[str, Callable[[Ctx], list[Case]]] = {}


def bench(name: str):
    def deco(fn):
        BENCHES[name] = fn
        return fn

    return deco


# --- candidate builders --------------------------------------------------------------------------------


def fwd_bwd(fn: Callable[..., Any], args: list[Any], grad_args: set[int]) -> Callable[[], Any]:
    """A closure running ``fn`` forward + backward on fresh leaves (views of ``args``), fixed cotangents."""
    with torch.no_grad():
        probe = fn(*args)
    outs = probe if isinstance(probe, (tuple, list)) else (probe,)
    cots = [torch.randn_like(o) if o.is_floating_point() else None for o in outs]
    del probe, outs

    def run():
        leaves = [a.detach().requires_grad_(True) if i in grad_args else a for i, a in enumerate(args)]
        out = fn(*leaves)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        pairs = [(o, c) for o, c in zip(outs, cots) if c is not None and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])

    return run


def forward_only(fn: Callable[..., Any], args: list[Any]) -> Callable[[], Any]:
    def run():
        with torch.no_grad():
            return fn(*args)

    return run


def candidate(name: str, build: Callable[[], Callable[[], Any]]) -> Candidate:
    try:
        return Candidate(name, build())
    except ImportError as exc:
        return Candidate(name, skip=f"not importable ({exc.name or exc})")
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run here is reported, not fatal
        return Candidate(name, skip=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")


def rand(ctx: Ctx, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=ctx.device, dtype=ctx.dtype) * scale


def impl_name(op: str, t: torch.Tensor) -> str:
    try:
        return registry.select(op, t.device.type, dtype_name(t.dtype))[0]
    except Exception as exc:  # noqa: BLE001
        return f"unavailable ({type(exc).__name__})"
