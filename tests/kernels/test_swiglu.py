"""SwiGLU: the reference against the closed form, the Triton kernel against the reference (output and
both gradients, awkward widths, strided halves of a fused projection, fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch

from polyrl.kernels.swiglu.reference import swiglu as ref_swiglu


def test_reference_matches_closed_form_and_its_gradient():
    g = torch.randn(9, 33, dtype=torch.float64, requires_grad=True)
    u = torch.randn(9, 33, dtype=torch.float64, requires_grad=True)
    y = ref_swiglu(g, u)
    sig = 1 / (1 + torch.exp(-g.detach()))
    torch.testing.assert_close(y, g.detach() * sig * u.detach(), rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    # d silu(g) / dg = sig * (1 + g (1 - sig))
    torch.testing.assert_close(g.grad, dy * u.detach() * sig * (1 + g.detach() * (1 - sig)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(u.grad, dy * g.detach() * sig, rtol=1e-12, atol=1e-12)


def _fwd_bwd(fn, g, u, seed=0):
    gr, ur = (t.detach().clone().requires_grad_(True) for t in (g, u))
    y = fn(gr, ur)
    gen = torch.Generator().manual_seed(seed)
    (y.double() * torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device)).sum().backward()
    return y.detach(), gr.grad, ur.grad


SHAPES = [(1,), (7, 1), (1, 127), (127, 7), (3, 1025), (2, 3, 2049)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_fp32_matches_reference(triton_kernels, kernel_check, shape):
    fn = triton_kernels.load("swiglu")
    dev = triton_kernels.device
    g, u = torch.randn(*shape, device=dev) * 4, torch.randn(*shape, device=dev)
    got = _fwd_bwd(fn, g, u)
    want = _fwd_bwd(ref_swiglu, g.double(), u.double())
    for name, a, b in zip(["y", "dgate", "dup"], got, want):
        kernel_check.assert_close(a, b, torch.float32, name)
    assert got[0].shape == g.shape and got[0].dtype == torch.float32


def test_triton_strided_halves_of_fused_projection(triton_kernels, kernel_check):
    fn = triton_kernels.load("swiglu")
    dev = triton_kernels.device
    gate_up = torch.randn(11, 2 * 96, device=dev)
    g, u = gate_up[:, :96], gate_up[:, 96:]
    got = _fwd_bwd(fn, g, u)
    want = _fwd_bwd(ref_swiglu, g.double(), u.double())
    for name, a, b in zip(["y", "dgate", "dup"], got, want):
        kernel_check.assert_close(a, b, torch.float32, name)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid(-100) under numpy
def test_triton_bf16_matches_reference(triton_kernels, kernel_check):
    fn = triton_kernels.load("swiglu")
    dev = triton_kernels.device
    g, u = (torch.randn(17, 300, device=dev) * 3).bfloat16(), torch.randn(17, 300, device=dev).bfloat16()
    got = _fwd_bwd(fn, g, u)
    want = _fwd_bwd(ref_swiglu, g.double(), u.double())
    assert all(t.dtype == torch.bfloat16 for t in got)
    for name, a, b in zip(["y", "dgate", "dup"], got, want):
        kernel_check.assert_close(a, b, torch.bfloat16, name)
    # Saturated gates stay finite: silu(-100) = 0, silu(100) = 100.
    big = torch.tensor([[-100.0, 100.0, 0.0]], device=dev).bfloat16()
    y = fn(big, torch.ones_like(big))
    assert torch.isfinite(y.float()).all() and y.float().tolist() == [[0.0, 100.0, 0.0]]


def test_triton_rejects_mismatched_shapes(triton_kernels):
    fn = triton_kernels.load("swiglu")
    with pytest.raises(ValueError, match="one shape"):
        fn(torch.randn(3, 4, device=triton_kernels.device), torch.randn(3, 5, device=triton_kernels.device))


@pytest.mark.gpu
def test_triton_large_bf16_on_gpu(triton_kernels, kernel_check):
    assert not triton_kernels.interpreted
    fn = triton_kernels.load("swiglu")
    dev = triton_kernels.device
    g, u = torch.randn(16384, 3072, device=dev).bfloat16(), torch.randn(16384, 3072, device=dev).bfloat16()
    got = _fwd_bwd(fn, g, u)
    want = _fwd_bwd(ref_swiglu, g.float(), u.float())
    for name, a, b in zip(["y", "dgate", "dup"], got, want):
        kernel_check.assert_close(a, b, torch.bfloat16, name)


def test_triton_flat_and_row_paths_agree_with_reference(triton_kernels, kernel_check):
    """Contiguous inputs take the flat 1-D kernel (here over two blocks plus a tail); a transposed gate and a
    strided up take the row kernel; a broadcast (non-contiguous) cotangent is accepted by both."""
    fn = triton_kernels.load("swiglu")
    dev = triton_kernels.device
    g, u = torch.randn(2, 4111, device=dev) * 3, torch.randn(2, 4111, device=dev)
    gt = torch.randn(33, 7, device=dev).t()  # [7, 33], last-dim stride 7
    ut = torch.randn(7, 66, device=dev)[:, ::2]  # [7, 33], last-dim stride 2
    for gate, up in ((g, u), (gt, ut), (gt.contiguous(), ut)):
        got = _fwd_bwd(fn, gate, up)
        want = _fwd_bwd(ref_swiglu, gate.double(), up.double())
        for name, a, b in zip(["y", "dgate", "dup"], got, want):
            kernel_check.assert_close(a, b, torch.float32, name)
        gr = gate.detach().clone().requires_grad_(True)
        fn(gr, up).sum().backward()  # dy = ones expanded: stride 0
        sig = torch.sigmoid(gate.double())
        kernel_check.assert_close(gr.grad, up.double() * sig * (1 + gate.double() * (1 - sig)), torch.float32, "dg")
