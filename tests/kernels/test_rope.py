"""RoPE: the reference against a naive complex-multiplication RoPE, the Triton kernel against the
reference (q/k outputs and gradients, awkward sizes, GQA head counts, strided views, fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch

from polyrl.kernels.rope.reference import apply_rope as ref_rope
from polyrl.kernels.rope.reference import rope_cos_sin


def _naive_complex_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE as complex multiplication: (x[i] + j x[i + D/2]) * exp(j * pos * theta^(-2i/D))."""
    d = x.shape[-1]
    half = d // 2
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2 / d)
    angle = positions.double()[:, None] * inv[None, :]  # [T, D/2]
    z = (
        torch.complex(x[..., :half].double(), x[..., half:].double())
        * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    )
    return torch.cat([z.real, z.imag], dim=-1)


def _packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def test_reference_matches_complex_rope_on_packed_positions():
    pos = _packed_positions([5, 1, 9])
    q = torch.randn(15, 4, 64, dtype=torch.float64)
    k = torch.randn(15, 2, 64, dtype=torch.float64)
    cos, sin = rope_cos_sin(pos, 64, 10000.0, dtype=torch.float64)
    q_out, k_out = ref_rope(q, k, cos, sin)
    # cos/sin are built from fp32 inverse frequencies (as HF does): fp32-level agreement.
    torch.testing.assert_close(q_out, _naive_complex_rope(q, pos, 10000.0), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(k_out, _naive_complex_rope(k, pos, 10000.0), rtol=1e-5, atol=2e-5)
    # Position 0 is the identity; the rotation preserves norms.
    first = torch.tensor([0, 5, 6])
    torch.testing.assert_close(q_out[first], q[first])
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))


def _fwd_bwd(fn, q, k, cos, sin, seed=0):
    qr, kr = (t.detach().clone().requires_grad_(True) for t in (q, k))
    qo, ko = fn(qr, kr, cos, sin)
    g = torch.Generator().manual_seed(seed)
    gq = torch.randn(qo.shape, generator=g, dtype=torch.float64).to(qo.device)
    gk = torch.randn(ko.shape, generator=g, dtype=torch.float64).to(ko.device)
    ((qo.double() * gq).sum() + (ko.double() * gk).sum()).backward()
    return qo.detach(), ko.detach(), qr.grad, kr.grad


CASES = [  # (T, Hq, Hk, D)
    (1, 4, 2, 64),
    (7, 3, 1, 8),
    (127, 4, 4, 80),  # half = 40: not a power of two
    (1025, 2, 1, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-Hq{}-Hk{}-D{}".format(*c))
def test_triton_fp32_matches_reference(triton_kernels, kernel_check, case):
    fn = triton_kernels.load("rope", "apply_rope")
    dev = triton_kernels.device
    t, hq, hk, d = case
    pos = (torch.arange(t) * 37) % 4099  # large, non-monotone positions
    cos, sin = rope_cos_sin(pos, d, 1e6)
    cos, sin = cos.to(dev), sin.to(dev)
    q, k = torch.randn(t, hq, d, device=dev), torch.randn(t, hk, d, device=dev)
    got = _fwd_bwd(fn, q, k, cos, sin)
    want = _fwd_bwd(ref_rope, q.double(), k.double(), cos.double(), sin.double())
    for name, a, b in zip(["q", "k", "dq", "dk"], got, want):
        kernel_check.assert_close(a, b, torch.float32, name)
    assert got[0].dtype == torch.float32 and got[0].is_contiguous()


def test_triton_backward_is_inverse_rotation(triton_kernels, kernel_check):
    fn = triton_kernels.load("rope", "apply_rope")
    dev = triton_kernels.device
    pos = torch.arange(9)
    cos, sin = (t.to(dev) for t in rope_cos_sin(pos, 32, 10000.0))
    q = torch.randn(9, 2, 32, device=dev, requires_grad=True)
    k = torch.randn(9, 1, 32, device=dev, requires_grad=True)
    qo, ko = fn(q, k, cos, sin)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward([qo, ko], [gq, gk])
    inv_q, inv_k = ref_rope(gq, gk, cos, -sin)  # rotation by -angle
    kernel_check.assert_close(q.grad, inv_q, torch.float32, "dq")
    kernel_check.assert_close(k.grad, inv_k, torch.float32, "dk")
    # And applying the inverse to the output gives back the input.
    back_q, _ = fn(qo.detach(), ko.detach(), cos, -sin)
    kernel_check.assert_close(back_q, q.detach(), torch.float32, "round trip")


def test_triton_strided_views_of_fused_qkv(triton_kernels, kernel_check):
    fn = triton_kernels.load("rope", "apply_rope")
    dev = triton_kernels.device
    t, hq, hk, d = 13, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    assert not q.is_contiguous()
    cos, sin = (x.to(dev) for x in rope_cos_sin(torch.arange(t), d, 10000.0))
    got = _fwd_bwd(fn, q, k, cos, sin)
    want = _fwd_bwd(ref_rope, q.double(), k.double(), cos.double(), sin.double())
    for name, a, b in zip(["q", "k", "dq", "dk"], got, want):
        kernel_check.assert_close(a, b, torch.float32, name)


def test_triton_bf16_matches_reference(triton_kernels, kernel_check):
    fn = triton_kernels.load("rope", "apply_rope")
    dev = triton_kernels.device
    t, hq, hk, d = 33, 4, 2, 64
    cos, sin = (x.to(dev) for x in rope_cos_sin(torch.arange(t) + 100, d, 1e6))
    q, k = torch.randn(t, hq, d, device=dev).bfloat16(), torch.randn(t, hk, d, device=dev).bfloat16()
    got = _fwd_bwd(fn, q, k, cos, sin)
    want = _fwd_bwd(ref_rope, q.double(), k.double(), cos.bfloat16().double(), sin.bfloat16().double())
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    for name, a, b in zip(["q", "k", "dq", "dk"], got, want):
        kernel_check.assert_close(a, b, torch.bfloat16, name)


def test_triton_rejects_bad_shapes(triton_kernels):
    fn = triton_kernels.load("rope", "apply_rope")
    dev = triton_kernels.device
    q, k = torch.randn(4, 2, 8, device=dev), torch.randn(4, 1, 8, device=dev)
    with pytest.raises(ValueError, match="cos/sin"):
        fn(q, k, torch.ones(4, 4, device=dev), torch.ones(4, 4, device=dev))
    with pytest.raises(ValueError, match="even head dim"):
        fn(torch.randn(4, 2, 7, device=dev), torch.randn(4, 1, 7, device=dev), torch.ones(4, 7), torch.ones(4, 7))


@pytest.mark.gpu
def test_triton_large_bf16_on_gpu(triton_kernels, kernel_check):
    assert not triton_kernels.interpreted
    fn = triton_kernels.load("rope", "apply_rope")
    dev = triton_kernels.device
    t, hq, hk, d = 16384, 32, 8, 128
    cos, sin = (x.to(dev) for x in rope_cos_sin(torch.arange(t, device=dev) % 4096, d, 1e6))
    q, k = torch.randn(t, hq, d, device=dev).bfloat16(), torch.randn(t, hk, d, device=dev).bfloat16()
    got = _fwd_bwd(fn, q, k, cos, sin)
    want = _fwd_bwd(ref_rope, q.float(), k.float(), cos.bfloat16().float(), sin.bfloat16().float())
    for name, a, b in zip(["q", "k", "dq", "dk"], got, want):
        kernel_check.assert_close(a, b, torch.bfloat16, name)
