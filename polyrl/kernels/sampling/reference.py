"""sample_tokens reference in plain torch, and the counter-based hash RNG it draws from (the spec).

The RNG. Every sampled row b gets two 32-bit keys from its 64-bit seed and the low 32 bits of its offset
(``row_keys``); vocab entry v then gets ``x = fmix(fmix(v ^ k1) ^ k2)``, where ``fmix`` is a bijective
multiply / xor-shift finaliser on uint32 (murmur3's constants). ``x`` becomes ``w = ((x >> 1) + 1/2) / 2^31``
(fp32, clamped to ``1 - 2^-24``): strictly inside (0, 1) and the same bits in every implementation.

From ``w`` to Gumbel: ``E = -log(1 - w)`` is Exp(1), ``G = -log(E)``. The winner of a Gumbel-max has a small
``E`` (about 1/V for a flat distribution over V tokens), so ``w`` is used directly - it has 2^-31 resolution near
0 - and ``E`` for ``w < 2^-6`` comes from the series ``w + w^2/2 + ... + w^5/5`` rather than from ``1 - w``, whose
fp32 rounding (or a 2^-24 grid on ``u = 1 - w``) would shift the winning score by up to 1% at V = 151936.
The largest G is -log(w_min) = 22.2; the smallest, at the clamp, -log(16.6) = -2.8.

The torch side does uint32 arithmetic on int64 tensors holding values in [0, 2^32): xor and shifts are exact,
and ``_mul32`` splits the constant into 16-bit halves so no product overflows int64. This is slow (about
thirty passes over [B, V] int64) and meant for the CPU and for checking; the Triton kernel does the same in
registers.

Deliberately not here: top-k/top-p/min-p truncation and min_tokens masks (the sampler applies them to the
logits it passes in).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
KEY_C1 = 0x9E3779B9  # separate the two row keys' derivations
KEY_C2 = 0x7F4A7C15
W_SCALE = 2.0**-31  # w = ((x >> 1) + 0.5) * 2^-31
W_MAX = 1.0 - 2.0**-24  # the largest fp32 below 1
SERIES_BELOW = 2.0**-6  # E = -log1p(-w) by its series below this w (relative error < w^5 / 6 < 2e-10)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32). The int64 product may pass 2^63: torch's integer
    multiply wraps (two's complement), which leaves the low 32 bits exact (the bit-exactness test against Python
    integers guards this)."""
    return (x * c) & M32


def fmix(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit mix on int64 tensors holding uint32 values (in place on its own temporaries: a few passes
    over [B, V], the CPU's cost of sampling)."""
    x = x ^ (x >> 16)
    x.mul_(FMIX_C1).bitwise_and_(M32)
    x ^= x >> 13
    x.mul_(FMIX_C2).bitwise_and_(M32)
    x ^= x >> 16
    return x


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k1, k2) int64 [B] in [0, 2^32) from seeds int64 [B] (all 64 bits) and offsets int64 [B] (low 32 bits)."""
    s = seeds.to(torch.int64)
    s_lo, s_hi, o = s & M32, (s >> 32) & M32, offsets.to(torch.int64) & M32
    k1 = fmix(fmix(fmix(s_lo ^ KEY_C1) ^ s_hi) ^ o)
    k2 = fmix(fmix(fmix(o ^ KEY_C2) ^ s_lo) ^ s_hi)
    return k1, k2


def hash_bits(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The raw 32-bit hash, int64 [B, V] in [0, 2^32)."""
    k1, k2 = row_keys(seeds, offsets)
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    return fmix(fmix(v ^ k1[:, None]) ^ k2[:, None])


def hash_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms ``w`` fp32 [B, V] strictly inside (0, 1), a pure function of (seed_b, offset_b, v)."""
    half = (hash_bits(seeds, offsets, vocab) >> 1).to(torch.float32)  # < 2^31, rounded to nearest even
    return half.add_(0.5).mul_(W_SCALE).clamp_(max=W_MAX)


def exponential_from_uniform(w: torch.Tensor) -> torch.Tensor:
    """``E = -log(1 - w)`` (Exp(1) for uniform w), accurate for small w where the Gumbel-max winner lives."""
    e = torch.log(1.0 - w).neg_()
    small = w < SERIES_BELOW  # a few percent of the entries: the series only there (same values as everywhere)
    ws = w[small]
    series = ws * (1.0 / 5)
    series.add_(1.0 / 4).mul_(ws).add_(1.0 / 3).mul_(ws).add_(1.0 / 2).mul_(ws).add_(1.0).mul_(ws)
    e[small] = series
    return e


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise fp32 [B, V]: ``argmax(z + gumbel_noise(...))`` is a draw from ``softmax(z)``."""
    return exponential_from_uniform(hash_uniform(seeds, offsets, vocab)).log_().neg_()


def inverse_temperature(temperature: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """fp32 [B]: ``1 / T`` on sampled rows, 1 on greedy rows."""
    t = temperature.to(torch.float32)
    return torch.where(greedy, torch.ones_like(t), 1.0 / torch.where(greedy, torch.ones_like(t), t))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs fp32 [B]); see ``polyrl.kernels.sampling`` for the contract."""
    greedy = greedy.to(torch.bool)
    z = logits.float() * inverse_temperature(temperature, greedy)[:, None]  # [B, V]
    tokens = z.argmax(dim=-1)  # greedy rows; first maximal index on ties
    sampled = (~greedy).nonzero().squeeze(-1)
    if sampled.numel():  # noise only for the rows that draw (greedy evaluation pays nothing)
        noise = gumbel_noise(seeds[sampled], offsets[sampled], z.shape[-1])
        tokens = tokens.index_copy(0, sampled, (z[sampled] + noise).argmax(dim=-1))
    logprobs = z.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(z, dim=-1)
    return tokens, logprobs
