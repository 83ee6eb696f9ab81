"""Paged attention reference: gather each sequence's keys/values through its block table, then attend.

Also the reference KV-cache write. Plain PyTorch; the spec for the Triton decode/prefill kernels.
"""

from __future__ import annotations

import torch

from polyrl.kernels.attention.reference import attend


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
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, Hk, D], a view: writes land in cache
        values = src.to(cache.dtype)
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
