"""skinny_linear in Triton: program ``p`` computes output columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` for every
row of ``x`` (at most 8), walking K in ``BLOCK_K`` chunks: each chunk loads a ``[BLOCK_N, BLOCK_K]`` tile of the
weight once and multiplies it with the ``[M_PAD, BLOCK_K]`` rows of ``x`` in registers (a broadcast product summed
over K; no tensor cores - at M <= 8 the work is the weight read). N / BLOCK_N programs (256 for a 1024-wide output)
keep the memory system busy where cuBLAS's small-M tiles leave it idle. fp32 accumulation, one rounding.

``_skinny_group_kernel``: the same over up to 3 weights in one launch (outputs side by side), each reached from the
first weight's pointer by its element distance - no concatenated copy of the weights. The decoder uses it at batch 1
with ``DecoderOptions.group_projections`` (on by default: measured faster on the GPU, docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.skinny_linear.reference import MAX_ROWS


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


@triton.jit
def _skinny_group_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    E1,
    E2,
    W_D1,
    W_D2,
    B_D1,
    B_D2,
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
    # Output column n belongs to weight 0 below E1, weight 1 below E2, weight 2 after; weights 1 and 2 are reached
    # from w_ptr by their element distance W_D1 / W_D2 (separate allocations of one dtype; 0 when unused).
    seg1 = rn >= E1
    seg2 = rn >= E2
    local = rn - tl.where(seg2, E2, tl.where(seg1, E1, 0))
    w_off = tl.where(seg2, W_D2, tl.where(seg1, W_D1, 0)).to(tl.int64)
    acc = tl.zeros((M_PAD, BLOCK_N), tl.float32)
    w_rows = w_ptr + w_off[:, None] + local.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        b_off = tl.where(seg2, B_D2, tl.where(seg1, B_D1, 0)).to(tl.int64)
        acc += tl.load(b_ptr + b_off + local, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_config(rows: int, n: int) -> tuple[int, int, int]:
    """(M_PAD, BLOCK_N, BLOCK_K) for ``rows`` rows and ``n`` output columns: BLOCK_N from 4 to 16 so that a
    1024-3072-wide projection gets 256-512 programs (2-4 per H200 multiprocessor), and the product tile
    ``M_PAD x BLOCK_N x BLOCK_K`` at 4096 fp32 values (32 registers a thread at 4 warps)."""
    m_pad = triton.next_power_of_2(max(rows, 1))
    block_n = min(16, max(4, triton.next_power_of_2(max(n // 512, 1))))
    return m_pad, block_n, max(32, 4096 // (m_pad * block_n))


def _distances(tensors: list[torch.Tensor]) -> list[int]:
    """Element distances of tensors 1.. from tensor 0 (one dtype, so every distance is a whole number of elements)."""
    size = tensors[0].element_size()
    out = []
    for t in tensors[1:]:
        delta = t.data_ptr() - tensors[0].data_ptr()
        if delta % size:
            raise ValueError("skinny_linear: weights (or biases) are not aligned to their element size")
        out.append(delta // size)
    return out + [0] * (3 - len(tensors))


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor | tuple[torch.Tensor, ...],
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``[M, K] x [N, K]^T (+ [N]) -> [M, N]`` in ``x``'s dtype, M <= ``MAX_ROWS``. ``weight`` may be up to 3
    matrices ``[N_i, K]`` (and ``bias`` as many vectors): one launch computes their outputs side by side, ``[M, sum
    N_i]`` (q/k/v, or gate/up, of a decode step)."""
    weights = list(weight) if isinstance(weight, (tuple, list)) else [weight]
    biases = None if bias is None else (list(bias) if isinstance(bias, (tuple, list)) else [bias])
    if x.dim() != 2 or not 1 <= len(weights) <= 3:
        raise ValueError(f"expected x [M, K] and 1 to 3 weights [N, K], got x {tuple(x.shape)}, {len(weights)} weights")
    M, K = x.shape
    if any(w.dim() != 2 or w.shape[1] != K or w.dtype != weights[0].dtype for w in weights):
        shapes = [tuple(w.shape) for w in weights]
        raise ValueError(f"expected x [M, K] and weights [N, K] of one dtype, got x {tuple(x.shape)} and {shapes}")
    if biases is not None and (len(biases) != len(weights) or any(b is None for b in biases)):
        raise ValueError("skinny_linear: give one bias per weight, or none")
    if M > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {M}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weights = [w if w.is_contiguous() else w.contiguous() for w in weights]
    sizes = [w.shape[0] for w in weights]
    N = sum(sizes)
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))] + [N] * (3 - len(sizes))
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    if biases is not None:
        biases = [b if b.is_contiguous() else b.contiguous() for b in biases]
    wd = _distances(weights)
    bd = _distances(biases) if biases is not None else [0, 0, 0]
    m_pad, block_n, block_k = block_config(M, N)
    grid = (triton.cdiv(N, block_n),)
    bias0 = biases[0] if biases is not None else weights[0]
    if len(weights) == 1:
        _skinny_kernel[grid](
            x, weights[0], bias0, y, M, N, K, x.stride(0), K, y.stride(0),
            HAS_BIAS=biases is not None, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )  # fmt: skip
        return y
    _skinny_group_kernel[grid](
        x, weights[0], bias0, y, M, N, K, ends[0], ends[1], wd[0], wd[1], bd[0], bd[1], x.stride(0), K, y.stride(0),
        HAS_BIAS=biases is not None, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return y
