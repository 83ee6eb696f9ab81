"""sample_tokens in Triton: one program per row reads the row's logits once, in vocab blocks, keeping an online
max / sum-exp (for logsumexp(z)) and the best score and its index (for the Gumbel-max or greedy argmax).

The hash RNG is the reference's (``reference.py``) in uint32 registers, so both give the same noise bits. After
the loop the chosen token's logit is read once more (one scalar load) for ``z[token] - logsumexp(z)``.
Ties keep the lowest index: a block's candidate is the smallest column holding the block maximum, and a later
block replaces the running best only when strictly greater.

Small batches split each row over several programs (``num_splits``: about 8 programs per multiprocessor in all):
each writes its columns' partial (max, sum-exp, best score, lowest best column) and one program per row combines
them, so batch 1 does not leave the device to a single program walking 151936 columns (140 us -> a few us on the
H200). Logits may be bf16 or fp16: they are read and computed in fp32, so the decode graph can hand over the LM
head's bf16 output instead of an fp32 copy.

Not here: truncation (top-k/top-p/min-p).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.sampling import reference as _ref
from polyrl.kernels.sampling.reference import inverse_temperature
from polyrl.platform import device as platform_device

MAX_BLOCK_V = 4096
# The reference's constants, as constexprs (jit functions may only read constexpr globals).
FMIX_C1 = tl.constexpr(_ref.FMIX_C1)
FMIX_C2 = tl.constexpr(_ref.FMIX_C2)
KEY_C1 = tl.constexpr(_ref.KEY_C1)
KEY_C2 = tl.constexpr(_ref.KEY_C2)
W_SCALE = tl.constexpr(_ref.W_SCALE)
W_MAX = tl.constexpr(_ref.W_MAX)
SERIES_BELOW = tl.constexpr(_ref.SERIES_BELOW)


def block_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``vocab`` logits."""
    block = min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))
    return block, (8 if block >= 2048 else 4)


@triton.jit
def _fmix(x):
    # x: uint32. Wrapping multiply and logical shifts, as in reference.fmix.
    x = x ^ (x >> 16)
    x = x * FMIX_C1
    x = x ^ (x >> 13)
    x = x * FMIX_C2
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seeds_ptr, offsets_ptr, row):
    seed = tl.load(seeds_ptr + row)
    s_lo = seed.to(tl.uint32)
    s_hi = (seed >> 32).to(tl.uint32)
    o = tl.load(offsets_ptr + row).to(tl.uint32)
    k1 = _fmix(_fmix(_fmix(s_lo ^ KEY_C1) ^ s_hi) ^ o)
    k2 = _fmix(_fmix(_fmix(o ^ KEY_C2) ^ s_lo) ^ s_hi)
    return k1, k2


@triton.jit
def _scan(base, inv_t, is_greedy, k1, k2, lo, hi, BLOCK_V: tl.constexpr):
    """Columns [lo, hi) of one row: (max of z, sum exp(z - max), best score, its lowest column)."""
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)  # running max of z
    d = tl.zeros((), tl.float32)  # sum exp(z - m)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int32)
    for start in range(lo, hi, BLOCK_V):
        cols = start + offs
        mask = cols < hi
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        # Shift by 0 while everything so far is -inf (masked lanes, suppressed ids): exp(-inf) = 0, no NaN.
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
        m = m_new

        if is_greedy:  # a uniform branch per program: a greedy row never pays for the noise (hash, two logs)
            score = z
        else:
            x = _fmix(_fmix(cols.to(tl.uint32) ^ k1) ^ k2)
            w = tl.minimum(((x >> 1).to(tl.int32).to(tl.float32) + 0.5) * W_SCALE, W_MAX)
            series = w * (1.0 + w * (1.0 / 2 + w * (1.0 / 3 + w * (1.0 / 4 + w * (1.0 / 5)))))
            gumbel = -tl.log(tl.where(w < SERIES_BELOW, series, -tl.log(1.0 - w)))
            score = z + gumbel
        blk = tl.max(score, 0)
        blk_idx = tl.min(tl.where((score == blk) & mask, cols, hi), 0)
        take = blk > best
        best = tl.where(take, blk, best)
        best_idx = tl.where(take, blk_idx, best_idx)
    return m, d, best, best_idx


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride,
    inv_temp_ptr,
    seeds_ptr,
    offsets_ptr,
    greedy_ptr,
    tokens_ptr,
    logprobs_ptr,
    V,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    inv_t = tl.load(inv_temp_ptr + row)
    is_greedy = tl.load(greedy_ptr + row) != 0
    k1, k2 = _row_keys(seeds_ptr, offsets_ptr, row)
    m, d, best, best_idx = _scan(base, inv_t, is_greedy, k1, k2, 0, V, BLOCK_V)
    tok = best_idx.to(tl.int64)
    z_tok = tl.load(base + tok).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, tok)
    tl.store(logprobs_ptr + row, z_tok - (m + tl.log(d)))


@triton.jit
def _sample_split_kernel(
    logits_ptr,
    stride,
    inv_temp_ptr,
    seeds_ptr,
    offsets_ptr,
    greedy_ptr,
    part_f_ptr,
    part_i_ptr,
    V,
    per_split,
    SPLITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (row, split) scans columns [split * per_split, ...) and writes its partial (m, d, best) and index."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = logits_ptr + row * stride
    inv_t = tl.load(inv_temp_ptr + row)
    is_greedy = tl.load(greedy_ptr + row) != 0
    k1, k2 = _row_keys(seeds_ptr, offsets_ptr, row)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, V)
    m, d, best, best_idx = _scan(base, inv_t, is_greedy, k1, k2, lo, hi, BLOCK_V)
    at = row * SPLITS + split
    tl.store(part_f_ptr + at * 3, m)
    tl.store(part_f_ptr + at * 3 + 1, d)
    tl.store(part_f_ptr + at * 3 + 2, best)
    tl.store(part_i_ptr + at, best_idx)


@triton.jit
def _sample_combine_kernel(
    logits_ptr,
    stride,
    inv_temp_ptr,
    part_f_ptr,
    part_i_ptr,
    tokens_ptr,
    logprobs_ptr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """One program per row: logsumexp over the splits' (m, d); the best score, ties to the lowest column (each
    split already holds its lowest, and the splits cover ascending column ranges)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_P2)
    ok = s < SPLITS
    at = row * SPLITS + s
    m = tl.load(part_f_ptr + at * 3, mask=ok, other=float("-inf"))
    d = tl.load(part_f_ptr + at * 3 + 1, mask=ok, other=0.0)
    best = tl.load(part_f_ptr + at * 3 + 2, mask=ok, other=float("-inf"))
    idx = tl.load(part_i_ptr + at, mask=ok, other=0)
    m_all = tl.max(m, 0)
    shift = tl.where(m_all > float("-inf"), m_all, 0.0)
    d_all = tl.sum(d * tl.exp(m - shift), 0)
    top = tl.max(best, 0)
    # The first split holding the top score (an all -inf row: split 0, whose index is column 0).
    first = tl.min(tl.where((best == top) & ok, s, SPLITS), 0)
    tok = tl.sum(tl.where(s == first, idx, 0), 0).to(tl.int64)
    base = logits_ptr + row * stride
    inv_t = tl.load(inv_temp_ptr + row)
    z_tok = tl.load(base + tok).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, tok)
    tl.store(logprobs_ptr + row, z_tok - (shift + tl.log(d_all)))


def num_splits(rows: int, blocks: int, multiprocessors: int) -> int:
    """Programs per row: enough (rows x splits ~ 8 per multiprocessor) that a small batch does not leave the device
    idle while one program walks a 151936-wide row; at most one block per split, 1 for large batches."""
    want = -(-8 * multiprocessors // max(rows, 1))
    return max(1, min(blocks, want, 64))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    greedy: torch.Tensor,
    block_v: int | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs fp32 [B]); see ``polyrl.kernels.sampling``. ``logits`` fp32, bf16 or fp16 (read
    and computed in fp32: bf16 logits give exactly what their fp32 upcast gives). ``block_v`` overrides the block,
    ``splits`` the programs per row (default ``num_splits``)."""
    if logits.dim() != 2:
        raise ValueError(f"expected logits [B, V], got shape {tuple(logits.shape)}")
    B, V = logits.shape
    for name, t in (("temperature", temperature), ("seeds", seeds), ("offsets", offsets), ("greedy", greedy)):
        if t.shape != (B,):
            raise ValueError(f"expected {name} [{B}], got shape {tuple(t.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    greedy = greedy.to(torch.bool)
    inv_temp = inverse_temperature(temperature, greedy).contiguous()
    tokens = torch.empty(B, device=logits.device, dtype=torch.int64)
    logprobs = torch.empty(B, device=logits.device, dtype=torch.float32)
    if B == 0:
        return tokens, logprobs
    block, warps = block_config(V)
    if block_v is not None:
        block = block_v
    blocks = -(-V // block)
    if splits is None:
        splits = num_splits(B, blocks, platform_device.multiprocessors(logits.device))
    splits = max(1, min(splits, blocks))
    rows = (inv_temp, seeds.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous(),
            greedy.to(torch.int8).contiguous())  # fmt: skip
    if splits == 1:
        _sample_kernel[(B,)](logits, logits.stride(0), *rows, tokens, logprobs, V, BLOCK_V=block, num_warps=warps)
        return tokens, logprobs
    per_split = -(-blocks // splits) * block  # whole blocks per split
    splits = -(-V // per_split)
    part_f = torch.empty((B, splits, 3), device=logits.device, dtype=torch.float32)
    part_i = torch.empty((B, splits), device=logits.device, dtype=torch.int32)
    _sample_split_kernel[(B, splits)](
        logits, logits.stride(0), *rows, part_f, part_i, V, per_split, SPLITS=splits, BLOCK_V=block, num_warps=warps
    )
    _sample_combine_kernel[(B,)](
        logits, logits.stride(0), inv_temp, part_f, part_i, tokens, logprobs, SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), num_warps=1,
    )  # fmt: skip
    return tokens, logprobs
