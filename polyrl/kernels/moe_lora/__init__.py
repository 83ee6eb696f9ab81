"""moe_experts_lora: a MoE block's routed experts with a LoRA adapter per expert on ``gate_up`` and/or ``down``
(frozen base). ``materialized`` (the default everywhere: ``W'`` built, then the ``moe_experts`` op) until the fused
Triton path, which never builds ``W'`` nor the base's weight gradients, is measured on a device;
``POLYRL_KERNELS=moe_experts_lora:triton`` picks it."""

from polyrl.kernels.registry import register

register("moe_experts_lora", "reference", "polyrl.kernels.moe_lora.reference:moe_experts_lora", priority=0)
register(
    "moe_experts_lora",
    "materialized",
    "polyrl.kernels.moe_lora.materialized:moe_experts_lora",
    priority=5,
    description="W' = W + s B @ A built per projection, then the moe_experts op",
)
register(
    "moe_experts_lora",
    "triton",
    "polyrl.kernels.moe_lora.triton:moe_experts_lora",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=3,  # below "materialized" until measured on a device (docs/models.md)
    description="moe_experts with each adapter's rank-r product as a second K segment of its GEMM; no W' built",
)
