"""qk_norm_rope reference: the unfused composition of the rmsnorm and rope references."""

from __future__ import annotations

import torch

from polyrl.kernels.paged_attention.reference import write_kv_cache
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


def qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    q, k = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q
