"""The public kernel ops: each function picks its implementation from the registry by the tensor's device and dtype
(``POLYRL_KERNELS`` forces one) and calls it. ``polyrl.kernels`` re-exports them; a kernel that calls another op
(LoRA's fused path calls the NF4 ops) imports them from here.

Not here: implementations (one folder per op) and their registration (``registry``).
"""

from __future__ import annotations

import torch

from polyrl.kernels import registry
from polyrl.kernels.attention.cudnn import capture_keeps_fast_path as _capture_keeps_fast_path
from polyrl.kernels.nf4.reference import NF4Weight
from polyrl.kernels.rope.reference import rope_cos_sin as _rope_cos_sin

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The registry's name of ``dtype`` (``bfloat16``, ...)."""
    return DTYPE_NAMES.get(dtype, str(dtype))


def _impl(op: str, t: torch.Tensor):
    return registry.select(op, t.device.type, DTYPE_NAMES.get(t.dtype, str(t.dtype)))[1]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, statistics in fp32: ``weight * (x / rms(x)).to(x.dtype)`` (HF Llama/Qwen).

    With ``residual``: ``s = x + residual`` first; returns ``(rmsnorm(s), s)``. Otherwise returns ``y``.
    """
    return _impl("rmsnorm", x)(x, weight, eps, residual)


def rope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, D]`` for rotate-half RoPE at explicit positions (Llama-3 / linear scaling by ``scaling``)."""
    return _rope_cos_sin(position_ids, head_dim, theta, scaling, dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE on q ``[T, Hq, D]`` and k ``[T, Hk, D]`` with cos/sin ``[T, D]``; returns (q, k)."""
    return _impl("rope", q)(q, k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` elementwise, ``[..., I]``."""
    return _impl("swiglu", gate)(gate, up)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """A MoE block's routed experts: x ``[T, H]``, topk_ids int ``[T, k]``, topk_weights ``[T, k]``, gate_up
    ``[E, 2I, H]`` (gate rows, then up rows), down ``[E, H, I]`` -> ``[T, H]``, each token's k expert SwiGLU MLPs
    weighted by topk_weights and summed. Spec: ``polyrl/kernels/moe/reference.py``."""
    return _impl("moe_experts", x)(x, topk_ids, topk_weights, gate_up, down)


def moe_experts_lora(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_a: torch.Tensor | None,
    gate_up_b: torch.Tensor | None,
    down_a: torch.Tensor | None,
    down_b: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``moe_experts`` with a LoRA adapter per expert on ``gate_up`` and/or ``down`` (``A [E, r, in]``, ``B [E, out,
    r]``, ``W' = W + scale * B @ A``) over a frozen base, the adapted weights never materialised by the fast path.
    Spec: ``polyrl/kernels/moe_lora/reference.py``."""
    return _impl("moe_experts_lora", x)(x, topk_ids, topk_weights, gate_up, down, gate_up_a, gate_up_b, down_a,
                                        down_b, scale)  # fmt: skip


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence. q ``[T, Hq, D]``, k/v ``[T, Hk, D]``,
    cu_seqlens int32 ``[B+1]``; ``window`` (sliding window, keys with q_pos - k_pos < window) optional.
    Returns ``[T, Hq, D]`` in q's dtype."""
    return _impl("attention", q)(q, k, v, cu_seqlens, max_seqlen, scale, window)


def capture_keeps_fast_paths():
    """Context manager for a caller that captures a CUDA graph and replays it only on inputs of the captured shapes
    after an eager warm-up on the very same input tensors (the training step, ``train/graphed_step.py``): inside,
    fast paths gated on a per-tensor host check (the uniform-length SDPA attention) keep the verdict cached for
    those tensors instead of handing over to their capturable fallback."""
    return _capture_keeps_fast_path()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over a paged KV cache that already holds them.

    q ``[T_new, Hq, D]`` (sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``),
    k_cache/v_cache ``[num_blocks, block_size, Hk, D]``, block_tables int32 ``[B, max_blocks]``,
    context_lens int32 ``[B]`` = tokens in the cache for b including the new ones. New token i of b sits
    at position ``context_lens[b] - q_len_b + i`` and attends causally. Decode is q_len_b == 1.
    """
    return _impl("paged_attention", q)(
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale, window
    )


PAGED_ATTENTION_GRAPH_HEAD_DIMS = (16, 32, 64, 128, 256)  # the Triton kernel's; others run the host-syncing reference


def paged_attention_graph_safe(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``paged_attention`` at this device/dtype/head dim can be captured in a CUDA graph: only the Triton
    kernel can (the reference reads sequence bounds on the host, which a capture forbids)."""
    try:
        name, _ = registry.select("paged_attention", device_type, DTYPE_NAMES.get(dtype, str(dtype)))
    except registry.KernelUnavailable:
        return False
    return name == "triton" and head_dim in PAGED_ATTENTION_GRAPH_HEAD_DIMS


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v ``[T, Hk, D]`` into the caches at flat slots ``slot_mapping`` int64 ``[T]``
    (slot = block * block_size + offset; negative slots are skipped)."""
    _impl("kv_cache_write", k)(k, v, k_cache, v_cache, slot_mapping)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "sum",
) -> torch.Tensor:
    """Cross-entropy of ``hidden [T, H] @ weight[V, H]^T`` against ``labels [T]`` without materialising
    ``[T, V]`` logits (chunked). fp32 result; ``reduction`` in {"sum", "mean", "none"} (ignored tokens
    contribute 0; "mean" divides by the non-ignored count). Gradients for hidden and weight."""
    return _impl("linear_cross_entropy", hidden)(hidden, weight, labels, ignore_index, reduction)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """log softmax((hidden @ weight^T) / temperature)[t, tokens[t]] as fp32 ``[T]``, chunked over vocab,
    differentiable in hidden and weight. With ``return_entropy`` returns ``(logprobs, entropy)``."""
    return _impl("token_logprobs", hidden)(hidden, weight, tokens, temperature, return_entropy)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-prob, fused: logits fp32 ``[B, V]``, temperature fp32 ``[B]``, seeds and
    offsets int64 ``[B]``, greedy bool ``[B]`` -> (tokens int64 ``[B]``, logprobs fp32 ``[B]``). Sampled rows take
    the Gumbel-max of ``z = logits / T`` with noise hashed from (seed, offset, vocab index), so a row's token
    depends on nothing else in the batch; greedy rows take ``argmax(logits)`` (T = 1). ``logprob =
    log_softmax(z)[token]``. Contract in ``polyrl/kernels/sampling/__init__.py``."""
    return _impl("sample_tokens", logits)(logits, temperature, seeds, offsets, greedy)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, inv_temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A grammar's packed token bitmask on rows of logits: logits ``[B, V]`` (any float dtype), bitmask int32
    ``[G, W]`` (bit ``v % 32`` of word ``v // 32``, LSB first; 0 forbids token v), rows int64 ``[G]`` (None: every
    row, G == B), inv_temps fp32 ``[B]`` -> (masked logits ``[B, V]`` (a new tensor, -inf where forbidden), lse fp32
    ``[G]`` of ``logits * inv_temps``, lse_masked fp32 ``[G]`` of the masked rows). Contract in
    ``polyrl/kernels/token_bitmask/__init__.py``."""
    return _impl("apply_token_bitmask", logits)(logits, bitmask, rows, inv_temps)


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]`` where ``W [N, K] = shape`` is stored as NF4: ``packed`` uint8 ``[N, Kp/2]``
    and ``absmax`` fp32 ``[N, Kp/64]`` (``Kp`` = K rounded up to 64; layout in ``kernels/nf4/reference.py``).
    Differentiable in ``x`` only (QLoRA's frozen base)."""
    return _impl("nf4_matmul", x)(x, packed, absmax, shape)


def nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
    """The dense ``[N, K] = shape`` weight of an NF4 one in ``dtype`` (fp32 code * absmax, one rounding)."""
    return registry.select("nf4_dequantize", packed.device.type, DTYPE_NAMES.get(dtype, str(dtype)))[1](
        packed, absmax, shape, dtype
    )


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | NF4Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``x W^T + b + scaling * (x A^T) B^T``: ``weight`` the frozen ``[N, K]`` base (dense, or an ``NF4Weight``:
    QLoRA), ``lora_a [r, K]``, ``lora_b [N, r]``; every dense tensor in ``x``'s dtype. Differentiable in ``x``,
    the adapter and (dense and requiring grad) the base."""
    return _impl("lora_linear", x)(x, weight, bias, lora_a, lora_b, scaling)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor | tuple[torch.Tensor, ...],
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N]`` for at most ``skinny_linear.MAX_ROWS`` rows, no autograd:
    the projections of a batch-1 decode step (weight-read bound). ``weight`` (and ``bias``) may be a tuple of up to 3:
    one launch, outputs side by side ``[M, sum N_i]`` (q/k/v, gate/up). Contract in
    ``polyrl/kernels/skinny_linear/__init__.py``."""
    return _impl("skinny_linear", x)(x, weight, bias)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope(rmsnorm(q, q_weight), rmsnorm(k, k_weight), cos, sin)`` in one pass, no autograd (Qwen3's q/k
    norms of a decode step). Contract in ``polyrl/kernels/qk_norm_rope/__init__.py``."""
    return _impl("qk_norm_rope", q)(q, k, q_weight, k_weight, cos, sin, eps)


def qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``qk_norm_rope`` with the paged step's ``write_kv_cache(k', v, ...)`` folded in; returns q'. No autograd.
    Contract in ``polyrl/kernels/qk_norm_rope/__init__.py``."""
    return _impl("qk_norm_rope_cache", q)(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slot_mapping)


def fp8_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-scaling FP8 quantisation of ``x [M, K]`` -> ``(q fp8 [M, K], scale fp32)``, ``x ~= q * scale``; scale
    ``[]`` (tensor-wise) or ``[M, 1]`` (row-wise). No autograd. Contract in ``polyrl/kernels/fp8/__init__.py``."""
    return _impl("fp8_quantize", x)(x, fp8_dtype, rowwise)


def fp8_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` for fp8 ``a [M, K]``, ``b [K, N]``, fp32 accumulation, ``out_dtype`` result;
    scales tensor-wise ``[]`` or row-wise (``[M, 1]`` and ``[1, N]``). No autograd. Contract in
    ``polyrl/kernels/fp8/__init__.py``."""
    return _impl("fp8_scaled_mm", a)(a, b, scale_a, scale_b, out_dtype, use_fast_accum)
