"""Opt-in Hopper variant of moe_experts' rows GEMMs: weight (B) tiles, and A tiles where A's rows are contiguous,
loaded through host-side TMA tensor descriptors.

Off by default: ``polyrl.kernels.moe.triton.TMA = True`` turns it on, and then only on a CUDA device of compute
capability >= 9.0, outside the Triton interpreter, for 16-bit inputs whose tensors TMA can address (16-byte aligned
base and row strides, unit inner stride) and GEMMs that have an entry in ``TMA_CONFIGS`` (no LoRA second segment).
Anything else runs the pointer kernel (``_grouped_rows_kernel``) as before.

What it changes against ``_grouped_rows_kernel`` (same schedule, same epilogues, same K order):

- B (an expert's weight slice) through a 3-d descriptor over the whole weight tensor ``[E, d1, d2]`` with block
  ``[1, ., .]`` (the expert index is the outer coordinate), so a K or N tile past the expert's extent is zero-filled
  by the copy engine, never read from the next expert. A transposed B (``x @ W^T``: the "up" and "down" GEMMs) is
  loaded as stored, ``[BLOCK_N, BLOCK_K]``, and fed to ``tl.dot`` transposed (wgmma reads either major order of
  16-bit operands from shared memory).
- A (rows in sorted order: "down", "d act", "dx") through a 2-d descriptor ``[rows, K]``, block ``[BLOCK_M, BLOCK_K]``
  at the tile's first row. A tile's last rows may belong to the next expert (or lie past the end: zero-filled);
  each output row depends only on its own A row and such rows are masked off at the store, as before. The gathered
  A of the "up" GEMM (``x[token]``) stays a pointer load (cp.async).

The descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) are encoded at launch and passed as kernel
parameters (CUDA-graph capturable like the pointer arguments). The Triton interpreter runs the same kernel (it
emulates descriptor loads with masked loads), which the CPU tests use.

Tried and dropped (H100, Triton 3.6, scripts/moe_tile_sweep.py; docs/performance.md, "The TMA variant of the rows
GEMMs"): descriptors built in the kernel (``tl.make_tensor_descriptor``, correct, 0.99-1.01x the pointer kernel, never
faster than host ones) and a warp-specialised K loop over them (``tl.range(..., warp_specialize=True)``, Triton's
Hopper pass, which ``tl.range`` documents as Blackwell-only: it compiled, but its outputs were wrong, NaN and 1e32
values in "down" and "dx").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.moe.rows_tile import rows_epilogue, tile_rows

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the switch then never engages
    TensorDescriptor = None

_TMA_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _grouped_rows_tma_kernel(
    a_desc,  # descriptor [rows, K] block [BLOCK_M, BLOCK_K] (not GATHER_A)
    a_ptr,  # [rows', K], gathered through a_idx (GATHER_A)
    a_idx_ptr,
    b_desc,  # descriptor [E, K, N] block [1, BLOCK_K, BLOCK_N] (B_KN) or [E, N', K] block [1, BLOCK_N, BLOCK_K]
    c_ptr,
    h_ptr,
    w_ptr,
    wact_ptr,
    dwp_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    N,
    K,
    stride_am,
    b_up,  # the up block's first row in b_desc's N dimension (EPI 1; not B_KN)
    stride_cm,
    stride_hm,
    NUM_M,
    NUM_N,
    GATHER_A: tl.constexpr,
    B_KN: tl.constexpr,
    EPI: tl.constexpr,
    STORE_H: tl.constexpr,
    NEED_DW: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 (the gathered A's loads need no K mask)
):
    pid_n, e, row0, row_end, rows, rmask = tile_rows(
        tl.program_id(0), NUM_M, NUM_N, GROUP_M, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M
    )
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    nmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    if GATHER_A:
        arows = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        a_ptrs = a_ptr + arows[:, None] * stride_am + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_k = tl.where(row0 < row_end, tl.cdiv(K, BLOCK_K), 0)
    for kk in tl.range(0, num_k, num_stages=NUM_STAGES):
        k0 = kk * BLOCK_K
        if GATHER_A:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=rmask[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
            a_ptrs += BLOCK_K
        else:
            a = a_desc.load([row0, k0])
        if B_KN:
            b = b_desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        else:
            b = b_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if EPI == 1:
            bu = b_desc.load([e, b_up + n0, k0]).reshape(BLOCK_N, BLOCK_K).T
            if DOT_F32:
                bu = bu.to(tl.float32)
            acc_u = tl.dot(a, bu, acc_u)
    rows_epilogue(acc, acc_u, rows, rmask, cols, nmask, pid_n, c_ptr, h_ptr, w_ptr, wact_ptr, dwp_ptr, N, stride_cm,
                   stride_hm, NUM_N, EPI=EPI, STORE_H=STORE_H, NEED_DW=NEED_DW)  # fmt: skip


def _addressable(t: torch.Tensor, dims: int) -> bool:
    """TMA can address ``t`` as a ``dims``-d tensor: unit inner stride, 16-byte aligned base and outer strides."""
    if t.dim() != dims or t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


def b_layout(b: torch.Tensor, b_strides: tuple[int, int, int]) -> bool | None:
    """True when ``B[e][k, n]`` is ``b[e, k, n]`` (k-major rows), False when it is ``b[e, n, k]`` (``x @ W^T``), None
    when neither (or TMA cannot address ``b``)."""
    if not _addressable(b, 3):
        return None
    if tuple(b_strides) == (b.stride(0), b.stride(1), b.stride(2)):
        return True
    if tuple(b_strides) == (b.stride(0), b.stride(2), b.stride(1)):
        return False
    return None


def plan(
    a: torch.Tensor, gather: bool, b: torch.Tensor, b_strides: tuple[int, int, int], b_up: int, epi: int
) -> tuple[bool, int] | None:
    """(B_KN, b_up in rows of b's N dimension) when the TMA kernel can run this rows GEMM, else None. Device
    capability and the interpreter are the caller's business."""
    if TensorDescriptor is None or a.dtype not in _TMA_DTYPES or b.dtype != a.dtype:
        return None
    if a.stride(-1) != 1 or (not gather and not _addressable(a, 2)):
        return None
    b_kn = b_layout(b, b_strides)
    if b_kn is None or (epi == 1 and (b_kn or b_up % b.stride(1))):
        return None
    return b_kn, (b_up // b.stride(1) if epi == 1 else 0)


def launch(
    grid: int, a, a_idx, b, b_kn: bool, b_up_rows: int, out, h, w_rows, wact, dw_part, tile_expert, tile_row,
    offsets, n: int, k: int, m_tiles: int, num_n: int, *, epi: int, store_h: bool, need_dw: bool, dot_f32: bool,
    cfg: tuple[int, int, int, int, int, int],
) -> None:  # fmt: skip
    """One ``_grouped_rows_tma_kernel`` launch; ``cfg`` = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M). The
    arguments mirror ``_grouped_rows_kernel``'s (``out`` stands in for unused pointers)."""
    bm, bn, bk, warps, stages, group_m = cfg
    gather = a_idx is not None
    b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [1, bk, bn] if b_kn else [1, bn, bk])
    a_desc = None if gather else TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [bm, bk])
    h_arg = h if h is not None else out
    _grouped_rows_tma_kernel[(grid,)](
        a_desc, a, a_idx if gather else tile_row, b_desc, out, h_arg, w_rows if w_rows is not None else out,
        wact if wact is not None else out, dw_part if dw_part is not None else out, tile_expert, tile_row, offsets, n,
        k, a.stride(0), b_up_rows, out.stride(0), h_arg.stride(0), m_tiles, num_n, GATHER_A=gather, B_KN=b_kn,
        EPI=epi, STORE_H=store_h, NEED_DW=need_dw, DOT_F32=dot_f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=group_m, NUM_STAGES=stages, EVEN_K=k % bk == 0, num_warps=warps, num_stages=stages,
    )  # fmt: skip
