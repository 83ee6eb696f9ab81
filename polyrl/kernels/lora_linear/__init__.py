"""lora_linear: a frozen linear plus a LoRA adapter, ``x W^T + b + s * (x A^T) B^T``, all in one dtype."""

from polyrl.kernels.registry import register

register("lora_linear", "reference", "polyrl.kernels.lora_linear.reference:lora_linear", priority=0)
register("lora_linear", "fused", "polyrl.kernels.lora_linear.fused:lora_linear", priority=10)
# The adapter's rank-r product first, the base GEMM accumulating onto it (no separate pass over the output): the
# default since the same-run H200 A/B (scripts/gpu_stage.sh lora-adapter-first-8b, 2026-12-01): 8b QLoRA 10,507 vs
# 10,260 tokens/s with "fused". POLYRL_KERNELS=lora_linear:fused picks the other order.
register(
    "lora_linear",
    "fused_adapter_first",
    "polyrl.kernels.lora_linear.fused:lora_linear_adapter_first",
    priority=15,
)
