"""qk_norm_rope: Qwen3's per-head RMSNorm of q and k followed by rotate-half RoPE, in one pass (no autograd).

Contract (``reference.py`` is the spec)::

    qk_norm_rope(q [T, Hq, D], k [T, Hk, D], q_weight [D], k_weight [D], cos [T, D], sin [T, D], eps)
        -> (q', k')  = apply_rope(rmsnorm(q, q_weight, eps), rmsnorm(k, k_weight, eps), cos, sin)

The unfused decode step launches three kernels per layer for this (two norms, one RoPE): 84 of a batch-1 step's
~430 launches at qwen3-0.6b. The Triton kernel rounds where the unfused Triton kernels round (the normalised value
to the dtype, its product with the weight to the dtype, the rotation once), so it gives their bits.

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
