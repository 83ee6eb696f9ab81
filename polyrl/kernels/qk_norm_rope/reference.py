"""qk_norm_rope reference: the unfused composition of the rmsnorm and rope references."""

from __future__ import annotations

import torch

from polyrl.kernels.rmsnorm.reference import rmsnorm
from polyrl.kernels.rope.reference import apply_rope


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(rmsnorm(q, q_weight, eps), rmsnorm(k, k_weight, eps), cos, sin)
