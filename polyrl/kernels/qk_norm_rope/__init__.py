"""qk_norm_rope: Qwen3's per-head RMSNorm of q and k followed by rotate-half RoPE, in one pass (no autograd).

Contract (``reference.py`` is the spec)::

    qk_norm_rope(q [T, Hq, D], k [T, Hk, D], q_weight [D], k_weight [D], cos [T, D], sin [T, D], eps)
        -> (q', k')  = apply_rope(rmsnorm(q, q_weight, eps), rmsnorm(k, k_weight, eps), cos, sin)

The unfused decode step launches three kernels per layer for this (two norms, one RoPE): 84 of a batch-1 step's
~430 launches at qwen3-0.6b. The Triton kernel rounds where the unfused Triton kernels round (the normalised value
to the dtype, its product with the weight to the dtype, the rotation once), so it gives their bits.

``qk_norm_rope_cache(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slot_mapping) -> q'`` is the
same with the paged step's KV-cache write folded in (``write_kv_cache(k', v, ...)``, the reference's composition):
k' and v go straight to their slots, one launch instead of two per layer (the 0.6b B256 decode profile: the write was
a separate ~3.2 us launch, 28 a step). The cache gets the bits the two-kernel path stores.

Used by ``polyrl.models.decoder`` with ``DecoderOptions.fused_qk_norm_rope`` (on by default: measured faster on the
GPU, docs/performance.md) and only when autograd is off.
"""

from polyrl.kernels.registry import register

register("qk_norm_rope", "reference", "polyrl.kernels.qk_norm_rope.reference:qk_norm_rope", priority=0)
register(
    "qk_norm_rope",
    "triton",
    "polyrl.kernels.qk_norm_rope.triton:qk_norm_rope",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
register("qk_norm_rope_cache", "reference", "polyrl.kernels.qk_norm_rope.reference:qk_norm_rope_cache", priority=0)
register(
    "qk_norm_rope_cache",
    "triton",
    "polyrl.kernels.qk_norm_rope.triton:qk_norm_rope_cache",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
