"""Shared fixtures and helpers for kernel tests: Triton under the interpreter, tolerances, relative L2.

Triton (3.x; checked on 3.9, same design in 3.6) reads ``TRITON_INTERPRET`` when ``@triton.jit``
decorates a function, i.e. at import, not at launch -- and that includes triton's own library functions
(``tl.sum``, ``tl.max``, ... in ``triton.language.standard``). So the variable must be set before
``triton`` is imported anywhere in the process; setting it inside a test is too late. This conftest sets
it when it is loaded (collection time) on a machine without a CUDA-compatible accelerator; the
``triton_kernels`` fixture then checks that triton really is in interpreter mode (skipping, with the
reason, if something imported triton earlier) and re-imports ``polyrl.kernels.<op>.triton`` fresh.

The interpreter (3.9) converts fp32 -> bf16 by truncation where hardware rounds to nearest even, so
bit-exact bf16 comparisons hold only on the device; under the interpreter allow one bf16 ulp.

On a machine with an accelerator nothing is set: the fixture loads the compiled kernels and hands out
that device instead.

Use from a test module in this directory::

    def test_x(triton_kernels, kernel_check):
        fn = triton_kernels.load("rmsnorm")          # the op package's triton.py, attribute = op name
        x = torch.randn(7, 33, device=triton_kernels.device)
        kernel_check.assert_close(fn(x, w), reference(x, w), torch.float32, "y")

``kernel_check`` is a namespace with ``assert_close``, ``rel_l2`` and ``TOL`` (a fixture, because several
test directories have a ``conftest.py`` and ``from conftest import`` would be ambiguous).

``host_reads`` is a ``TorchFunctionMode`` factory that records every tensor operation reading a value back to
the host (``.item()``, ``.tolist()``, ``bool(t)``, indexing with a 0-dim tensor, ...): code meant to run inside
a CUDA graph capture must record none, and this is checkable on the CPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import pytest
import torch
from torch.overrides import TorchFunctionMode

from polyrl.kernels import registry
from polyrl.platform import device as _device

if _device.device_type() != "cuda" and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Tol:
    """Pass when ``rel_l2 <= rel_l2`` and ``max|a - b| <= atol + rtol * max|b|``."""

    rel_l2: float
    atol: float
    rtol: float


# Per dtype, for a kernel compared with the reference evaluated in fp32/fp64 on the same inputs.
TOL: dict[torch.dtype, Tol] = {
    torch.float64: Tol(1e-10, 1e-10, 1e-10),
    torch.float32: Tol(2e-6, 1e-5, 1e-5),
    torch.float16: Tol(2e-3, 2e-3, 4e-3),
    torch.bfloat16: Tol(1.2e-2, 1e-2, 2e-2),
}


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||a - b||_2 / max(||b||_2, tiny)`` in fp64."""
    a, b = actual.detach().double(), expected.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / max(denom, 1e-30)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1.0):
    """Assert shape, finiteness and the dtype's tolerance (times ``scale``) with a message giving the numbers."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    tol = TOL[dtype]
    err = rel_l2(a, b)
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    bound = (tol.atol + tol.rtol * (b.abs().max().item() if b.numel() else 0.0)) * scale
    assert err <= tol.rel_l2 * scale, f"{what}: relative L2 {err:.3e} > {tol.rel_l2 * scale:.1e} ({dtype})"
    assert max_abs <= bound, f"{what}: max abs diff {max_abs:.3e} > {bound:.3e} ({dtype})"


def accelerator() -> str | None:
    """'cuda' when a CUDA-compatible device is present (compiled Triton), else None (interpreter)."""
    return "cuda" if _device.device_type() == "cuda" else None


def interpreter_active() -> bool:
    """True when triton's own library functions were built for the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.standard.sum, InterpretedFunction)


class TritonKernels:
    """Loads ``polyrl.kernels.<op>.triton`` for the device tests should use."""

    def __init__(self, device: str, interpreted: bool):
        self.device = torch.device(device)
        self.interpreted = interpreted

    def load(self, op: str, attr: str | None = None):
        module = importlib.import_module(f"polyrl.kernels.{op}.triton")
        return getattr(module, attr or op)


def _purge_triton_modules() -> None:
    for name in [m for m in sys.modules if m.startswith("polyrl.kernels.") and m.endswith(".triton")]:
        del sys.modules[name]
    registry.reset_cache()


@pytest.fixture
def triton_kernels() -> TritonKernels:
    pytest.importorskip("triton", reason="triton is not installed; Triton kernels are tested only where it is")
    dev = accelerator()
    if dev is not None:
        yield TritonKernels(dev, interpreted=False)
        return
    if not interpreter_active():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set, so it cannot interpret kernels in this "
            "process; run the kernel tests with TRITON_INTERPRET=1 in the environment"
        )
    _purge_triton_modules()
    try:
        yield TritonKernels("cpu", interpreted=True)
    finally:
        _purge_triton_modules()


@pytest.fixture
def seeded():
    """A fixed seed per test so failures reproduce."""
    torch.manual_seed(1234)
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def kernel_check():
    """``assert_close``, ``rel_l2`` and ``TOL`` for tests in this directory."""
    import types

    return types.SimpleNamespace(assert_close=assert_close, rel_l2=rel_l2, TOL=TOL, Tol=Tol)


# Tensor methods that copy a value to the host (a device sync; "operation not permitted" under graph capture).
_HOST_READS = frozenset(("item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"))


class HostReads(TorchFunctionMode):
    """Records host reads done by tensor code run under it (``seen``: the operation names)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in _HOST_READS:
            self.seen.append(name)
        elif name == "__getitem__" and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dim() == 0 for i in index):
                self.seen.append("__getitem__ with a 0-dim tensor (reads it on the host)")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads():
    """``with host_reads() as reads: ...`` then ``assert reads.seen == []``."""
    return HostReads
