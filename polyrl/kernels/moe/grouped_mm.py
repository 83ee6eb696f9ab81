"""moe_experts on ``torch._grouped_mm`` (torch >= 2.8, CUDA sm90, bf16): the same routing as the Triton path
(argsort + scatter_add counts + cumsum offsets, no host sync), cuBLAS/CUTLASS grouped GEMMs for the two
projections, SwiGLU and the weighted un-permute in plain torch (a gather of each token's k rows and a sum, no
atomics). Autograd comes from torch's own derivatives of ``_grouped_mm``.

A comparison point for the Triton kernel (``polyrl bench kernels --ops moe_experts``) and a fallback where it
measures faster; not here: a fused SwiGLU or un-permute (that is the Triton path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

if not hasattr(torch, "_grouped_mm"):  # the registry skips an implementation that fails to load
    raise ImportError(f"torch {torch.__version__} has no torch._grouped_mm (needs torch >= 2.8)")


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``polyrl.kernels.moe.reference.moe_experts``."""
    t, k = topk_ids.shape
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[torch.div(order, k, rounding_mode="floor")]
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=x.device))
    out = (y[pos].view(t, k, hidden).float() * topk_weights.float().unsqueeze(-1)).sum(1)
    return out.to(x.dtype)
