"""moe_experts_lora: a MoE block's routed experts with a LoRA adapter per expert on ``gate_up`` and/or ``down``
(frozen base). On CUDA devices the fused Triton path (each adapter's rank-r product a second K segment of the grouped
GEMM; no ``W'``, no base weight gradients) is the default: on the H200 it ran the op 2.1x faster than the
materialised path (2.51 vs 5.24 ms, CUDA graphs, T=4096 H=2048 I=768 E=128 k=8 r=16) and LoRA SFT at
qwen3-30b-a3b-L8 4 x 4096 at 92.6k against 84.3k tokens/s, 21.6 against 31.5 GiB peak (docs/performance.md,
sixteenth session); an adapter of rank above 128 (one tile) goes through the materialised path. ``materialized``
(``W' = W + s B @ A``, then the ``moe_experts`` op) elsewhere; ``POLYRL_KERNELS=moe_experts_lora:materialized``
picks it on CUDA too."""

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
    priority=7,
    description="moe_experts with each adapter's rank-r product as a second K segment of its GEMM; no W' built",
)
