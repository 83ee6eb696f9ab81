"""Per-row (per-token) e4m3 quantisation of an activation in one Triton launch: ``fp8_weights.quantize_rows``'s
arithmetic (fp32 amax, ``max(amax, 1e-12) / 448`` by correctly rounded division, ``x / s`` correctly rounded,
clamped to +-448, rounded to nearest e4m3), so its output equals the reference's bit for bit.

One program per row. A row of at most ``_ONE_PASS_MAX`` columns (every hidden and intermediate size of the presets) is
loaded once into registers, its amax taken and the same registers quantised; a longer row takes two passes (amax, then
quantise; the second pass reads the row from L2). The rollout profile of qwen3-8b at B256 (2026-12-03, tenth session)
showed the two-pass loop at ~5.9 us a call, 144 calls a decode step (0.85 ms of an 11.6 ms FP8 step). A decode
step's activation is ``[batch, hidden]``: the eager PyTorch version is six launches per projection group, this is one.
Deliberately not here: the weights (quantised once per weight version, by the PyTorch reference), column scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_ONE_PASS_MAX = 16384  # columns held in registers at once (16 warps: 32 fp32 values a thread)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_cols,
    stride_x,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * n_cols
    if ONE_PASS:  # BLOCK >= n_cols: the row stays in registers between the amax and the quantisation
        mask = offs < n_cols
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), FLOOR), QMAX)
        tl.store(s_ptr + row, scale)
        y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -QMAX), QMAX)
        tl.store(q_row + offs, y.to(tl.float8e4nv), mask=mask)
        return
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, n_cols, BLOCK):
        v = tl.load(x_row + c + offs, mask=c + offs < n_cols, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(v))
    amax = tl.max(acc, axis=0)
    scale = tl.math.div_rn(tl.maximum(amax, FLOOR), QMAX)
    tl.store(s_ptr + row, scale)
    for c in range(0, n_cols, BLOCK):
        mask = c + offs < n_cols
        v = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -QMAX), QMAX)
        tl.store(q_row + c + offs, y.to(tl.float8e4nv), mask=mask)


def quantize_rows_triton(
    x: torch.Tensor, qmax: float, floor: float, out: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float) -> (e4m3 ``[M, K]`` contiguous, fp32 scales ``[M]``), equal to ``quantize_rows(x)`` for
    its ``qmax`` (448) and amax ``floor`` (1e-12), which the caller passes (``fp8_weights`` owns them). ``out`` /
    ``scales``: contiguous tensors of those shapes to write into (a weight's FP8 copy requantised in place)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device) if out is None else out
    s = torch.empty(m, dtype=torch.float32, device=x.device) if scales is None else scales
    if q.shape != (m, k) or q.dtype != torch.float8_e4m3fn or not q.is_contiguous() or s.shape != (m,):
        raise ValueError(f"quantize_rows_triton: out must be a contiguous e4m3 {(m, k)} and scales fp32 [{m}]")
    if m:
        one_pass = k <= _ONE_PASS_MAX
        block = triton.next_power_of_2(k) if one_pass else _BLOCK
        warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _quant_rows_kernel[(m,)](
            x, q, s, k, x.stride(0), FLOOR=floor, QMAX=qmax, BLOCK=block, ONE_PASS=one_pass, num_warps=warps
        )
    return q, s
