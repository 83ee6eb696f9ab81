"""The FP8 spec in plain PyTorch: current-scaling quantisation (tensor-wise or row-wise) and the scaled GEMM as
dequantise + fp32 matmul. Runs on any device (the CPU included); the contract is in ``fp8/__init__.py``.

Not differentiable on purpose: the training linear (``models/fp8_linear.py``) owns the backward.
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale (and quantises to zeros)
# Delayed scaling (``quantize_t_delayed``): the previous call's amax times this power of two maps to FP8_MAX, so a
# tensor whose amax grew up to 256x since that call still fits; and the recorded amax is capped (finite, so a
# non-finite tensor cannot poison the next call's scale with inf).
DELAYED_HEADROOM = 256.0
AMAX_CAP = 2.0**64


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] fp8_dtype, scale fp32 [] or [M, 1])`` with ``x ~= q.float() * scale``."""
    fmax = FP8_MAX[fp8_dtype]
    xf = x.detach().float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    # fp32 true divisions (``fmax / tensor`` would be ``reciprocal * fmax`` in torch: two roundings)
    inv = torch.full_like(amax, fmax).div(amax.clamp(min=EPS))  # the quantisation scale
    q = (xf * inv).clamp(-fmax, fmax).to(fp8_dtype)
    return q, torch.ones_like(inv).div(inv)


def quantize_t(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False, pad_t: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q, scale, q_t, scale_t)``: ``quantize(x, fp8_dtype, rowwise)`` and the tensor-wise
    quantisation's transpose ``q_t [K, M_pad]`` (contiguous; ``M_pad`` = M rounded up to a multiple of ``pad_t``, the
    extra columns zero) with its scale ``[]``. Tensor-wise, ``q_t`` is ``q.t()`` copied and ``scale_t`` is
    ``scale``; row-wise, ``q_t`` has its own (tensor-wise) scale: the FP8 linear's backward GEMMs take tensor-wise
    operands whatever the forward's recipe, and the padding makes the weight gradient's reduction dim (tokens) what
    ``torch._scaled_mm`` accepts without another copy (zeros add nothing to the products)."""
    q, scale = quantize(x, fp8_dtype, rowwise)
    q_t, scale_t = (q, scale) if not rowwise else quantize(x, fp8_dtype, False)
    return q, scale, _transposed(q_t, x.shape[-1], pad_t, fp8_dtype), scale_t


def _transposed(q: torch.Tensor, k: int, pad_t: int, fp8_dtype: torch.dtype) -> torch.Tensor:
    q_t = q.reshape(-1, k).t()
    m = q_t.shape[1]
    m_pad = -(-m // pad_t) * pad_t
    out = torch.zeros((q_t.shape[0], m_pad), dtype=torch.uint8, device=q.device)  # no fp8 zeros/pad on every torch
    out[:, :m] = q_t.view(torch.uint8)
    return out.view(fp8_dtype)


def quantize_t_delayed(
    x: torch.Tensor, fp8_dtype: torch.dtype, state: torch.Tensor, ready: bool, pad_t: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tensor-wise ``quantize_t`` with a *delayed* scale (contract in ``fp8/__init__.py``): ``state`` int32 ``[2]``
    holds the bits of the previous call's amax (fp32) in ``state[0]``. ``ready``: ``inv = FP8_MAX / (max(prev, EPS)
    * DELAYED_HEADROOM)``; not ready (the site's first call): the current scale, as ``quantize_t``. Either way this
    call's own ``min(max|x|, AMAX_CAP)`` is recorded into ``state[0]`` for the next call (``state[1]`` left zero)."""
    fmax = FP8_MAX[fp8_dtype]
    k = x.shape[-1]
    xf = x.detach().float().reshape(-1, k)
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    if ready:
        prev = state[:1].view(torch.float32)[0]
        inv = torch.full_like(prev, fmax).div(prev.clamp(min=EPS) * DELAYED_HEADROOM)
    else:
        inv = torch.full_like(amax, fmax).div(amax.clamp(min=EPS))
    q = (xf * inv).clamp(-fmax, fmax).to(fp8_dtype)
    scale = torch.ones_like(inv).div(inv)
    record = torch.nan_to_num(amax, nan=AMAX_CAP).clamp(max=AMAX_CAP).reshape(1)
    state.zero_()
    state[:1].copy_(record.view(torch.int32))
    return q.view(x.shape), scale, _transposed(q, k, pad_t, fp8_dtype), scale


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
    # both operands made row-major first: the result does not depend on the operands' layouts (the FP8 linear hands
    # the same numbers as a transposed view or as a transposed copy, and must get the same product either way)
    return (dequantize(a, scale_a).contiguous() @ dequantize(b, scale_b).contiguous()).to(out_dtype)
