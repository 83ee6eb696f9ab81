"""attention: causal attention over packed variable-length sequences (cu_seqlens), GQA, sliding window."""

from polyrl.kernels.registry import register

register("attention", "reference", "polyrl.kernels.attention.reference:varlen_attention", priority=0)
register(
    "attention",
    "triton",
    "polyrl.kernels.attention.triton:varlen_attention",
    devices=("cuda",),
    dtypes=("bfloat16", "float16", "float32"),
    priority=10,
)
