"""moe_experts: a mixture-of-experts block's routed experts (SwiGLU per expert), weighted and summed per token."""

from polyrl.kernels.registry import register

register("moe_experts", "reference", "polyrl.kernels.moe.reference:moe_experts", priority=0)
