"""Paged attention reference: gather each sequence's keys/values through its block table, then attend.

Also the reference KV-cache write. Plain PyTorch; the spec for the Triton decode/prefill kernels.
"""

from __future__ import annotations

import torch

from polyrl.kernels.attention.reference import attend


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


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
