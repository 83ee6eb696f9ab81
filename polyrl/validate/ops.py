"""The ``ops`` validation level: every op x available implementation x dtype x shape against the reference.

Each op declares its cases in a registry (``ops_spec.CASES``, filled by ``ops_cases.py``): an input factory over
named shapes (awkward sizes: 1, 7, 127, 1025, a vocab that is not a multiple of any block), which inputs
get gradients, the names of its outputs, and a tolerance per dtype. For each combination the sweep runs
the implementation on inputs of the test dtype and the op's reference on the *same values* upcast to
fp64 (fp32 where the device has no fp64), with the same cotangents, and reports per output and per
gradient: max abs diff, relative L2 error, all-finite, and pass/fail under the declared tolerance.

Implementations come from the kernel registry (plain torch rows such as ``silu``/``linear`` bring their
own). One that does not declare the device/dtype is "skipped"; one that fails to import is "unavailable";
neither stops the sweep. On the CPU, Triton implementations run under the interpreter when
``TRITON_INTERPRET=1`` is set (before triton is imported), on the "tiny" shapes only.

Speed (the sweep is dominated by Triton JIT compiles, one per kernel specialisation): the default shape
sets are tiny+small everywhere ("large" on request); tiny/small shapes run autotuned kernels with one
fixed config (``fixed_config()`` of the kernel modules listed in ``QUICK_TUNING``: one compile and no
benchmarking per autotuning key -- "large" shapes autotune as in production); on an accelerator the
dtypes run in parallel worker processes (compiles are CPU-bound and independent). A progress line is
printed per op/implementation/dtype as it finishes.

Deliberately not here: timing (``polyrl bench kernels``), multi-device checks, the report file format
(the CLI writes what ``run_level`` returns).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import importlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from polyrl.errors import ConfigError
from polyrl.kernels import registry
from polyrl.platform import device as platform_device
from polyrl.validate import ops_cases  # noqa: F401  importing it fills CASES
from polyrl.validate.ops_spec import CASES, DEFAULT_TOL, Inputs, OpCases, Tol

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SIZES = ("tiny", "small", "large")
DEFAULT_SIZES = ("tiny", "small")
# Kernel modules with a ``fixed_config()`` context (skip autotuning) used for the tiny and small shapes.
QUICK_TUNING = ("polyrl.kernels.attention.triton",)


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
        # lazy: triton is optional, and importing it fixes interpreted or compiled mode for the whole process
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
        # lazy: triton is optional; only reached on the CPU under the interpreter
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
    return registry.load(cases.op, "reference")


def _row(op, impl, dtype_name, shape, check, **kw) -> dict[str, Any]:
    row = {"op": op, "impl": impl, "dtype": dtype_name, "shape": shape, "check": check}
    row.update({"max_abs": None, "rel_l2": None, "finite": None, "tol_rel_l2": None, "status": "", "reason": ""})
    row.update(kw)
    return row


Progress = Callable[[str], None]


def print_progress(line: str) -> None:
    """The default progress sink: one line to stderr, flushed (stdout stays the report's)."""
    print(line, file=sys.stderr, flush=True)


def _progress_line(op: str, impl: str, dname: str, rows: list[dict[str, Any]], seconds: float) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    text = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no shapes"
    return f"  ops {op}/{impl}/{dname}: {text} ({seconds:.1f} s)"


def _quick_tuning(device: torch.device) -> contextlib.ExitStack:
    """Enter ``fixed_config()`` of every ``QUICK_TUNING`` module that can run here (never imports triton on a
    CPU without the interpreter: importing it there would fix it in compiled mode for the whole process)."""
    stack = contextlib.ExitStack()
    if device.type == "cpu" and not interpreter_active():
        return stack
    for name in QUICK_TUNING:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not importable here: nothing to tune
            continue
        if hasattr(module, "fixed_config"):
            stack.enter_context(module.fixed_config())
    return stack


def validate_op(
    cases: OpCases,
    device: torch.device,
    dtypes: list[torch.dtype],
    sizes: tuple[str, ...],
    seed: int = 0,
    progress: Progress | None = None,
):
    """All rows for one op on ``device``; ``progress`` gets a line per implementation x dtype as it finishes."""
    rows: list[dict[str, Any]] = []
    ref_dtype = reference_dtype(device)
    interpret = device.type == "cpu" and interpreter_active()
    ref_fn = _reference_fn(cases)
    for dtype in dtypes:
        dname = DTYPE_NAMES[dtype]
        tol = cases.tol.get(dname, DEFAULT_TOL[dname])
        for impl_name, thunk, skip, impl_sizes in _implementations(cases, device, dname, interpret):
            started, first = time.perf_counter(), len(rows)
            fn, failure = None, None
            if thunk is None:
                failure = _row(cases.op, impl_name, dname, "-", "-", status="skipped", reason=skip)
            else:
                try:
                    fn = thunk()
                except Exception as exc:  # noqa: BLE001 - KernelUnavailable or any import error
                    failure = _row(cases.op, impl_name, dname, "-", "-", status="unavailable", reason=_short(exc))
            if failure is not None:
                rows.append(failure)
            for shape in cases.shapes if fn is not None else ():
                if shape.size not in sizes or shape.size not in impl_sizes:
                    continue
                with _quick_tuning(device) if shape.size != "large" else contextlib.nullcontext():
                    rows.extend(
                        _validate_shape(cases, fn, ref_fn, impl_name, shape, dtype, ref_dtype, tol, device, seed)
                    )
            if progress is not None:
                progress(_progress_line(cases.op, impl_name, dname, rows[first:], time.perf_counter() - started))
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
    progress: Progress | None = None,
    workers: int | None = None,
) -> list[dict[str, Any]]:
    """The full sweep as JSON-able rows (see ``_row`` for the keys).

    ``sizes`` defaults to tiny+small (add "large" for real widths on an accelerator). ``workers``: processes
    to spread the dtypes over (default: one per dtype on an accelerator, in-process on the CPU); the rows
    come back in the same order either way."""
    if device is None:
        device = platform_device.torch_device()
    unknown = [d for d in dtypes or [] if d not in DTYPES]
    if unknown:
        raise ConfigError(f"unknown dtype(s) {unknown}; use a comma list of {', '.join(DTYPES)}")
    wanted = list(CASES) if not ops else ops
    missing = [o for o in wanted if o not in CASES and o != "matmul_tf32"]
    if missing:
        raise ConfigError(f"no validation cases for {missing}; known: {', '.join(list(CASES) + ['matmul_tf32'])}")
    if sizes is None:
        sizes = DEFAULT_SIZES
    names = list(dtypes or list(DTYPES))
    op_list = [op for op in wanted if op in CASES]
    if workers is None:
        workers = len(names) if device.type != "cpu" else 1
    rows = None
    if workers > 1 and len(names) > 1 and op_list:
        rows = _parallel_sweep(device, names, op_list, sizes, progress, workers)
    if rows is None:
        rows = _sweep(device, names, op_list, sizes, progress)
    if not ops or "matmul_tf32" in ops:
        rows.append(dict(tf32_effect(device), device=device.type))
    return rows


def _sweep(device, dtype_names, op_list, sizes, progress) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    dts = [DTYPES[d] for d in dtype_names]
    for op in op_list:
        for row in validate_op(CASES[op], device, dts, sizes, progress=progress):
            row["device"] = device.type
            rows.append(row)
    return rows


def _sweep_worker(device: str, dtype_name: str, op_list: list[str], sizes: tuple[str, ...], show: bool):
    """One dtype's rows, in a fresh (spawned) process."""
    return _sweep(torch.device(device), [dtype_name], op_list, sizes, print_progress if show else None)


def _parallel_sweep(device, dtype_names, op_list, sizes, progress, workers) -> list[dict[str, Any]] | None:
    """The dtypes in parallel processes; None (the caller runs in-process) if the pool cannot run."""
    show = progress is not None
    try:
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=min(workers, len(dtype_names)), mp_context=ctx) as pool:
            futures = [pool.submit(_sweep_worker, str(device), d, op_list, sizes, show) for d in dtype_names]
            parts = [f.result() for f in futures]
    except Exception as exc:  # noqa: BLE001 - e.g. no process spawning here: fall back to one process
        if progress is not None:
            progress(f"  ops: parallel workers failed ({_short(exc)}); running in this process")
        return None
    # The in-process order: op, then dtype.
    rank = {op: i for i, op in enumerate(op_list)}
    ordered = [(rank[r["op"]], di, i, r) for di, part in enumerate(parts) for i, r in enumerate(part)]
    return [r for *_, r in sorted(ordered, key=lambda t: t[:3])]


def summarize(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return counts
