"""The FP8 spec in plain PyTorch: current-scaling quantisation (tensor-wise or row-wise) and the scaled GEMM as
dequantise + fp32 matmul. Runs on any device (the CPU included); the contract is in ``fp8/__init__.py``.

Not differentiable on purpose: the training linear (``models/fp8_linear.py``) owns the backward.
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale (and quantises to zeros)


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] fp8_dtype, scale fp32 [] or [M, 1])`` with ``x ~= q.float() * scale``."""
    fmax = FP8_MAX[fp8_dtype]
    xf = x.detach().float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    # fp32 true divisions (``fmax / tensor`` would be ``reciprocal * fmax`` in torch: two roundings)
    inv = torch.full_like(amax, fmax).div(amax.clamp(min=EPS))  # the quantisation scale
    q = (xf * inv).clamp(-fmax, fmax).to(fp8_dtype)
    return q, torch.ones_like(inv).div(inv)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` (fp32)."""
    return q.float() * scale


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in fp32, one rounding to ``out_dtype``. ``use_fast_accum`` has no effect
    here (the hardware's reduced-precision accumulation; the reference always accumulates in fp32)."""
    del use_fast_accum
    return (dequantize(a, scale_a) @ dequantize(b, scale_b)).to(out_dtype)
