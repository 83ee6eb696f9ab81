"""lora_linear: a frozen linear plus a LoRA adapter, ``x W^T + b + s * (x A^T) B^T``, all in one dtype."""

from polyrl.kernels.registry import register

register("lora_linear", "reference", "polyrl.kernels.lora_linear.reference:lora_linear", priority=0)
register("lora_linear", "fused", "polyrl.kernels.lora_linear.fused:lora_linear", priority=10)
# Candidate, below "fused" until a same-run GPU bench shows it faster (scripts/gpu_stage.sh lora-adapter-first);
# force it with POLYRL_KERNELS=lora_linear:fused_adapter_first.
register(
    "lora_linear",
    "fused_adapter_first",
    "polyrl.kernels.lora_linear.fused:lora_linear_adapter_first",
    priority=5,
)
