"""skinny_linear in Triton: program ``p`` computes output columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` for every
row of ``x`` (at most 8), walking K in ``BLOCK_K`` chunks: each chunk loads a ``[BLOCK_N, BLOCK_K]`` tile of the
weight once and multiplies it with the ``[M_PAD, BLOCK_K]`` rows of ``x`` in registers (a broadcast product summed
over K; no tensor cores - at M <= 8 the work is the weight read). N / BLOCK_N programs (256 for a 1024-wide output)
keep the memory system busy where cuBLAS's small-M tiles leave it idle. fp32 accumulation, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.skinny_linear import MAX_ROWS


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((M_PAD, BLOCK_N), tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_config(rows: int, n: int) -> tuple[int, int, int]:
    """(M_PAD, BLOCK_N, BLOCK_K) for ``rows`` rows and ``n`` output columns: BLOCK_N from 4 to 16 so that a
    1024-3072-wide projection gets 256-512 programs (2-4 per H200 multiprocessor), and the product tile
    ``M_PAD x BLOCK_N x BLOCK_K`` at 4096 fp32 values (32 registers a thread at 4 warps)."""
    m_pad = triton.next_power_of_2(max(rows, 1))
    block_n = min(16, max(4, triton.next_power_of_2(max(n // 512, 1))))
    return m_pad, block_n, max(32, 4096 // (m_pad * block_n))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, K] x [N, K]^T (+ [N]) -> [M, N]`` in ``x``'s dtype, M <= ``MAX_ROWS``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {M}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    m_pad, block_n, block_k = block_config(M, N)
    _skinny_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return y
