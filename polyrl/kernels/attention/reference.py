"""Varlen causal attention reference: explicit softmax(QK^T * scale + mask) V per packed sequence.

Plain differentiable PyTorch, fp32 softmax (fp64 for fp64 inputs), GQA by repeating k/v heads. It
materialises [Hq, L, L] per sequence, so it is the spec and the CPU path, not the fast path.
"""

from __future__ import annotations

import torch


def causal_mask(q_len: int, k_len: int, window: int | None, device) -> torch.Tensor:
    """Boolean [q_len, k_len] mask of allowed keys; the queries are the last q_len of k_len positions."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hk, D] -> [Lq, Hq, D]; queries are the last Lq positions of Lk."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 for half inputs, fp64 stays fp64
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    mask = causal_mask(q.shape[0], k.shape[0], window, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.to(acc))
    return out.to(q.dtype)


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale=None, window=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()
    outs = [attend(q[s:e], k[s:e], v[s:e], scale, window) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0)
