"""Per-row (per-token) e4m3 quantisation of an activation in one Triton launch: ``fp8_weights.quantize_rows``'s
arithmetic (fp32 amax, ``max(amax, 1e-12) / 448`` by correctly rounded division, ``x / s`` correctly rounded,
clamped to +-448, rounded to nearest e4m3), so its output equals the reference's bit for bit.

One program per row. A row of at most ``_ONE_PASS_MAX`` columns (every hidden and intermediate size of the presets) is
loaded once into registers, its amax taken and the same registers quantised; a longer row takes two passes (amax, then
quantise; the second pass reads the row from L2). The rollout profile of qwen3-8b at B256 (2026-12-03, tenth session)
showed the two-pass loop at ~5.9 us a call, 144 calls a decode step (0.85 ms of an 11.6 ms FP8 step). A decode
step's activation is ``[batch, hidden]``: the eager PyTorch version is six launches per projection group, this is one.
Two fused variants take the quantiser into the kernel that makes the activation, so the decode step launches it for
none but the o projection's input (``Fp8Weights.norm`` / ``Fp8Weights.activation``): ``rmsnorm_quant_triton`` (the
RMSNorm before q/k/v and before gate/up, residual add included) and ``swiglu_quant_triton`` (the down projection's
input). Each computes its output exactly as ``kernels.rmsnorm`` / ``kernels.swiglu`` do (same fp32 arithmetic, same
single rounding to the model's dtype), stores it, and quantises those rounded values from the same registers: the
e4m3 rows and scales equal what ``quantize_rows_triton`` makes of the stored output, bit for bit.
Deliberately not here: the weights' copies' layout, column scales, the o projection's input (it comes out of the
paged attention kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.rmsnorm.triton import forward_tiling  # the plain kernel's tiling: the same reduction order

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


@triton.jit
def _quant_store(v, q_ptrs, s_ptrs, mask, row_ok, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """Quantise the rows of a ``[BLOCK_M, BLOCK]`` fp32 tile ``v`` held in registers (zero outside ``mask``): scales
    to ``s_ptrs`` ``[BLOCK_M]``, e4m3 values to ``q_ptrs``; ``_quant_rows_kernel``'s one-pass arithmetic per row."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), FLOOR), QMAX)
    tl.store(s_ptrs, scale, mask=row_ok)
    y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale[:, None]), -QMAX), QMAX)
    tl.store(q_ptrs, y.to(tl.float8e4nv), mask=mask)


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    sum_ptr,
    q_ptr,
    qs_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # the tile, its statistics and its roundings are kernels.rmsnorm's (``_rmsnorm_fwd_kernel``, launched with the
    # same BLOCK_M / BLOCK_N / num_warps: the same reduction order, so the same bits)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    out = rows64[:, None] * n_cols + cols[None, :]
    if HAS_RESIDUAL:  # the sum rounded to x's dtype before the statistics
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + out, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = (w[None, :] * normed).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + out, y, mask=mask)
    _quant_store(y.to(tl.float32), q_ptr + out, qs_ptr + rows, mask, row_ok, FLOOR, QMAX)


@triton.jit
def _swiglu_quant_kernel(
    g_ptr,
    u_ptr,
    y_ptr,
    q_ptr,
    qs_ptr,
    n_rows,
    n_cols,
    stride_g,
    stride_u,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)
    g = tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty)  # kernels.swiglu's expression, one rounding
    out = rows64[:, None] * n_cols + cols[None, :]
    tl.store(y_ptr + out, y, mask=mask)
    _quant_store(y.to(tl.float32), q_ptr + out, qs_ptr + rows, mask, row_ok, FLOOR, QMAX)


def _one_pass_block(n_cols: int, what: str) -> tuple[int, int]:
    """(BLOCK, num_warps) of a fused kernel: the whole row in registers."""
    if n_cols > _ONE_PASS_MAX:
        raise ValueError(f"{what}: rows of at most {_ONE_PASS_MAX} columns are fused, got {n_cols}")
    block = triton.next_power_of_2(n_cols)
    return block, 4 if block <= 2048 else (8 if block <= 8192 else 16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rmsnorm_quant_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, qmax: float, floor: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``kernels.rmsnorm(x [M, H], weight, eps, residual)`` for inference, plus its output's per-row e4m3 copy:
    ``(y, x + residual or None, y_e4m3 [M, H], scales [M])``, y and the sum as ``kernels.rmsnorm`` returns them
    (bit for bit, same dtypes: x, weight and residual of one dtype) and the copy as ``quantize_rows_triton(y)``."""
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rmsnorm_quant_triton: x [M, H], weight [H], residual like x; got {tuple(x.shape)}")
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise ValueError("rmsnorm_quant_triton: x, weight and residual must share one dtype")
    x = _rows(x)
    m, n = x.shape
    block_m, block_n, warps = forward_tiling(n, x.element_size())
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    total = torch.empty((m, n), dtype=x.dtype, device=x.device) if residual is not None else None
    r = _rows(residual) if residual is not None else x
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _rmsnorm_quant_kernel[(triton.cdiv(m, block_m),)](
            x, r, weight, y, total if total is not None else y, q, s, m, n, x.stride(0), r.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, FLOOR=floor, QMAX=qmax, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps,
        )  # fmt: skip
    return y, total, q, s


def swiglu_quant_triton(
    gate: torch.Tensor, up: torch.Tensor, qmax: float, floor: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.swiglu(gate [M, I], up [M, I])`` for inference, plus its per-row e4m3 copy: ``(y, y_e4m3, scales)``
    (y bit-equal to the SwiGLU kernel's, contiguous; the copy as ``quantize_rows_triton(y)``). gate and up may be
    column slices of one GEMM's output (row strides are taken as they are)."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu_quant_triton: gate and up of one [M, I] shape and dtype; got {tuple(gate.shape)}")
    gate, up = _rows(gate), _rows(up)
    m, n = gate.shape
    block, warps = _one_pass_block(n, "swiglu_quant_triton")
    y = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=gate.device)
    s = torch.empty(m, dtype=torch.float32, device=gate.device)
    if m:
        _swiglu_quant_kernel[(m,)](
            gate, up, y, q, s, m, n, gate.stride(0), up.stride(0), FLOOR=floor, QMAX=qmax, BLOCK_M=1, BLOCK_N=block,
            num_warps=warps,
        )  # fmt: skip
    return y, q, s
