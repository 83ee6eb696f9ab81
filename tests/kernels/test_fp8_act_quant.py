"""The Triton per-token e4m3 quantiser of the FP8 rollout (``polyrl/infer/fp8_quant_triton.py``) against
``fp8_weights.quantize_rows`` (the reference): scales bit-equal everywhere; the e4m3 values bit-equal on the device.

The interpreter (Triton 3.9) converts fp32 -> e4m3 without the carry of a round-up into the exponent (124.7 -> 64
where the hardware and torch give 128) and rounds some ties away from even, so on the CPU only most values equal
(0.97 observed, 2026-12-02) and every other one is a power-of-two or one-step neighbour of the reference's."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from polyrl.infer.fp8_weights import AMAX_FLOOR, FP8_MAX, quantize_rows


def _load():
    sys.modules.pop("polyrl.infer.fp8_quant_triton", None)  # bind to the triton this fixture prepared
    fn = importlib.import_module("polyrl.infer.fp8_quant_triton").quantize_rows_triton
    return lambda x: fn(x, FP8_MAX, AMAX_FLOOR)


@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (5, 1040), (3, 2100), (3, 16400)])  # the last: two passes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_triton_matches_the_reference(triton_kernels, shape, dtype):
    quant = _load()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x[0, :5] = 0
    if shape[0] > 2:
        x[1] = 0  # an all-zero row
    x = x.to(triton_kernels.device)
    want_q, want_s = quantize_rows(x)
    got_q, got_s = quant(x)
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == x.shape and got_q.is_contiguous()
    assert torch.equal(got_s, want_s)
    if not triton_kernels.interpreted:
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        return
    a, b = want_q.float().cpu(), got_q.float().cpu()
    same = a == b
    assert same.float().mean().item() >= 0.9
    off = ~same  # the interpreter's conversion: at most a factor of two off, same sign
    assert ((b[off] / a[off] >= 0.5) & (b[off] / a[off] <= 1.2)).all()


def test_quantize_rows_triton_strided_rows(triton_kernels):
    quant = _load()
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 96, generator=g).to(triton_kernels.device)
    x = base[:, :64]  # rows 96 apart
    got_q, got_s = quant(x)
    want_q, want_s = quantize_rows(x)
    assert torch.equal(got_s, want_s)
    assert (got_q.float() == want_q.float()).float().mean().item() >= 0.9


def test_quantize_rows_triton_writes_in_place(triton_kernels):
    """A weight copy requantised in place (``fp8_weights.quantize_weight`` on CUDA): the same tensors come back,
    holding what a fresh call returns; a wrong destination is refused."""
    sys.modules.pop("polyrl.infer.fp8_quant_triton", None)
    fn = importlib.import_module("polyrl.infer.fp8_quant_triton").quantize_rows_triton
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(40, 80, generator=g) * 0.05).to(torch.bfloat16).to(triton_kernels.device)
    fresh_q, fresh_s = fn(w, FP8_MAX, AMAX_FLOOR)
    out = torch.zeros_like(fresh_q)
    scales = torch.zeros_like(fresh_s)
    q, s = fn(w, FP8_MAX, AMAX_FLOOR, out=out, scales=scales)
    assert q is out and s is scales
    assert torch.equal(q.view(torch.uint8), fresh_q.view(torch.uint8)) and torch.equal(s, fresh_s)
    assert s.min().item() > 0
    with pytest.raises(ValueError, match="contiguous e4m3"):
        fn(w, FP8_MAX, AMAX_FLOOR, out=torch.empty(40, 81, dtype=torch.float8_e4m3fn, device=w.device))


def _fused():
    sys.modules.pop("polyrl.infer.fp8_quant_triton", None)
    return importlib.import_module("polyrl.infer.fp8_quant_triton")


def _assert_quant_of(got_q, got_s, y, interpreted):
    """``(got_q, got_s)`` is ``quantize_rows(y)``: scales bit-equal; values bit-equal on the device (the interpreter's
    e4m3 conversion: see the module docstring)."""
    want_q, want_s = quantize_rows(y)
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == y.shape and torch.equal(got_s, want_s)
    if not interpreted:
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    else:
        assert (got_q.float() == want_q.float()).float().mean().item() >= 0.9


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [48, 1024, 4096])
def test_rmsnorm_quant_equals_the_rmsnorm_kernel_then_the_quantiser(triton_kernels, residual, cols):
    """The fused norm + quantiser of the FP8 decode step: y (and x + residual) bit-equal to the plain Triton RMSNorm
    (same tiling, so the same reduction order), and the e4m3 copy that of y."""
    mod = _fused()
    from polyrl.kernels.rmsnorm.triton import rmsnorm

    dev = triton_kernels.device
    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(37, cols, generator=g) * 2).bfloat16().to(dev)
    w = (1 + 0.1 * torch.randn(cols, generator=g)).bfloat16().to(dev)
    r = torch.randn(37, cols, generator=g).bfloat16().to(dev) if residual else None
    want = rmsnorm(x, w, 1e-6, r)
    want_y, want_sum = want if residual else (want, None)
    y, total, q, s = mod.rmsnorm_quant_triton(x, w, 1e-6, r, FP8_MAX, AMAX_FLOOR)
    assert torch.equal(y, want_y) and y.dtype == torch.bfloat16
    assert (total is None) == (not residual)
    if residual:
        assert torch.equal(total, want_sum)
    _assert_quant_of(q, s, y, triton_kernels.interpreted)
    with pytest.raises(ValueError, match="share one dtype"):
        mod.rmsnorm_quant_triton(x, w.float(), 1e-6, r, FP8_MAX, AMAX_FLOOR)


def test_swiglu_quant_equals_the_swiglu_kernel_then_the_quantiser(triton_kernels):
    """The fused SwiGLU + quantiser on gate/up as column slices of one GEMM output (the fused gate_up copy's)."""
    mod = _fused()
    from polyrl.kernels.swiglu.triton import swiglu

    dev = triton_kernels.device
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(9, 2 * 1200, generator=g) * 3).bfloat16().to(dev)
    gate, up = gate_up[:, :1200], gate_up[:, 1200:]
    gate[2] = 0  # an all-zero row: the amax floor
    y, q, s = mod.swiglu_quant_triton(gate, up, FP8_MAX, AMAX_FLOOR)
    assert y.is_contiguous() and torch.equal(y, swiglu(gate, up))
    assert s[2].item() == pytest.approx(AMAX_FLOOR / FP8_MAX, rel=1e-6)
    _assert_quant_of(q, s, y, triton_kernels.interpreted)
    with pytest.raises(ValueError, match="rows of at most"):
        big = torch.zeros(1, 16400, dtype=torch.bfloat16, device=dev)
        mod.swiglu_quant_triton(big, big, FP8_MAX, AMAX_FLOOR)
