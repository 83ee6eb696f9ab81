"""The plain-PyTorch spec of ``moe_experts_lora``: ``moe_experts`` on the adapted weights, materialised.

``W'_e = W_e + scale * B_e @ A_e`` per projection with an adapter, then the reference ``moe_experts``. The fast path
(``triton.py``) computes the same without building ``W'``.
"""

from __future__ import annotations

import torch

from polyrl.errors import UserError
from polyrl.kernels.moe.reference import moe_experts


def frozen_base(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """``moe_experts_lora`` takes no gradient for the base weights: refuse a base that asks for one."""
    if torch.is_grad_enabled() and (gate_up.requires_grad or down.requires_grad):
        raise UserError(
            "moe_experts_lora computes no gradient for the base expert weights (a frozen LoRA base), but gate_up or "
            "down requires grad: freeze them (requires_grad_(False)), or train them with moe_experts on the adapted "
            "weights"
        )


def moe_experts_lora(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_a: torch.Tensor | None,
    gate_up_b: torch.Tensor | None,
    down_a: torch.Tensor | None,
    down_b: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``moe_experts`` on the adapted weights ``W'_e = W_e + scale * B_e @ A_e`` of each projection with an adapter
    (``gate_up_a [E, r, H]`` / ``gate_up_b [E, 2I, r]``, ``down_a [E, r, I]`` / ``down_b [E, H, r]``; a pair of
    None: no adapter there). The base weights are frozen (``frozen_base``); differentiable in x, topk_weights and
    the adapters. The spec materialises ``W'``; the fast path never does."""
    gate_up, down = adapted_weights(gate_up, down, gate_up_a, gate_up_b, down_a, down_b, scale)
    return moe_experts(x, topk_ids, topk_weights, gate_up, down)


def adapted_weights(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_a: torch.Tensor | None,
    gate_up_b: torch.Tensor | None,
    down_a: torch.Tensor | None,
    down_b: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W + scale * B @ A`` (``baddbmm``) of each projection with an adapter, after ``frozen_base``."""
    frozen_base(gate_up, down)
    if gate_up_a is not None:
        gate_up = torch.baddbmm(gate_up, gate_up_b, gate_up_a, alpha=scale)
    if down_a is not None:
        down = torch.baddbmm(down, down_b, down_a, alpha=scale)
    return gate_up, down
