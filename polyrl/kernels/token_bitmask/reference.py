"""apply_token_bitmask in plain torch (the spec; the CPU's implementation).

The bits are unpacked byte-wise: the int32 words viewed as little-endian bytes, so token ``v`` is bit ``v % 8`` of
byte ``v // 8`` (the same bit as bit ``v % 32`` of word ``v // 32``), and the expansion is ``[G, 4W, 8]`` uint8
rather than ``[G, W, 32]`` int32: a quarter of the memory traffic, which is the CPU's cost of a guided step.
"""

from __future__ import annotations

import sys

import torch

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(dev: torch.device) -> torch.Tensor:
    bits = _BYTE_BITS.get(dev)
    if bits is None:
        bits = _BYTE_BITS[dev] = (torch.ones(8, dtype=torch.int32) << torch.arange(8)).to(torch.uint8).to(dev)
    return bits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[G, vocab]``: which tokens each row of ``bitmask`` (int32 ``[G, W]``, LSB first) allows."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        words = bitmask.to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(32, device=bitmask.device, dtype=torch.int64)
        return ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    if 8 * bitmask.shape[1] * 4 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers fewer than {vocab} tokens")
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [G, 4W]
    bits = (as_bytes.unsqueeze(-1) & _byte_bits(bitmask.device)).bool()  # [G, 4W, 8]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab]


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, inv_temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(masked logits, lse, lse_masked); see ``polyrl.kernels.token_bitmask``."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    src = logits if rows is None else logits.index_select(0, rows)
    inv = (inv_temps if rows is None else inv_temps.index_select(0, rows)).float()[:, None]
    masked_rows = src.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(src.float() * inv, dim=-1)
    lse_masked = torch.logsumexp(masked_rows.float() * inv, dim=-1)
    masked = masked_rows if rows is None else logits.index_copy(0, rows, masked_rows)
    return masked, lse, lse_masked
