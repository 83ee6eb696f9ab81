"""apply_token_bitmask in Triton: program (j, s) reads block s of guided row ``rows[j]`` once, tests each column's
bit in the packed words, writes the masked block and that block's online (max, sum-exp) of z and of masked z; one
program per row then combines the blocks into the two logsumexps. One read and one write of each guided row (plus a
128th of it in mask words) where the torch reference makes about ten passes over ``[G, V]``.

Rows not guided (``rows`` given, G < B) are copied unchanged (the output starts as a clone of ``logits``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _mask_blocks_kernel(
    logits_ptr,
    out_ptr,
    stride,
    out_stride,
    mask_ptr,
    words,
    rows_ptr,
    inv_temp_ptr,
    part_ptr,
    V,
    NBLOCKS,
    HAS_ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if HAS_ROWS:
        r = tl.load(rows_ptr + j)
    else:
        r = j
    inv_t = tl.load(inv_temp_ptr + r)
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < V
    x = tl.load(logits_ptr + r * stride + cols, mask=inside, other=float("-inf"))
    word = tl.load(mask_ptr + j * words + cols // 32, mask=inside, other=0)
    keep = ((word >> (cols % 32)) & 1) != 0
    xm = tl.where(keep, x, float("-inf"))
    tl.store(out_ptr + r * out_stride + cols, xm, mask=inside)

    z = x.to(tl.float32) * inv_t
    zm = tl.where(keep, z, float("-inf"))
    m = tl.max(z, 0)
    m_shift = tl.where(m > float("-inf"), m, 0.0)
    d = tl.sum(tl.exp(z - m_shift), 0)
    mm = tl.max(zm, 0)
    mm_shift = tl.where(mm > float("-inf"), mm, 0.0)
    dm = tl.sum(tl.exp(zm - mm_shift), 0)
    at = (j * NBLOCKS + blk) * 4
    tl.store(part_ptr + at, m)
    tl.store(part_ptr + at + 1, d)
    tl.store(part_ptr + at + 2, mm)
    tl.store(part_ptr + at + 3, dm)


@triton.jit
def _combine(m, d):
    top = tl.max(m, 0)
    shift = tl.where(top > float("-inf"), top, 0.0)
    return shift + tl.log(tl.sum(d * tl.exp(m - shift), 0))


@triton.jit
def _lse_kernel(part_ptr, lse_ptr, lse_masked_ptr, NBLOCKS, NB_P2: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB_P2)
    ok = b < NBLOCKS
    at = (j * NBLOCKS + b) * 4
    m = tl.load(part_ptr + at, mask=ok, other=float("-inf"))
    d = tl.load(part_ptr + at + 1, mask=ok, other=0.0)
    mm = tl.load(part_ptr + at + 2, mask=ok, other=float("-inf"))
    dm = tl.load(part_ptr + at + 3, mask=ok, other=0.0)
    tl.store(lse_ptr + j, _combine(m, d))
    tl.store(lse_masked_ptr + j, _combine(mm, dm))


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, inv_temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(masked logits, lse, lse_masked); see ``polyrl.kernels.token_bitmask``."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(
            f"expected logits [B, V] and bitmask [G, W], got {tuple(logits.shape)}, {tuple(bitmask.shape)}"
        )
    B, V = logits.shape
    G, W = bitmask.shape
    if 32 * W < V:
        raise ValueError(f"a bitmask of {W} words covers fewer than {V} tokens")
    if (rows is None and G != B) or (rows is not None and rows.shape != (G,)):
        raise ValueError(f"expected rows [{G}] (or None with G == B = {B}), got {None if rows is None else rows.shape}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    bitmask = bitmask.contiguous()
    out = torch.empty_like(logits) if rows is None else logits.clone()
    lse = torch.empty(G, device=logits.device, dtype=torch.float32)
    lse_masked = torch.empty(G, device=logits.device, dtype=torch.float32)
    if G == 0:
        return out, lse, lse_masked
    nblocks = triton.cdiv(V, BLOCK_V)
    part = torch.empty((G, nblocks, 4), device=logits.device, dtype=torch.float32)
    rows_arg = rows.to(torch.int64).contiguous() if rows is not None else lse  # unused pointer without rows
    inv = inv_temps.to(torch.float32).contiguous()
    _mask_blocks_kernel[(G, nblocks)](
        logits, out, logits.stride(0), out.stride(0), bitmask, W, rows_arg, inv, part, V, nblocks,
        HAS_ROWS=rows is not None, BLOCK_V=BLOCK_V, num_warps=8,
    )  # fmt: skip
    _lse_kernel[(G,)](part, lse, lse_masked, nblocks, NB_P2=triton.next_power_of_2(nblocks), num_warps=4)
    return out, lse, lse_masked
