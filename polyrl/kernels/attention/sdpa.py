"""Varlen causal attention through ``torch.nn.functional.scaled_dot_product_attention``, one sequence at a time.

The portable fast-ish path for the CPU and accelerators without Triton: whatever SDPA backend the
device has (flash, memory-efficient, math) runs each packed sequence; autograd comes from SDPA.
GQA uses ``enable_gqa`` (no repeated k/v); a sliding window becomes an explicit boolean mask, which
forces SDPA's math/efficient backends and costs [L, L] bytes per sequence. It reads ``cu_seqlens``
on the host (one sync), so it is not CUDA-graph capturable; the Triton kernel is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.kernels.attention.reference import causal_mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [L, Hq, D], k/v [L, Hk, D] of one sequence -> [L, Hq, D]."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, L, D]
    gqa = q.shape[1] != k.shape[1]
    if window is None or window >= q.shape[0]:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = causal_mask(q.shape[0], k.shape[0], window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence (see ``polyrl.kernels.varlen_attention``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    bounds = cu_seqlens.tolist()
    outs = [_attend(q[s:e], k[s:e], v[s:e], scale, window) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0).contiguous()
