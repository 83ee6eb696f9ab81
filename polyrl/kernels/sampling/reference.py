"""sample_tokens reference in plain torch, and the counter-based hash RNG it draws from (the spec).

The RNG. Every sampled row b gets two 32-bit keys from its 64-bit seed and the low 32 bits of its offset
(``row_keys``); vocab entry v then gets ``x = fmix(fmix(v ^ k1) ^ k2)``, where ``fmix`` is a bijective
multiply / xor-shift finaliser on uint32 (murmur3's constants). ``x`` becomes a uniform on the grid
``(2j + 1) / 2^24`` (j = x >> 9, 23 bits): exactly representable in fp32, strictly inside (0, 1), the same bits
in every implementation. So keys give 64 bits of stream, ``u`` 23 bits of resolution (the Gumbel tail is cut at
-log(-log(1 - 2^-24)) = 16.6, a 6e-8 probability mass: no measurable bias).

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
U_SCALE = 2.0**-24  # u = (2j + 1) * 2^-24 with j < 2^23


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def fmix(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit mix on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_C2)
    return x ^ (x >> 16)


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
    """Uniforms fp32 [B, V] strictly inside (0, 1), a pure function of (seed_b, offset_b, v)."""
    j = hash_bits(seeds, offsets, vocab) >> 9
    return (j * 2 + 1).to(torch.float32) * U_SCALE


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise fp32 [B, V]: ``argmax(z + gumbel_noise(...))`` is a draw from ``softmax(z)``."""
    return -torch.log(-torch.log(hash_uniform(seeds, offsets, vocab)))


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
    score = torch.where(greedy[:, None], z, z + gumbel_noise(seeds, offsets, z.shape[-1]))
    tokens = score.argmax(dim=-1)  # first maximal index on ties
    logprobs = z.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(z, dim=-1)
    return tokens, logprobs
