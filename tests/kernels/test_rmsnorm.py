"""RMSNorm: the reference against independent formulas, the Triton kernel against the reference
(forward, input/weight/residual gradients, awkward sizes, fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl.kernels.rmsnorm.reference import rmsnorm as ref_rmsnorm


def _fwd_bwd(fn, x, w, residual, eps, seed=0):
    """Run ``fn`` with grads on copies of the inputs; cotangents are fixed by ``seed``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w) + ((residual,) if residual is not None else ())]
    out = fn(leaves[0], leaves[1], eps, leaves[2] if residual is not None else None)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def test_reference_matches_independent_formula():
    x = torch.randn(5, 7, 96, dtype=torch.float64)
    w = torch.rand(96, dtype=torch.float64) + 0.5
    naive = w * x / torch.sqrt((x * x).sum(-1, keepdim=True) / 96 + 1e-5)
    # The reference takes its statistics in fp32 even for fp64 input (x.float()): fp32-level agreement.
    torch.testing.assert_close(ref_rmsnorm(x, w, 1e-5), naive, rtol=1e-6, atol=1e-6)
    if hasattr(F, "rms_norm"):
        xf, wf = x.float(), w.float()
        torch.testing.assert_close(ref_rmsnorm(xf, wf, 1e-5), F.rms_norm(xf, (96,), wf, eps=1e-5), rtol=1e-5, atol=1e-6)
    r = torch.randn_like(x)
    y, s = ref_rmsnorm(x, w, 1e-5, residual=r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, ref_rmsnorm(x + r, w, 1e-5))


def test_reference_bf16_rounds_normalised_value_before_weight():
    # HF Llama/Qwen: weight * hidden.to(input_dtype); with a fp32 weight the output is fp32.
    x = torch.randn(3, 64).bfloat16()
    w = torch.rand(64) + 0.5
    y = ref_rmsnorm(x, w, 1e-6)
    assert y.dtype == torch.float32
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
    assert torch.equal(y, expect)


SHAPES = [(1, 7), (7, 3), (7, 127), (127, 33), (1025, 7), (3, 1025)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fused_residual", [False, True], ids=["plain", "residual"])
def test_triton_fp32_matches_reference(triton_kernels, kernel_check, shape, fused_residual):
    fn = triton_kernels.load("rmsnorm")
    dev = triton_kernels.device
    x = torch.randn(*shape, device=dev) * 3
    w = torch.rand(shape[-1], device=dev) + 0.5
    r = torch.randn(*shape, device=dev) if fused_residual else None
    outs, grads = _fwd_bwd(fn, x, w, r, 1e-6)
    ref_outs, ref_grads = _fwd_bwd(ref_rmsnorm, x.double(), w.double(), r.double() if r is not None else None, 1e-6)
    assert len(outs) == len(ref_outs) == (2 if fused_residual else 1)
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        assert a.dtype == torch.float32
        kernel_check.assert_close(a, b, torch.float32, f"output {i}")
    names = ["dx", "dweight", "dresidual"]
    for name, a, b in zip(names, grads, ref_grads):
        kernel_check.assert_close(a, b, torch.float32, name, scale=4.0 if name == "dweight" else 1.0)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["w_bf16", "w_fp32"])
def test_triton_bf16_matches_reference(triton_kernels, kernel_check, w_dtype):
    fn = triton_kernels.load("rmsnorm")
    dev = triton_kernels.device
    x = torch.randn(2, 9, 127, device=dev).bfloat16()
    r = torch.randn(2, 9, 127, device=dev).bfloat16()
    w = (torch.rand(127, device=dev) + 0.5).to(w_dtype)
    outs, grads = _fwd_bwd(fn, x, w, r, 1e-6)
    assert outs[0].dtype == torch.promote_types(w_dtype, torch.bfloat16) and outs[1].dtype == torch.bfloat16
    # Same rounding points as the reference, so the bf16 reference agrees to the last bit on hardware
    # (round-to-nearest-even); Triton's interpreter truncates fp32 -> bf16, so there allow one ulp.
    bf16_ref = ref_rmsnorm(x, w, 1e-6, residual=r)
    ulp = 2.0**-7 if triton_kernels.interpreted else 0.0
    s_ref = bf16_ref[1].float()
    assert ((outs[1].float() - s_ref).abs() <= ulp * s_ref.abs()).all()
    y_ulps = 4 * 2.0**-7 if triton_kernels.interpreted else 2 * 2.0**-8
    assert (outs[0].float() - bf16_ref[0].float()).abs().max().item() <= y_ulps * bf16_ref[0].abs().max().item()
    ref_outs, ref_grads = _fwd_bwd(ref_rmsnorm, x.double(), w.double(), r.double(), 1e-6)
    kernel_check.assert_close(outs[0], ref_outs[0], torch.bfloat16, "y")
    for name, a, b in zip(["dx", "dweight", "dresidual"], grads, ref_grads):
        assert a.dtype == {"dweight": w_dtype}.get(name, torch.bfloat16)
        kernel_check.assert_close(a, b, torch.bfloat16, name)


def test_triton_strided_rows_and_unused_sum(triton_kernels, kernel_check):
    fn = triton_kernels.load("rmsnorm")
    dev = triton_kernels.device
    base = torch.randn(11, 80, device=dev)
    x = base[:, 8:72]  # row stride 80, unit column stride: no copy needed
    w = torch.rand(64, device=dev) + 0.5
    r = torch.randn(11, 64, device=dev)
    xr, wr, rr = (t.detach().clone().requires_grad_(True) for t in (x, w, r))
    y, _ = fn(xr, wr, 1e-5, rr)  # the sum output is unused: its gradient is None
    y.sum().backward()
    xd, wd, rd = (t.detach().double().requires_grad_(True) for t in (x, w, r))
    ref_rmsnorm(xd, wd, 1e-5, rd)[0].sum().backward()
    kernel_check.assert_close(y, ref_rmsnorm(xd, wd, 1e-5, rd)[0], torch.float32, "y")
    kernel_check.assert_close(xr.grad, xd.grad, torch.float32, "dx")
    kernel_check.assert_close(rr.grad, rd.grad, torch.float32, "dresidual")
    kernel_check.assert_close(wr.grad, wd.grad, torch.float32, "dweight", scale=4.0)


@pytest.mark.parametrize("fused_residual", [False, True], ids=["plain", "residual"])
def test_triton_frozen_weight_gets_no_gradient_and_the_same_input_gradients(
    triton_kernels, kernel_check, fused_residual
):
    """A frozen norm (LoRA) skips the weight-gradient accumulation: no weight grad, identical dx (and residual)."""
    fn = triton_kernels.load("rmsnorm")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=g).to(triton_kernels.device)
    w = (torch.rand(96, generator=g) + 0.5).to(triton_kernels.device)
    r = torch.randn(37, 96, generator=g).to(triton_kernels.device) if fused_residual else None
    _, trainable = _fwd_bwd(fn, x, w, r, 1e-6)
    xs = x.clone().requires_grad_()
    rs = r.clone().requires_grad_() if r is not None else None
    out = fn(xs, w, 1e-6, rs)  # w does not require grad
    outs = out if isinstance(out, tuple) else (out,)
    cot = torch.Generator().manual_seed(0)
    loss = sum((o.double() * torch.randn(o.shape, generator=cot, dtype=torch.float64).to(o.device)).sum() for o in outs)
    loss.backward()
    assert w.grad is None
    kernel_check.assert_close(xs.grad, trainable[0], torch.float32, "dx")
    if r is not None:
        kernel_check.assert_close(rs.grad, trainable[2], torch.float32, "dresidual")


def test_triton_rejects_mismatched_weight(triton_kernels):
    fn = triton_kernels.load("rmsnorm")
    with pytest.raises(ValueError, match="does not match"):
        fn(torch.randn(3, 8, device=triton_kernels.device), torch.ones(9, device=triton_kernels.device))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_triton_large_bf16_on_gpu(triton_kernels, kernel_check, hidden):
    assert not triton_kernels.interpreted
    fn = triton_kernels.load("rmsnorm")
    dev = triton_kernels.device
    x = torch.randn(16384, hidden, device=dev).bfloat16()
    r = torch.randn(16384, hidden, device=dev).bfloat16()
    w = (torch.rand(hidden, device=dev) + 0.5).bfloat16()
    outs, grads = _fwd_bwd(fn, x, w, r, 1e-6)
    ref_outs, ref_grads = _fwd_bwd(ref_rmsnorm, x.float(), w.float(), r.float(), 1e-6)
    kernel_check.assert_close(outs[0], ref_outs[0], torch.bfloat16, "y")
    for name, a, b in zip(["dx", "dweight", "dresidual"], grads, ref_grads):
        kernel_check.assert_close(a, b, torch.bfloat16, name)


@pytest.mark.parametrize("tuning", [{"block_m": 2, "num_warps": 2, "per_sm": 1}, {"block_m": 8, "per_sm": 4}])
def test_triton_backward_launch_overrides_give_the_same_gradients(triton_kernels, tuning):
    """scripts/rmsnorm_sweep.py times ``rmsnorm_backward`` under launch overrides: every setting computes the same
    ds and dw (the partial sums over programs are reduced in fp32)."""
    backward = triton_kernels.load("rmsnorm", "rmsnorm_backward")
    dev = triton_kernels.device
    g = torch.Generator().manual_seed(3)
    s, dy, dsum = (torch.randn(37, 64, generator=g).to(dev) for _ in range(3))
    weight = (torch.rand(64, generator=g) + 0.5).to(dev)
    rstd = (torch.rand(37, generator=g) + 0.5).to(dev)
    ds0, dw0 = backward(dy, dsum, s, weight, rstd, True)
    ds1, dw1 = backward(dy, dsum, s, weight, rstd, True, tuning)
    torch.testing.assert_close(ds1, ds0, rtol=0, atol=0)
    torch.testing.assert_close(dw1, dw0, rtol=1e-5, atol=1e-5)
    n = s * rstd[:, None]  # the formula, in fp32: ds = rstd (dy w - n mean(dy w n)) + dsum, dw = sum(dy n)
    dn = dy * weight
    want = rstd[:, None] * (dn - n * (dn * n).mean(-1, keepdim=True)) + dsum
    torch.testing.assert_close(ds0, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw0, (dy * n).sum(0), rtol=1e-4, atol=1e-4)
