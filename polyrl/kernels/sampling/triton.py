"""sample_tokens in Triton: one program per row reads the row's logits once, in vocab blocks, keeping an online
max / sum-exp (for logsumexp(z)) and the best score and its index (for the Gumbel-max or greedy argmax).

The hash RNG is the reference's (``reference.py``) in uint32 registers, so both give the same noise bits. After
the loop the chosen token's logit is read once more (one scalar load) for ``z[token] - logsumexp(z)``.
Ties keep the lowest index: a block's candidate is the smallest column holding the block maximum, and a later
block replaces the running best only when strictly greater.

Not here: truncation (top-k/top-p/min-p) and splitting one row over several programs (at small B the grid has
B programs only; rollout batches are large).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.sampling import reference as _ref
from polyrl.kernels.sampling.reference import inverse_temperature

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
    seed = tl.load(seeds_ptr + row)
    s_lo = seed.to(tl.uint32)
    s_hi = (seed >> 32).to(tl.uint32)
    o = tl.load(offsets_ptr + row).to(tl.uint32)
    k1 = _fmix(_fmix(_fmix(s_lo ^ KEY_C1) ^ s_hi) ^ o)
    k2 = _fmix(_fmix(_fmix(o ^ KEY_C2) ^ s_lo) ^ s_hi)

    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)  # running max of z
    d = tl.zeros((), tl.float32)  # sum exp(z - m)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        # Shift by 0 while everything so far is -inf (masked lanes, suppressed ids): exp(-inf) = 0, no NaN.
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
        m = m_new

        x = _fmix(_fmix(cols.to(tl.uint32) ^ k1) ^ k2)
        w = tl.minimum(((x >> 1).to(tl.int32).to(tl.float32) + 0.5) * W_SCALE, W_MAX)
        series = w * (1.0 + w * (1.0 / 2 + w * (1.0 / 3 + w * (1.0 / 4 + w * (1.0 / 5)))))
        gumbel = -tl.log(tl.where(w < SERIES_BELOW, series, -tl.log(1.0 - w)))
        score = tl.where(is_greedy, z, z + gumbel)
        blk = tl.max(score, 0)
        blk_idx = tl.min(tl.where((score == blk) & mask, cols, V), 0)
        take = blk > best
        best = tl.where(take, blk, best)
        best_idx = tl.where(take, blk_idx, best_idx)

    tok = best_idx.to(tl.int64)
    z_tok = tl.load(base + tok).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, tok)
    tl.store(logprobs_ptr + row, z_tok - (m + tl.log(d)))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    greedy: torch.Tensor,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs fp32 [B]); see ``polyrl.kernels.sampling``. ``block_v`` overrides the block."""
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
    _sample_kernel[(B,)](
        logits,
        logits.stride(0),
        inv_temp,
        seeds.to(torch.int64).contiguous(),
        offsets.to(torch.int64).contiguous(),
        greedy.to(torch.int8).contiguous(),
        tokens,
        logprobs,
        V,
        BLOCK_V=block,
        num_warps=warps,
    )
    return tokens, logprobs
