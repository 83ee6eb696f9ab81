"""The plain-PyTorch spec of ``moe_experts``: tokens sorted by expert, one SwiGLU MLP per expert, the results
scaled by their routing weights and summed back per token.

Layouts are transformers 5's fused expert tensors: ``gate_up [E, 2I, H]`` (gate rows first, then up rows) and
``down [E, H, I]``. It syncs with the host (per-expert row counts) and loops over experts: the spec, not a fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """x ``[T, H]``, topk_ids int ``[T, k]`` (expert of each of a token's k slots), topk_weights ``[T, k]``,
    gate_up ``[E, 2I, H]``, down ``[E, H, I]`` -> ``[T, H]`` in x's dtype:
    ``out[t] = sum_j topk_weights[t, j] * down[e] @ (silu(g) * u)``, ``g, u = split(gate_up[e] @ x[t])``,
    ``e = topk_ids[t, j]``. Differentiable in x, topk_weights, gate_up and down."""
    t, k = topk_ids.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order kept within an expert
    token_of = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x[token_of]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = F.linear(rows[start : start + n], gate_up[e])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        outs.append(F.linear(act, down[e]))
        start += n
    y = torch.cat(outs) if outs else rows.new_zeros(0, x.shape[1])
    y = y * topk_weights.reshape(-1)[order].to(y.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token_of, y)
