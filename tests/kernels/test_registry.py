"""Kernel registry: POLYRL_KERNELS parsing, forced and automatic selection, fallback with one warning,
device/dtype declarations, and the declarations of the real ops."""

from __future__ import annotations

import warnings

import pytest
import torch

import polyrl.kernels as K
from polyrl.kernels import registry
from polyrl.kernels.registry import KernelUnavailable

OK_LOADER = "polyrl.kernels.swiglu.reference:swiglu"
BROKEN_LOADER = "polyrl.kernels._no_such_module_for_tests:fn"


@pytest.fixture
def scratch_op(monkeypatch):
    """Register throw-away ops, and remove them (and every cached selection) afterwards."""
    monkeypatch.delenv("POLYRL_KERNELS", raising=False)
    names: list[str] = []

    def make(name: str, *impls: tuple[str, str, dict]) -> str:
        names.append(name)
        for impl_name, loader, kw in impls:
            registry.register(name, impl_name, loader, **kw)
        return name

    registry.reset_cache()
    yield make
    for name in names:
        registry._REG.impls.pop(name, None)
    registry.reset_cache()


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, {}),
        ("", {}),
        ("reference", {"*": "reference"}),
        ("rmsnorm:triton", {"rmsnorm": "triton"}),
        (" rmsnorm : triton , attention:reference ,", {"rmsnorm": "triton", "attention": "reference"}),
        ("reference,rope:triton", {"*": "reference", "rope": "triton"}),
    ],
)
def test_parse_forced(spec, expected):
    assert registry.parse_forced(spec) == expected


def test_automatic_choice_prefers_priority_and_respects_declarations(scratch_op):
    op = scratch_op(
        "_t_auto",
        ("reference", OK_LOADER, {}),
        ("gpu_only", OK_LOADER, {"devices": ("cuda",), "priority": 20}),
        ("bf16_only", OK_LOADER, {"dtypes": ("bfloat16",), "priority": 10}),
    )
    assert registry.select(op, "cpu", "float32")[0] == "reference"
    assert registry.select(op, "cpu", "bfloat16")[0] == "bf16_only"
    assert registry.select(op, "cuda", "float32")[0] == "gpu_only"
    assert registry.select(op, "cuda", "bfloat16")[0] == "gpu_only"
    assert [i.name for i in registry.implementations(op)] == ["gpu_only", "bf16_only", "reference"]


def test_automatic_choice_that_fails_to_load_falls_back_with_one_warning(scratch_op):
    op = scratch_op("_t_fallback", ("reference", OK_LOADER, {}), ("fast", BROKEN_LOADER, {"priority": 10}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = registry.select(op, "cpu", "float32")
        for _ in range(3):
            again = registry.select(op, "cpu", "float32")
    assert first[0] == again[0] == "reference"
    assert first[1] is again[1]
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, [str(w.message) for w in runtime]
    assert "_t_fallback:fast failed to load" in str(runtime[0].message)
    assert "ModuleNotFoundError" in registry.failures()[(op, "fast")]


def test_forced_choice_that_fails_raises(scratch_op, monkeypatch):
    op = scratch_op("_t_forced", ("reference", OK_LOADER, {}), ("fast", BROKEN_LOADER, {"priority": 10}))
    monkeypatch.setenv("POLYRL_KERNELS", f"{op}:fast")
    with pytest.raises(KernelUnavailable, match="failed to load"):
        registry.select(op, "cpu", "float32")
    monkeypatch.setenv("POLYRL_KERNELS", f"{op}:nonexistent")
    with pytest.raises(KernelUnavailable, match="no implementation 'nonexistent'"):
        registry.select(op, "cpu", "float32")


def test_forced_choice_outside_its_declaration_raises(scratch_op, monkeypatch):
    op = scratch_op("_t_decl", ("reference", OK_LOADER, {}), ("gpu", OK_LOADER, {"devices": ("cuda",)}))
    monkeypatch.setenv("POLYRL_KERNELS", f"{op}:gpu")
    with pytest.raises(KernelUnavailable, match="does not support cpu/float32"):
        registry.select(op, "cpu", "float32")
    assert registry.select(op, "cuda", "float32")[0] == "gpu"


def test_forced_reference_for_all_ops_and_per_op_override(scratch_op, monkeypatch):
    op = scratch_op("_t_all", ("reference", OK_LOADER, {}), ("fast", OK_LOADER, {"priority": 10}))
    assert registry.select(op, "cpu", "float32")[0] == "fast"
    monkeypatch.setenv("POLYRL_KERNELS", "reference")
    assert registry.select(op, "cpu", "float32")[0] == "reference"
    monkeypatch.setenv("POLYRL_KERNELS", f"reference,{op}:fast")
    assert registry.select(op, "cpu", "float32")[0] == "fast"


def test_real_ops_declare_reference_everywhere_and_triton_on_accelerators():
    expected = {
        "rmsnorm",
        "rope",
        "swiglu",
        "attention",
        "paged_attention",
        "kv_cache_write",
        "linear_cross_entropy",
        "token_logprobs",
    }
    assert expected <= set(registry.ops())
    for op in expected:
        impls = {i.name: i for i in registry.implementations(op)}
        assert impls["reference"].supports("cpu", "float32") and impls["reference"].supports("npu", "bfloat16")
        triton = impls.get("triton")
        assert triton is not None, f"{op} has no triton implementation registered"
        assert triton.supports("cuda", "bfloat16") and not triton.supports("cpu", "float32")
        assert triton.priority > impls["reference"].priority


def test_public_function_dispatches_to_forced_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("POLYRL_KERNELS", "reference")
    registry.reset_cache()
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    from polyrl.kernels.rmsnorm.reference import rmsnorm as ref

    assert torch.equal(K.rmsnorm(x, w, 1e-6), ref(x, w, 1e-6))
    assert registry.select("rmsnorm", "cpu", "float32")[0] == "reference"
    registry.reset_cache()
