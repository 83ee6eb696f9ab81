"""paged_attention: decode and prefill-over-prefix attention against a paged KV cache (block tables)."""

from polyrl.kernels.registry import register

register("paged_attention", "reference", "polyrl.kernels.paged_attention.reference:paged_attention", priority=0)
register(
    "paged_attention",
    "triton",
    "polyrl.kernels.paged_attention.triton:paged_attention",
    devices=("cuda",),
    dtypes=("bfloat16", "float16", "float32"),
    priority=10,
)
register("kv_cache_write", "reference", "polyrl.kernels.paged_attention.reference:write_kv_cache", priority=0)
register(
    "kv_cache_write",
    "triton",
    "polyrl.kernels.paged_attention.triton:write_kv_cache",
    devices=("cuda",),
    dtypes=("bfloat16", "float16", "float32"),
    priority=10,
)
