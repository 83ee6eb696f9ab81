"""moe_experts: a mixture-of-experts block's routed experts (SwiGLU per expert), weighted and summed per token."""

from polyrl.kernels.registry import register

register("moe_experts", "reference", "polyrl.kernels.moe.reference:moe_experts", priority=0)
register(
    "moe_experts",
    "triton",
    "polyrl.kernels.moe.triton:moe_experts",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
    description="grouped GEMMs over expert-sorted tokens, SwiGLU and the weighted un-permute fused; sync-free",
)
# torch._grouped_mm (grouped GEMMs; torch >= 2.8 on sm90, bf16 only): below the Triton path, which the H200 bench
# measured 1.5x faster at Qwen3-30B-A3B's expert shapes (docs/performance.md); POLYRL_KERNELS=moe_experts:grouped_mm
# picks it.
register(
    "moe_experts",
    "grouped_mm",
    "polyrl.kernels.moe.grouped_mm:moe_experts",
    devices=("cuda",),
    dtypes=("bfloat16",),
    priority=5,
    description="torch._grouped_mm for both projections, SwiGLU and un-permute in torch",
)
