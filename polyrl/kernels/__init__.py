"""polyrl.kernels: every custom op, each with a plain-PyTorch reference and faster implementations.

The op functions (``ops``, re-exported here) are the only way the rest of polyrl calls an op. Each dispatches through
``registry.select`` on the device type and dtype of its first tensor argument; the reference in
``polyrl/kernels/<op>/reference.py`` is the spec every implementation is tested against.

Shapes: T tokens (packed, variable-length sequences concatenated), Hq query heads, Hk key/value heads
(GQA: Hq % Hk == 0), D head dim, H hidden size, V vocabulary, B sequences.

Importing this package imports torch but never triton: implementations load lazily.
"""

from __future__ import annotations

from polyrl.kernels import registry
from polyrl.kernels.nf4.reference import NF4Weight
from polyrl.kernels.registry import KernelUnavailable

# Importing each op package registers its implementations.
from polyrl.kernels import (  # noqa: E402,F401  isort: skip
    rmsnorm as _rmsnorm_pkg,
    rope as _rope_pkg,
    swiglu as _swiglu_pkg,
    attention as _attention_pkg,
    paged_attention as _paged_attention_pkg,
    linear_cross_entropy as _lce_pkg,
    token_logprobs as _tlp_pkg,
    sampling as _sampling_pkg,
    nf4 as _nf4_pkg,
    lora_linear as _lora_linear_pkg,
    skinny_linear as _skinny_linear_pkg,
    qk_norm_rope as _qk_norm_rope_pkg,
    moe as _moe_pkg,
    moe_lora as _moe_lora_pkg,
    fp8 as _fp8_pkg,
    token_bitmask as _token_bitmask_pkg,
)

# The op functions, bound after the op packages so that ``kernels.rmsnorm`` is the function, not its folder.
from polyrl.kernels.ops import (  # noqa: E402  isort: skip
    PAGED_ATTENTION_GRAPH_HEAD_DIMS,
    apply_rope,
    apply_token_bitmask,
    capture_keeps_fast_paths,
    dtype_name,
    fp8_quantize,
    fp8_scaled_mm,
    linear_cross_entropy,
    lora_linear,
    moe_experts,
    moe_experts_lora,
    nf4_dequantize,
    nf4_matmul,
    paged_attention,
    paged_attention_graph_safe,
    qk_norm_rope,
    qk_norm_rope_cache,
    rmsnorm,
    rope_cos_sin,
    sample_tokens,
    skinny_linear,
    swiglu,
    token_logprobs,
    varlen_attention,
    write_kv_cache,
)

__all__ = [
    "PAGED_ATTENTION_GRAPH_HEAD_DIMS",
    "KernelUnavailable",
    "dtype_name",
    "paged_attention_graph_safe",
    "registry",
    "rmsnorm",
    "apply_rope",
    "apply_token_bitmask",
    "rope_cos_sin",
    "swiglu",
    "varlen_attention",
    "capture_keeps_fast_paths",
    "paged_attention",
    "write_kv_cache",
    "linear_cross_entropy",
    "token_logprobs",
    "sample_tokens",
    "nf4_matmul",
    "nf4_dequantize",
    "NF4Weight",
    "lora_linear",
    "skinny_linear",
    "qk_norm_rope",
    "qk_norm_rope_cache",
    "moe_experts",
    "moe_experts_lora",
    "fp8_quantize",
    "fp8_scaled_mm",
]
