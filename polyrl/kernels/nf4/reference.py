"""NF4 (4-bit NormalFloat, QLoRA) weights: quantize, dequantize, and the reference ``nf4_matmul``.

Format (ours; nothing reads it but polyrl): a weight ``[N, K]`` is padded with zeros to ``Kp = ceil(K / 64) * 64``
columns and cut into blocks of 64 consecutive elements of a row. Each block stores its absmax (fp32,
``absmax [N, Kp / 64]``) and 64 4-bit indices into ``NF4_CODE`` (the value nearest to ``w / absmax``), packed two per
byte: byte ``j`` (0..31) of a block holds element ``j`` in its low nibble and element ``j + 32`` in its high nibble
(``packed`` uint8 ``[N, Kp / 2]``), so a kernel unpacks a block into two contiguous halves without shuffling.

``NF4_CODE`` is the standard table of the QLoRA paper: quantiles of N(0, 1), 8 positive levels at
``ndtri(linspace(0.9677083, 0.5, 9))[:-1]``, 7 negative at ``-ndtri(linspace(0.9677083, 0.5, 8))[:-1]``, and an
exact 0, normalised to [-1, 1] (``tests/kernels/test_nf4.py`` recomputes it from that definition). The error of one
element is at most half the widest gap between neighbours (0.1519) times its block's absmax.

Not here: double quantization of the absmax values (not implemented), the fused kernel (``triton.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

BLOCK = 64
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def code_tensor(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@torch.no_grad()
def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (any float dtype) -> ``(packed uint8 [N, Kp/2], absmax fp32 [N, Kp/64])`` (see the docstring).
    Works row chunk by row chunk, so the fp32 temporaries stay small for large weights."""
    n, k = w.shape
    kp = -(-k // BLOCK) * BLOCK
    code = code_tensor(w.device)
    mids = (code[1:] + code[:-1]) / 2  # [15] decision boundaries
    packed = torch.empty(n, kp // 2, dtype=torch.uint8, device=w.device)
    absmax = torch.empty(n, kp // BLOCK, dtype=torch.float32, device=w.device)
    rows = max(1, (1 << 24) // kp)
    for s in range(0, n, rows):
        blk = F.pad(w[s : s + rows].float(), (0, kp - k)).view(-1, kp // BLOCK, BLOCK)  # [n', nb, 64]
        amax = blk.abs().amax(-1)  # [n', nb]
        scaled = blk / torch.where(amax > 0, amax, torch.ones_like(amax))[..., None]
        idx = torch.bucketize(scaled, mids).to(torch.uint8)  # nearest code value (ties go up)
        packed[s : s + rows] = (idx[..., :32] | (idx[..., 32:] << 4)).reshape(-1, kp // 2)
        absmax[s : s + rows] = amax
    return packed, absmax


class NF4Weight(NamedTuple):
    """A frozen ``[N, K] = shape`` weight stored as NF4 (``packed`` uint8, ``absmax`` fp32): what QLoRA's base
    passes to ``kernels.lora_linear`` in place of a dense weight."""

    packed: torch.Tensor
    absmax: torch.Tensor
    shape: tuple[int, int]


def dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The dense weight ``[N, K]`` in ``dtype`` (values computed in fp32, one rounding)."""
    n, k = shape
    nb = absmax.shape[-1]
    b = packed.view(n, nb, BLOCK // 2)
    idx = torch.cat([b & 15, b >> 4], dim=-1).long()  # [N, nb, 64]
    w = code_tensor(packed.device)[idx] * absmax.view(n, nb, 1)
    return w.view(n, nb * BLOCK)[:, :k].to(dtype)


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]`` with ``W`` the dequantized ``[N, K]`` weight in ``x``'s dtype
    (differentiable in ``x``; the weight is a constant)."""
    return F.linear(x, dequantize_nf4(packed, absmax, shape, x.dtype))
