"""What validating one op means: ``OpCases`` (input factory, named ``Shape`` sets, outputs, gradients, a ``Tol`` per
dtype, optional plain-torch implementations) and the ``CASES`` registry that ``register_cases`` fills.

``ops_cases.py`` declares every op's cases on these types; ``ops.py`` sweeps them. Not here: the cases
themselves, running anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Tol:
    """Pass when ``rel_l2 <= rel_l2`` and ``max_abs <= atol + rtol * max|reference|``."""

    rel_l2: float
    atol: float
    rtol: float


# Defaults for an implementation compared with an fp64 reference on the same inputs.
DEFAULT_TOL = {
    "float32": Tol(1e-5, 1e-5, 1e-4),
    "float16": Tol(3e-3, 1e-3, 1e-2),
    "bfloat16": Tol(2e-2, 1e-2, 6e-2),
}


@dataclass(frozen=True)
class Shape:
    """A named shape set; ``size`` is "tiny" (interpreter-friendly), "small" (CPU) or "large" (device)."""

    name: str
    params: dict[str, Any]
    size: str = "small"


Inputs = dict[str, Any]  # ordered: the implementation is called with the values positionally


@dataclass
class OpCases:
    """How to validate one op. ``make(params, dtype, device, gen)`` returns the inputs in call order."""

    op: str
    make: Callable[[dict[str, Any], torch.dtype, torch.device, torch.Generator], Inputs]
    shapes: list[Shape]
    outputs: tuple[str, ...]
    grads: tuple[str, ...] = ()
    tol: dict[str, Tol] = field(default_factory=lambda: dict(DEFAULT_TOL))
    # fn, inputs -> output tensors (default: fn(*inputs.values()) normalised to a tuple)
    call: Callable[[Callable[..., Any], Inputs], tuple[torch.Tensor, ...]] | None = None
    # For ops outside the kernel registry: [(impl name, function)], the reference being the first.
    torch_impls: list[tuple[str, Callable[..., Any]]] | None = None
    bf16_dot: bool = False  # its Triton kernels feed bf16 to tl.dot (see interpreter_bf16_dot_ok)
    note: str = ""


CASES: dict[str, OpCases] = {}


def register_cases(cases: OpCases) -> None:
    CASES[cases.op] = cases
