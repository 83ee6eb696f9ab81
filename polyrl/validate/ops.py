"""The ``ops`` validation level: every op x available implementation x dtype x shape against the reference.

Each op declares its cases in a registry (``CASES``, filled by ``ops_cases.py``): an input factory over
named shapes (awkward sizes: 1, 7, 127, 1025, a vocab that is not a multiple of any block), which inputs
get gradients, the names of its outputs, and a tolerance per dtype. For each combination the sweep runs
the implementation on inputs of the test dtype and the op's reference on the *same values* upcast to
fp64 (fp32 where the device has no fp64), with the same cotangents, and reports per output and per
gradient: max abs diff, relative L2 error, all-finite, and pass/fail under the declared tolerance.

Implementations come from the kernel registry (plain torch rows such as ``silu``/``linear`` bring their
own). One that does not declare the device/dtype is "skipped"; one that fails to import is "unavailable";
neither stops the sweep. On the CPU, Triton implementations run under the interpreter when
``TRITON_INTERPRET=1`` is set (before triton is imported), on the "tiny" shapes only.

Deliberately not here: timing (``polyrl bench kernels``), multi-device checks, the report file format
(the CLI writes what ``run_level`` returns).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SIZES = ("tiny", "small", "large")


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


def _call(cases: OpCases, fn: Callable[..., Any], inputs: Inputs) -> tuple[torch.Tensor, ...]:
    if cases.call is not None:
        return tuple(cases.call(fn, inputs))
    out = fn(*inputs.values())
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _cast_inputs(inputs: Inputs, dtype: torch.dtype, grads: tuple[str, ...]) -> Inputs:
    """Float tensors -> ``dtype`` (fresh leaves; gradients where listed); everything else as is."""
    cast: Inputs = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().to(dtype).clone().requires_grad_(name in grads)
        cast[name] = value
    return cast


def _cotangents(outs: tuple[torch.Tensor, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor | None]:
    """Fixed random cotangents, exactly representable in the test dtype, as fp64 on the output's device."""
    gen = torch.Generator().manual_seed(seed)
    cots: list[torch.Tensor | None] = []
    for o in outs:
        if not (isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad):
            cots.append(None)
            continue
        cots.append(torch.randn(o.shape, generator=gen, dtype=torch.float32).to(dtype).double().to(o.device))
    return cots


def _execute(cases: OpCases, fn, inputs: Inputs, dtype: torch.dtype, cot_dtype: torch.dtype):
    """Run fn on inputs cast to dtype; returns ({check name: tensor}) for outputs and gradients."""
    leaves = _cast_inputs(inputs, dtype, cases.grads)
    outs = _call(cases, fn, leaves)
    results = {f"out:{name}": o.detach() for name, o in zip(cases.outputs, outs) if isinstance(o, torch.Tensor)}
    if cases.grads:
        cots = _cotangents(outs, cot_dtype, seed=7)
        loss = sum((o.double() * c).sum() for o, c in zip(outs, cots) if c is not None)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        for name in cases.grads:
            if not isinstance(leaves.get(name), torch.Tensor):
                continue  # an optional input this shape does not use (e.g. no residual, no bias)
            grad = leaves[name].grad
            results[f"grad:{name}"] = grad if grad is not None else torch.zeros_like(leaves[name])
    return results


def compare(actual: torch.Tensor, expected: torch.Tensor, tol: Tol) -> dict[str, Any]:
    """max abs diff, relative L2, finiteness and pass/fail of ``actual`` against ``expected``."""
    if actual.shape != expected.shape:
        return {"status": "fail", "reason": f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"}
    a = actual.detach().double()
    b = expected.detach().double().to(a.device)
    finite = bool(torch.isfinite(a).all().item())
    if a.numel() == 0:
        return {"max_abs": 0.0, "rel_l2": 0.0, "finite": True, "status": "pass"}
    diff = torch.nan_to_num(a - b, nan=float("inf"))
    max_abs = float(diff.abs().max().item())
    ref_norm = float(b.norm().item())
    err_norm = float(diff.norm().item())
    rel = 0.0 if err_norm == 0.0 else err_norm / max(ref_norm, 1e-300)
    bound = tol.atol + tol.rtol * float(b.abs().max().item())
    ok = finite and rel <= tol.rel_l2 and max_abs <= bound
    return {"max_abs": max_abs, "rel_l2": rel, "finite": finite, "status": "pass" if ok else "fail"}


def reference_dtype(device: torch.device) -> torch.dtype:
    """fp64 where the device has it (cheap at validation sizes), else fp32."""
    try:
        (torch.ones(2, dtype=torch.float64, device=device) * 2).sum().item()
        return torch.float64
    except (RuntimeError, TypeError):
        return torch.float32


def interpreter_active() -> bool:
    """True when Triton will interpret kernels on CPU tensors in this process."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # noqa: BLE001 - no (working) triton means no interpreter
        return False
    return isinstance(tl.standard.sum, InterpretedFunction)


_BF16_DOT_OK: list[bool] = []


def interpreter_bf16_dot_ok() -> bool:
    """Whether the Triton interpreter computes ``tl.dot`` on bf16 inputs correctly (3.9 does not: it keeps
    bf16 as uint16 and multiplies the bit patterns). Probed once on a 16x16 product."""
    if not _BF16_DOT_OK:
        import triton
        import triton.language as tl

        @triton.jit
        def _dot16(a_ptr, b_ptr, c_ptr):
            i = tl.arange(0, 16)
            a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
            b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
            tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))

        a = torch.eye(16, dtype=torch.bfloat16)
        c = torch.zeros(16, 16)
        try:
            _dot16[(1,)](a, a, c)
            _BF16_DOT_OK.append(bool(torch.equal(c, torch.eye(16))))
        except Exception:  # noqa: BLE001
            _BF16_DOT_OK.append(False)
    return _BF16_DOT_OK[0]


def _implementations(cases: OpCases, device: torch.device, dtype_name: str, interpret: bool):
    """Yield (impl name, loader thunk or None, skip reason or None, sizes allowed)."""
    if cases.torch_impls is not None:
        for name, fn in cases.torch_impls:
            yield name, (lambda fn=fn: fn), None, SIZES
        return
    from polyrl.kernels import registry

    for impl in registry.implementations(cases.op):
        thunk = lambda name=impl.name: registry.load(cases.op, name)  # noqa: E731
        if impl.supports(device.type, dtype_name):
            yield impl.name, thunk, None, SIZES
        elif device.type == "cpu" and impl.name == "triton" and interpret:
            if cases.bf16_dot and dtype_name == "bfloat16" and not interpreter_bf16_dot_ok():
                yield impl.name, None, "this Triton interpreter computes tl.dot on bf16 wrongly; run on a device", ()
            else:
                yield impl.name, thunk, None, ("tiny",)
        else:
            where = f"{','.join(sorted(impl.devices))}/{','.join(sorted(impl.dtypes))}"
            reason = f"declared for {where}"
            if device.type == "cpu" and impl.name == "triton":
                reason += "; set TRITON_INTERPRET=1 to run it on CPU under the Triton interpreter"
            yield impl.name, None, reason, ()


def _reference_fn(cases: OpCases) -> Callable[..., Any]:
    if cases.torch_impls is not None:
        return cases.torch_impls[0][1]
    from polyrl.kernels import registry

    return registry.load(cases.op, "reference")


def _row(op, impl, dtype_name, shape, check, **kw) -> dict[str, Any]:
    row = {"op": op, "impl": impl, "dtype": dtype_name, "shape": shape, "check": check}
    row.update({"max_abs": None, "rel_l2": None, "finite": None, "tol_rel_l2": None, "status": "", "reason": ""})
    row.update(kw)
    return row


def validate_op(cases: OpCases, device: torch.device, dtypes: list[torch.dtype], sizes: tuple[str, ...], seed: int = 0):
    """All rows for one op on ``device``."""
    rows: list[dict[str, Any]] = []
    ref_dtype = reference_dtype(device)
    interpret = device.type == "cpu" and interpreter_active()
    ref_fn = _reference_fn(cases)
    for dtype in dtypes:
        dname = DTYPE_NAMES[dtype]
        tol = cases.tol.get(dname, DEFAULT_TOL[dname])
        for impl_name, thunk, skip, impl_sizes in _implementations(cases, device, dname, interpret):
            if thunk is None:
                rows.append(_row(cases.op, impl_name, dname, "-", "-", status="skipped", reason=skip))
                continue
            try:
                fn = thunk()
            except Exception as exc:  # noqa: BLE001 - KernelUnavailable or any import error
                rows.append(_row(cases.op, impl_name, dname, "-", "-", status="unavailable", reason=_short(exc)))
                continue
            for shape in cases.shapes:
                if shape.size not in sizes or shape.size not in impl_sizes:
                    continue
                rows.extend(_validate_shape(cases, fn, ref_fn, impl_name, shape, dtype, ref_dtype, tol, device, seed))
    return rows


def _validate_shape(cases, fn, ref_fn, impl_name, shape, dtype, ref_dtype, tol, device, seed):
    dname = DTYPE_NAMES[dtype]
    gen = torch.Generator().manual_seed(seed)
    try:
        # Inputs are drawn once and rounded to the test dtype; the reference sees the same values.
        inputs = _cast_inputs(cases.make(shape.params, dtype, device, gen), dtype, ())
        expected = _execute(cases, ref_fn, inputs, ref_dtype, dtype)
        actual = _execute(cases, fn, inputs, dtype, dtype)
    except Exception as exc:  # noqa: BLE001 - report, keep sweeping
        if os.environ.get("POLYRL_DEBUG") == "1":
            traceback.print_exc()
        return [_row(cases.op, impl_name, dname, shape.name, "-", status="error", reason=_short(exc))]
    rows = []
    for check, ref in expected.items():
        got = actual.get(check)
        if got is None:
            rows.append(_row(cases.op, impl_name, dname, shape.name, check, status="fail", reason="missing"))
            continue
        metrics = compare(got, ref, tol)
        rows.append(_row(cases.op, impl_name, dname, shape.name, check, tol_rel_l2=tol.rel_l2, **metrics))
    return rows


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


def tf32_effect(device: torch.device, n: int = 1024, seed: int = 0) -> dict[str, Any]:
    """Relative L2 between the device's fp32 matmul with TF32 allowed and disallowed (and each vs fp64)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=gen).to(device)
    b = torch.randn(n, n, generator=gen).to(device)
    exact = (a.double() @ b.double()) if reference_dtype(device) == torch.float64 else None
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        strict = a @ b
        torch.set_float32_matmul_precision("high")
        relaxed = a @ b
    finally:
        torch.set_float32_matmul_precision(prev)

    def rel(x, y):
        return float((x.double() - y.double()).norm().item() / max(y.double().norm().item(), 1e-300))

    row = _row("matmul_tf32", "torch", "float32", f"{n}x{n}x{n}", "tf32 vs fp32", status="info")
    row.update(rel_l2=rel(relaxed, strict), max_abs=float((relaxed - strict).abs().max().item()), finite=True)
    if exact is not None:
        row["reason"] = f"vs fp64: tf32 {rel(relaxed, exact):.2e}, fp32 {rel(strict, exact):.2e}"
    if row["rel_l2"] == 0.0:
        row["reason"] = (row["reason"] + "; " if row["reason"] else "") + "no TF32 path on this device"
    return row


def run_sweep(
    device: torch.device | None = None,
    dtypes: list[str] | None = None,
    ops: list[str] | None = None,
    sizes: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """The full sweep as JSON-able rows (see ``_row`` for the keys)."""
    from polyrl.errors import ConfigError
    from polyrl.validate import ops_cases  # noqa: F401  registers CASES

    if device is None:
        from polyrl.platform import device as dev

        device = dev.torch_device()
    unknown = [d for d in dtypes or [] if d not in DTYPES]
    if unknown:
        raise ConfigError(f"unknown dtype(s) {unknown}; use a comma list of {', '.join(DTYPES)}")
    wanted = list(CASES) if not ops else ops
    missing = [o for o in wanted if o not in CASES and o != "matmul_tf32"]
    if missing:
        raise ConfigError(f"no validation cases for {missing}; known: {', '.join(list(CASES) + ['matmul_tf32'])}")
    if sizes is None:
        sizes = ("tiny", "small") if device.type == "cpu" else SIZES
    dts = [DTYPES[d] for d in (dtypes or list(DTYPES))]
    rows: list[dict[str, Any]] = []
    for op in wanted:
        if op in CASES:
            for row in validate_op(CASES[op], device, dts, sizes):
                row["device"] = device.type
                rows.append(row)
    if not ops or "matmul_tf32" in ops:
        rows.append(dict(tf32_effect(device), device=device.type))
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return counts
