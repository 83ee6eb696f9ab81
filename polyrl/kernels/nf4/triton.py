"""NF4 dequant-matmul in Triton: ``y [M, N] = x [M, K] @ dequant(W)^T`` without materialising ``W``.

Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of ``y`` and walks K one 64-element NF4 block at a time: it loads
the block's 32 packed bytes per output row ``[BLOCK_N, 32]``, splits them into the low-nibble half (elements
0..31) and the high-nibble half (32..63), looks the 4-bit indices up in the 16-entry code table, scales by the
block's absmax, and accumulates two ``tl.dot``s with the matching halves of ``x`` in fp32 (``reference.py`` has the
layout). The weight is read as 4 bits + 0.5 bit of absmax per element, which is what makes it pay on decode-sized M.

Above ``FUSED_MAX_ROWS`` rows (training, long prefills) the forward instead dequantizes the weight with
``_nf4_dequant_kernel`` into a transient dense tensor and calls the vendor GEMM, which beats small fused dots there.
Backward (``x`` only; the base is frozen): ``dx = dy @ dequant(W)``, same transient dequant. Not here: double
quantization, split-K for tiny M, a fused LoRA branch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.nf4.reference import code_tensor

_CODES: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _nf4_mm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    c_ptr,
    y_ptr,
    M,
    N,
    K,
    NB,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * (NB * 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, NB):
        k_lo = b * 64 + j
        k_hi = k_lo + 32
        x_lo = tl.load(x_rows + k_lo[None, :], mask=m_ok[:, None] & (k_lo < K)[None, :], other=0.0)
        x_hi = tl.load(x_rows + k_hi[None, :], mask=m_ok[:, None] & (k_hi < K)[None, :], other=0.0)
        qb = tl.load(q_rows + (b * 32 + j)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)  # [BN, 32]
        scale = tl.load(s_ptr + rn.to(tl.int64) * NB + b, mask=n_ok, other=0.0)  # [BN]
        w_lo = tl.load(c_ptr + (qb & 15)) * scale[:, None]
        w_hi = tl.load(c_ptr + (qb >> 4)) * scale[:, None]
        w_lo = tl.trans(w_lo.to(x_lo.dtype))  # [32, BN]
        w_hi = tl.trans(w_hi.to(x_hi.dtype))
        if IEEE:
            acc += tl.dot(x_lo, w_lo, input_precision="ieee")
            acc += tl.dot(x_hi, w_hi, input_precision="ieee")
        else:
            acc += tl.dot(x_lo, w_lo)
            acc += tl.dot(x_hi, w_hi)
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _nf4_dequant_kernel(q_ptr, s_ptr, c_ptr, w_ptr, K, NB, ROWS: tl.constexpr):
    """One program: ``ROWS`` output rows x one 64-element block -> dense ``w [N, K]`` in ``w``'s dtype."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1)
    j = tl.arange(0, 32)
    qb = tl.load(q_ptr + r.to(tl.int64)[:, None] * (NB * 32) + (b * 32 + j)[None, :]).to(tl.int32)
    scale = tl.load(s_ptr + r.to(tl.int64) * NB + b)[:, None]
    row = w_ptr + r.to(tl.int64)[:, None] * K
    k_lo = b * 64 + j
    k_hi = k_lo + 32
    w_lo = (tl.load(c_ptr + (qb & 15)) * scale).to(w_ptr.dtype.element_ty)
    w_hi = (tl.load(c_ptr + (qb >> 4)) * scale).to(w_ptr.dtype.element_ty)
    tl.store(row + k_lo[None, :], w_lo, mask=(k_lo < K)[None, :])
    tl.store(row + k_hi[None, :], w_hi, mask=(k_hi < K)[None, :])


def dequantize(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[N, K]`` weight in ``dtype`` (the reference's values: fp32 code * absmax, one rounding)."""
    n, k = shape
    w = torch.empty(n, k, dtype=dtype, device=packed.device)
    rows = 16 if n % 16 == 0 else 1
    _nf4_dequant_kernel[(n // rows, absmax.shape[-1])](
        packed, absmax, _code(packed.device), w, k, absmax.shape[-1], ROWS=rows
    )
    return w


def _code(device: torch.device) -> torch.Tensor:
    c = _CODES.get(device)
    if c is None:
        c = _CODES[device] = code_tensor(device)
    return c


def _forward(x2: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    m, k = x2.shape
    n = shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _nf4_mm_kernel[grid](
        x2,
        packed,
        absmax,
        _code(x2.device),
        y,
        m,
        n,
        k,
        absmax.shape[-1],
        x2.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=x2.dtype == torch.float32,
        num_warps=4,
    )
    return y


# Above this many rows a dense dequant (memory-bound, ~N*K*2.6 bytes moved) + the vendor GEMM beats the fused
# kernel's small dots; below it (decode, short prompts) reading 4-bit weights once is what counts.
FUSED_MAX_ROWS = 256


class _NF4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, packed, absmax, shape):
        ctx.save_for_backward(packed, absmax)
        ctx.shape = shape
        if x2.shape[0] > FUSED_MAX_ROWS:
            return x2 @ dequantize(packed, absmax, shape, x2.dtype).T
        return _forward(x2, packed, absmax, shape)

    @staticmethod
    def backward(ctx, dy):
        packed, absmax = ctx.saved_tensors
        w = dequantize(packed, absmax, ctx.shape, dy.dtype)  # [N, K], transient
        return dy @ w, None, None, None


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Same contract as ``reference.nf4_matmul``: ``x [..., K] -> [..., N]``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return _NF4Matmul.apply(x2, packed.contiguous(), absmax.contiguous(), tuple(shape)).view(*lead, shape[0])
