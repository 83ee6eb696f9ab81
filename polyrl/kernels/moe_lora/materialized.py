"""moe_experts_lora by materialising the adapted weights, ``W' = W + scale * B @ A`` (``baddbmm``), then the
``moe_experts`` op (whichever implementation the registry picks for it): what ``LoraExperts`` always did, and the
default until the fused Triton path is measured on a device. Any rank, any device; autograd reaches the adapters
through the ``baddbmm``. Cost: one ``[E, out, in]`` temporary per adapted projection in forward and backward, and
the op's full weight gradient of each, reduced to A and B afterwards.
"""

from __future__ import annotations

import torch

from polyrl.kernels import ops  # loaded by the registry when first selected: ops is complete by then
from polyrl.kernels.moe_lora.reference import adapted_weights


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
    """Same contract as ``polyrl.kernels.moe_lora.reference.moe_experts_lora``."""
    gate_up, down = adapted_weights(gate_up, down, gate_up_a, gate_up_b, down_a, down_b, scale)
    return ops.moe_experts(x, topk_ids, topk_weights, gate_up, down)
