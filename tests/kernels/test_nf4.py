"""NF4 (QLoRA base): the code table from its definition, quantize -> dequantize error bounds, the reference
matmul, and the Triton dequant-matmul against the reference (interpreter: fp32/fp16, small shapes; GPU: real
shapes in bf16)."""

from __future__ import annotations

import pytest
import torch

from polyrl.kernels.nf4.reference import NF4_CODE, dequantize_nf4, nf4_matmul, quantize_nf4

MAX_HALF_GAP = max(b - a for a, b in zip(NF4_CODE[:-1], NF4_CODE[1:])) / 2  # 0.1519


def test_code_table_is_the_normal_quantile_definition():
    off = 0.9677083
    pos = torch.special.ndtri(torch.linspace(off, 0.5, 9, dtype=torch.float64))[:-1]
    neg = -torch.special.ndtri(torch.linspace(off, 0.5, 8, dtype=torch.float64))[:-1]
    v = torch.sort(torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg])).values
    v = v / v.abs().max()
    assert (v - torch.tensor(NF4_CODE, dtype=torch.float64)).abs().max().item() < 1e-6
    assert len(set(NF4_CODE)) == 16 and 0.0 in NF4_CODE


@pytest.mark.parametrize("shape", [(3, 64), (5, 96), (1, 7), (17, 200)])
def test_roundtrip_error_bound_and_exact_codes(shape, seeded):
    w = torch.randn(*shape, generator=seeded)
    packed, absmax = quantize_nf4(w)
    kp = -(-shape[1] // 64) * 64
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], kp // 2)
    assert absmax.shape == (shape[0], kp // 64)
    back = dequantize_nf4(packed, absmax, shape)
    # per element: at most half the widest code gap times its block's absmax (+ fp32 rounding)
    amax = torch.nn.functional.pad(w.abs(), (0, kp - shape[1])).view(shape[0], -1, 64).amax(-1)
    bound = (amax * MAX_HALF_GAP).repeat_interleave(64, dim=1)[:, : shape[1]] + 1e-6
    assert ((back - w).abs() <= bound).all()
    # nearest code: no other code value is closer to w / absmax than the chosen one
    scale = amax.repeat_interleave(64, dim=1)[:, : shape[1]]
    code = torch.tensor(NF4_CODE)
    best = (w[..., None] / scale[..., None] - code).abs().min(-1).values * scale
    assert ((back - w).abs() - best).abs().max().item() < 1e-5
    # the block's absmax element is exact (code +-1)
    assert (back.abs().amax(1) - w.abs().amax(1)).abs().max().item() < 1e-6
    # quantizing the dequantized weight reproduces the same codes
    p2, a2 = quantize_nf4(back)
    assert torch.equal(p2, packed) and torch.allclose(a2, absmax)


def test_reference_matmul_and_gradient(seeded):
    w = torch.randn(24, 130, generator=seeded)
    packed, absmax = quantize_nf4(w)
    x = torch.randn(2, 5, 130, generator=seeded, requires_grad=True)
    y = nf4_matmul(x, packed, absmax, (24, 130))
    dense = dequantize_nf4(packed, absmax, (24, 130))
    assert y.shape == (2, 5, 24)
    assert torch.allclose(y, x @ dense.T, atol=1e-6)
    y.sum().backward()
    assert torch.allclose(x.grad, dense.sum(0).expand(2, 5, 130), atol=1e-5)


@pytest.mark.parametrize("m, n, k", [(1, 5, 64), (7, 33, 96), (19, 70, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(triton_kernels, kernel_check, m, n, k, dtype, seeded):
    fn = triton_kernels.load("nf4", "nf4_matmul")
    dev = triton_kernels.device
    w = torch.randn(n, k, generator=seeded)
    packed, absmax = quantize_nf4(w)
    x = torch.randn(m, k, generator=seeded).to(dtype)
    packed, absmax, x = packed.to(dev), absmax.to(dev), x.to(dev).requires_grad_(True)
    y = fn(x, packed, absmax, (n, k))
    ref = nf4_matmul(x.detach().double(), packed, absmax, (n, k))
    kernel_check.assert_close(y, ref, dtype, "y")
    dy = torch.randn(m, n, generator=seeded).to(dtype).to(dev)
    y.backward(dy)
    dense = dequantize_nf4(packed, absmax, (n, k), torch.float64)
    kernel_check.assert_close(x.grad, dy.double() @ dense, dtype, "dx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dequant_and_large_m_path(triton_kernels, kernel_check, dtype, seeded, monkeypatch):
    triton_kernels.load("nf4", "nf4_matmul")  # (re)imports the module for this device / the interpreter
    import polyrl.kernels.nf4.triton as tmod

    dev = triton_kernels.device
    for n, k in ((32, 96), (5, 130)):
        packed, absmax = quantize_nf4(torch.randn(n, k, generator=seeded))
        packed, absmax = packed.to(dev), absmax.to(dev)
        w = tmod.dequantize(packed, absmax, (n, k), dtype)
        assert torch.equal(w.cpu(), dequantize_nf4(packed, absmax, (n, k), dtype).cpu())
    monkeypatch.setattr(tmod, "FUSED_MAX_ROWS", 2)  # the dense-dequant + GEMM path on a small M
    x = torch.randn(9, 130, generator=seeded).to(dtype).to(dev)
    y = tmod.nf4_matmul(x, packed, absmax, (5, 130))
    kernel_check.assert_close(y, nf4_matmul(x.double(), packed, absmax, (5, 130)), dtype, "y")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_triton_real_shape_bf16(triton_kernels, kernel_check, m):
    """[M, 2048] x [2048, 6144] in bf16 (the qwen3-1.7b MLP up projection), against the dense reference."""
    fn = triton_kernels.load("nf4", "nf4_matmul")
    dev = triton_kernels.device
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(6144, 2048, generator=gen, device=dev) * 0.02
    packed, absmax = quantize_nf4(w)
    x = torch.randn(m, 2048, generator=gen, device=dev).to(torch.bfloat16)
    y = fn(x, packed, absmax, (6144, 2048))
    ref = x.double() @ dequantize_nf4(packed, absmax, (6144, 2048), torch.float64).T
    kernel_check.assert_close(y, ref, torch.bfloat16, "y")
