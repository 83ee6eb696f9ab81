"""Per-row (per-token) e4m3 quantisation of an activation in one Triton launch: ``fp8_weights.quantize_rows``'s
arithmetic (fp32 amax, ``max(amax, 1e-12) / 448`` by correctly rounded division, ``x / s`` correctly rounded,
clamped to +-448, rounded to nearest e4m3), so its output equals the reference's bit for bit.

One program per row, two passes over the row (amax, then quantise; the second pass reads the row from L2). A decode
step's activation is ``[batch, hidden]``: the eager PyTorch version is six launches per projection group, this is one.
Deliberately not here: the weights (quantised once per weight version, by the PyTorch reference), column scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, n_cols, stride_x, FLOOR: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, n_cols, BLOCK):
        v = tl.load(x_row + c + offs, mask=c + offs < n_cols, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(v))
    amax = tl.max(acc, axis=0)
    scale = tl.math.div_rn(tl.maximum(amax, FLOOR), QMAX)
    tl.store(s_ptr + row, scale)
    q_row = q_ptr + row * n_cols
    for c in range(0, n_cols, BLOCK):
        mask = c + offs < n_cols
        v = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -QMAX), QMAX)
        tl.store(q_row + c + offs, y.to(tl.float8e4nv), mask=mask)


def quantize_rows_triton(x: torch.Tensor, qmax: float, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float) -> (e4m3 ``[M, K]`` contiguous, fp32 scales ``[M]``), equal to ``quantize_rows(x)`` for
    its ``qmax`` (448) and amax ``floor`` (1e-12), which the caller passes (``fp8_weights`` owns them)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(_BLOCK, triton.next_power_of_2(k))
        _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), FLOOR=floor, QMAX=qmax, BLOCK=block, num_warps=4)
    return q, s
