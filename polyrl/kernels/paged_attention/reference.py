"""Paged attention reference: gather each sequence's keys/values through its block table, then attend.

Also the reference KV-cache write. Plain PyTorch; the spec for the Triton decode/prefill kernels.

FP8 caches (``float8_e4m3fn``, ``RolloutConfig.kv_cache_dtype = "fp8_e4m3"``): a static unit scale, so a write
quantises ``clamp(x, -448, 448)`` rounded to nearest even (saturating: e4m3fn has no infinity, an unclamped overflow
would be NaN) and a read dequantises by a plain cast (``x.to(q.dtype)``, explicit here, in registers in Triton). Why
static and unit: ``polyrl/infer/kv_cache.py``. No calibrated scales.
"""

from __future__ import annotations

import torch

from polyrl.kernels.attention.reference import attend

FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in a cache's dtype: for FP8, saturated to +-448 (static unit scale) and rounded to nearest even."""
    if is_fp8(dtype):
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store k/v [T, Hk, D] at flat slots (block * block_size + offset); negative slots are skipped.

    No boolean indexing and no host sync, so it can be captured in a CUDA graph: skipped rows are
    redirected to slot 0 carrying the value slot 0 must end with (the new token aimed at it, if any,
    else its current content), so every write to a slot carries the same value.
    """
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.long()
    keep = slots >= 0
    index = torch.where(keep, slots, torch.zeros_like(slots))
    hits0 = keep & (slots == 0)
    # Index of a token written to slot 0 (0 if none), kept as a [1] tensor: indexing with a 0-dim tensor
    # would read it on the host (`values[t]` calls `t.item()`), which a CUDA graph capture forbids.
    first0 = torch.argmax(hits0.to(torch.int32)).reshape(1)
    for src, cache in ((k, k_cache), (v, v_cache)):
        values = quantize_kv(src, cache.dtype)
        if is_fp8(cache.dtype):  # index_copy_ / where have no float8 kernels on the CPU: move the bytes as uint8
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, Hk, D], a view: writes land in cache
        slot0 = torch.where(hits0.any(), values.index_select(0, first0)[0], flat[0])
        values = torch.where(keep[:, None, None], values, slot0)
        flat.index_copy_(0, index, values)


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, block_size, Hk, D] + block ids -> the first ``length`` tokens [length, Hk, D]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale=None, window=None
):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e == s:
            continue
        k = gather_sequence(k_cache, block_tables[b], lens[b])
        v = gather_sequence(v_cache, block_tables[b], lens[b])
        out[s:e] = attend(q[s:e], k.to(q.dtype), v.to(q.dtype), scale, window)
    return out
