"""`polyrl validate ops`: the sweep's rows and numbers, pass/fail/unavailable/error classification, the
TF32 row, the text/Markdown rendering and the CLI (exit codes, JSON and Markdown files)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

# Triton reads TRITON_INTERPRET when it is first imported (see tests/kernels/conftest.py): set it at
# collection, on machines without an accelerator, so the sweep can run Triton kernels on CPU tensors.
from polyrl.platform import device as _device  # noqa: E402

if "triton" not in sys.modules and _device.device_type() != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from polyrl.cli.main import main  # noqa: E402
from polyrl.kernels import registry  # noqa: E402
from polyrl.validate import LEVELS, ops, ops_level  # noqa: E402
from polyrl.validate.ops import compare  # noqa: E402
from polyrl.validate.ops_spec import CASES, OpCases, Shape, Tol, register_cases  # noqa: E402

KEYS = {"op", "impl", "dtype", "shape", "check", "max_abs", "rel_l2", "finite", "tol_rel_l2", "status", "reason"}


@pytest.fixture(scope="module")
def tiny_rows():
    return ops.run_sweep(
        device=torch.device("cpu"),
        dtypes=["fp32", "bf16"],
        ops=["rmsnorm", "rope", "swiglu", "silu", "linear", "matmul_tf32"],
        sizes=("tiny",),
    )


def test_sweep_rows_cover_outputs_and_every_gradient(tiny_rows):
    assert all(KEYS <= set(r) for r in tiny_rows)
    json.dumps(tiny_rows)  # JSON-able as is
    checks = {(r["op"], r["impl"], r["dtype"], r["check"]) for r in tiny_rows}
    for dtype in ("float32", "bfloat16"):
        for check in ("out:y", "out:sum", "grad:x", "grad:weight", "grad:residual"):
            assert ("rmsnorm", "reference", dtype, check) in checks
        for check in ("out:q", "out:k", "grad:q", "grad:k"):
            assert ("rope", "reference", dtype, check) in checks
        assert ("swiglu", "reference", dtype, "grad:up") in checks
        assert ("silu", "torch", dtype, "grad:x") in checks
        assert ("linear", "torch", dtype, "grad:bias") in checks
    bad = [r for r in tiny_rows if r["status"] not in ("pass", "info", "skipped")]
    assert not bad, bad


def test_sweep_numbers_are_real(tiny_rows):
    by = {(r["op"], r["impl"], r["dtype"], r["shape"], r["check"]): r for r in tiny_rows}
    # fp32 silu against fp64: a few ulps, not zero and not large.
    silu32 = by[("silu", "torch", "float32", "T=7,I=127", "out:y")]
    assert 0 < silu32["rel_l2"] < 1e-6 and 0 < silu32["max_abs"] < 1e-5 and silu32["finite"]
    # bf16 rounding: relative L2 of the order of 2^-9, well above fp32's.
    silu16 = by[("silu", "torch", "bfloat16", "T=7,I=127", "out:y")]
    assert 3e-4 < silu16["rel_l2"] < 8e-3
    tf32 = [r for r in tiny_rows if r["op"] == "matmul_tf32"]
    assert len(tf32) == 1 and tf32[0]["status"] == "info"
    assert tf32[0]["rel_l2"] == 0.0 and "no TF32 path" in tf32[0]["reason"]  # the CPU has no TF32


def test_triton_rows_under_the_interpreter(tiny_rows):
    triton_rows = [r for r in tiny_rows if r["impl"] == "triton"]
    if not ops.interpreter_active():
        assert triton_rows and all(r["status"] == "skipped" for r in triton_rows)
        assert "TRITON_INTERPRET=1" in triton_rows[0]["reason"]
        return
    ran = {(r["op"], r["dtype"]) for r in triton_rows if r["status"] == "pass"}
    assert {(op, dt) for op in ("rmsnorm", "rope", "swiglu") for dt in ("float32", "bfloat16")} <= ran
    assert all(r["status"] == "pass" for r in triton_rows)


@pytest.fixture
def scratch_cases():
    added: list[str] = []

    def add(cases: OpCases) -> OpCases:
        added.append(cases.op)
        register_cases(cases)
        return cases

    yield add
    for name in added:
        CASES.pop(name, None)
        registry._REG.impls.pop(name, None)
    registry.reset_cache()


def _make_x(p, dtype, device, gen):
    return {"x": torch.randn(p["n"], generator=gen).to(device)}


def test_wrong_failing_missing_and_erroring_implementations_are_classified(scratch_cases):
    def off_by_one_percent(x):
        return F.silu(x) * 1.01

    def crashes(x):
        raise RuntimeError("kernel exploded")

    cases = scratch_cases(
        OpCases("_t_cls", _make_x, [Shape("n=7", {"n": 7}, "tiny")], ("y",), ("x",),
                torch_impls=[("ref", F.silu), ("good", F.silu), ("bad", off_by_one_percent), ("boom", crashes)])
    )  # fmt: skip
    rows = ops.validate_op(cases, torch.device("cpu"), [torch.float32], ("tiny",))
    status = {(r["impl"], r["check"]): r["status"] for r in rows}
    assert status[("good", "out:y")] == status[("good", "grad:x")] == "pass"
    assert status[("bad", "out:y")] == status[("bad", "grad:x")] == "fail"
    bad = next(r for r in rows if r["impl"] == "bad" and r["check"] == "out:y")
    assert bad["rel_l2"] == pytest.approx(0.01, rel=1e-4)
    boom = next(r for r in rows if r["impl"] == "boom")
    assert boom["status"] == "error" and "kernel exploded" in boom["reason"]

    # A registry op whose fast implementation cannot be imported is "unavailable", not a crash.
    registry.register("_t_unavail", "reference", "polyrl.kernels.swiglu.reference:swiglu")
    registry.register("_t_unavail", "fast", "polyrl.kernels._missing_for_tests:swiglu", priority=5)
    two = lambda p, dtype, device, gen: {"g": torch.randn(3, generator=gen), "u": torch.randn(3, generator=gen)}  # noqa: E731
    reg_cases = scratch_cases(OpCases("_t_unavail", two, [Shape("n=3", {}, "tiny")], ("y",), ("g", "u")))
    rows = ops.validate_op(reg_cases, torch.device("cpu"), [torch.float32], ("tiny",))
    fast = [r for r in rows if r["impl"] == "fast"]
    assert len(fast) == 1 and fast[0]["status"] == "unavailable" and "ModuleNotFoundError" in fast[0]["reason"]
    assert {r["status"] for r in rows if r["impl"] == "reference"} == {"pass"}


def test_compare_numbers_and_non_finite():
    ref = torch.tensor([3.0, 4.0])
    got = torch.tensor([3.0, 4.5])
    m = compare(got, ref, Tol(0.2, 1.0, 0.0))
    assert m["max_abs"] == pytest.approx(0.5) and m["rel_l2"] == pytest.approx(0.1) and m["status"] == "pass"
    assert compare(got, ref, Tol(0.05, 1.0, 0.0))["status"] == "fail"
    assert compare(got, ref, Tol(0.2, 0.4, 0.0))["status"] == "fail"  # max-abs bound
    nan = compare(torch.tensor([3.0, float("nan")]), ref, Tol(1.0, 1.0, 1.0))
    assert nan["finite"] is False and nan["status"] == "fail"
    assert compare(torch.zeros(3), torch.zeros(3), Tol(0.0, 0.0, 0.0))["status"] == "pass"


def test_rendering_text_and_markdown(tiny_rows):
    result = {"level": "ops", "passed": True, "summary": ops.summarize(tiny_rows), "rows": tiny_rows, "notes": []}
    text = ops_level.render_text(result)
    assert text.splitlines()[0].split()[:3] == ["op", "impl", "dtype"]
    assert text.rstrip().endswith(")") and "ops: PASS" in text
    md = ops_level.render_markdown(result)
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == len(tiny_rows) + 2
    only_fail = ops_level.render_markdown(result, show="failures")
    assert len([line for line in only_fail.splitlines() if line.startswith("|")]) == 2


def test_cli_validate_ops_writes_reports(tmp_path, capsys):
    assert "ops" in LEVELS
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    argv = ["validate", "ops", "--ops", "silu,linear", "--dtypes", "fp32,fp16", "--sizes", "tiny"]
    rc = main(argv + ["--json", str(out_json), "--md", str(out_md)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert report["passed"] is True and report["platform"]["device_type"] == "cpu"
    assert report["schema"] == "polyrl.validate/1" and report["levels"]["ops"]["status"] == "passed"
    rows = report["levels"]["ops"]["rows"]
    assert {r["op"] for r in rows} == {"silu", "linear"} and {r["dtype"] for r in rows} == {"float32", "float16"}
    assert "| silu | torch | float16 |" in out_md.read_text()
    assert "validate: PASS (ops passed)" in capsys.readouterr().out


def test_cli_usage_errors_exit_2(capsys):
    assert main(["validate", "ops", "--dtypes", "fp8"]) == 2
    assert "unknown dtype" in capsys.readouterr().err
    assert main(["validate", "--levels", "nonsense"]) == 2
    assert "unknown validation level" in capsys.readouterr().err
    assert main(["validate", "ops", "--ops", "not_an_op"]) == 2
    assert "no validation cases" in capsys.readouterr().err


def test_rendering_a_level_that_failed_before_any_row_says_why():
    """A level that raised before checking anything (e.g. an op with no loadable implementation) still renders."""
    from polyrl.validate.ops_level import render_markdown, render_text

    result = {"level": "ops", "status": "failed", "passed": False, "reason": "KernelUnavailable: no implementation"}
    for text in (render_text(result, "failures"), render_markdown(result)):
        assert "ops: FAIL" in text and "KernelUnavailable: no implementation" in text
