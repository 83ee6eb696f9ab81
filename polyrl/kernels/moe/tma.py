"""Opt-in Hopper variant of moe_experts' rows GEMMs: weight (B) tiles, and A tiles where A's rows are contiguous,
loaded through TMA tensor descriptors, with an optional warp-specialised K loop.

Off by default: ``polyrl.kernels.moe.triton.TMA = True`` turns it on, and then only on a CUDA device of compute
capability >= 9.0, outside the Triton interpreter, for 16-bit inputs whose tensors TMA can address (16-byte aligned
base and row strides, unit inner stride) and GEMMs that have an entry in ``TMA_CONFIGS`` (no LoRA second segment).
Anything else runs the pointer kernel (``_grouped_rows_kernel``) as before.

What it changes against ``_grouped_rows_kernel`` (same schedule, same epilogues, same K order):

- B (an expert's weight slice) through a descriptor bounded by the expert: mode "host", a host-side 3-d descriptor
  over the whole weight tensor ``[E, d1, d2]`` with block ``[1, ., .]`` (the expert index is the outer coordinate);
  modes "device" / "ws", a 2-d descriptor over ``b[e]`` built by each program. Either way a K or N tile past the
  expert's extent is zero-filled by the copy engine, never read from the next expert. A transposed B (``x @ W^T``:
  the "up" and "down" GEMMs) is loaded as stored, ``[BLOCK_N, BLOCK_K]``, and fed to ``tl.dot`` transposed (wgmma
  reads either major order of 16-bit operands from shared memory).
- A (rows in sorted order: "down", "d act", "dx") through a 2-d descriptor ``[rows, K]``, block ``[BLOCK_M, BLOCK_K]``
  at the tile's first row. A tile's last rows may belong to the next expert (or lie past the end: zero-filled);
  each output row depends only on its own A row and such rows are masked off at the store, as before. The gathered
  A of the "up" GEMM (``x[token]``) stays a pointer load (cp.async).
- Mode "ws" sets ``tl.range(..., warp_specialize=True)`` on the K loop. On sm_90 Triton (3.6 and 3.9) runs its
  Hopper warp-specialisation pass (``add_hopper_warpspec``; ``tl.range``'s docstring still says Blackwell-only), which
  engages with ``num_warps=4`` and descriptors it can re-block (device-side ones): a producer warpgroup issues the
  TMA copies, two consumer warpgroups split the tile and run wgmma (12 warps in all, ``setmaxnreg``). A pointer-loaded
  A breaks the pass, so "up" has no "ws" mode (``plan`` refuses it). What compiles, with registers and shared memory:
  ``scripts/moe_tma_compile.py``, docs/performance.md ("The TMA variant of the rows GEMMs").

Host-side descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) are encoded at launch and passed as
kernel parameters (CUDA-graph capturable like the pointer arguments). Device-side ones need global scratch (256 bytes
a program) from ``triton.set_allocator``: ``launch`` installs a torch allocation when no allocator is set. The Triton
interpreter runs the same kernel (it emulates descriptor loads with masked loads), which the CPU tests use.
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
    a_desc,  # host descriptor [rows, K] block [BLOCK_M, BLOCK_K] (not GATHER_A, not DEVICE_DESC)
    a_ptr,  # [rows', K]: gathered through a_idx (GATHER_A), or the base of the device-side descriptor
    a_idx_ptr,
    b_desc,  # host descriptor [E, K, N] block [1, BLOCK_K, BLOCK_N] (B_KN) or [E, N', K] block [1, BLOCK_N, BLOCK_K]
    b_ptr,  # the weights [E, D1, D2] (DEVICE_DESC: per-expert 2-d descriptors over b[e])
    A_ROWS,  # rows of A (DEVICE_DESC)
    B_D1,
    B_D2,
    stride_be,
    stride_b1,
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
    WARP_SPEC: tl.constexpr,
    DEVICE_DESC: tl.constexpr,
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
    if DEVICE_DESC:
        # descriptors built by each program (global scratch from triton.set_allocator): b[e] alone, so K and N
        # tiles past the expert's extent are zero-filled, and Triton's Hopper warp specialisation can re-block them
        if not GATHER_A:
            a_dd = tl.make_tensor_descriptor(a_ptr, [A_ROWS, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if B_KN:
            b_dd = tl.make_tensor_descriptor(b_ptr + e.to(tl.int64) * stride_be, [B_D1, B_D2], [stride_b1, 1],
                                             [BLOCK_K, BLOCK_N])  # fmt: skip
        else:
            b_dd = tl.make_tensor_descriptor(b_ptr + e.to(tl.int64) * stride_be, [B_D1, B_D2], [stride_b1, 1],
                                             [BLOCK_N, BLOCK_K])  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_k = tl.where(row0 < row_end, tl.cdiv(K, BLOCK_K), 0)
    for kk in tl.range(0, num_k, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
        k0 = kk * BLOCK_K
        if GATHER_A:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=rmask[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
            a_ptrs += BLOCK_K
        elif DEVICE_DESC:
            a = a_dd.load([row0, k0])
        else:
            a = a_desc.load([row0, k0])
        if DEVICE_DESC:
            if B_KN:
                b = b_dd.load([k0, n0])
            else:
                b = b_dd.load([n0, k0]).T
        elif B_KN:
            b = b_desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        else:
            b = b_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if EPI == 1:
            if DEVICE_DESC:
                bu = b_dd.load([b_up + n0, k0]).T
            else:
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
    a: torch.Tensor, gather: bool, b: torch.Tensor, b_strides: tuple[int, int, int], b_up: int, epi: int, mode: str
) -> tuple[bool, int] | None:
    """(B_KN, b_up in rows of b's N dimension) when the TMA kernel can run this rows GEMM in ``mode``, else None.
    Device capability and the interpreter are the caller's business. A gathered A with "ws" is refused: Triton's
    Hopper warp specialisation only moves descriptor loads to its producer ("unsupported load type for producer
    commit" in 3.9, an assertion in 3.6)."""
    if TensorDescriptor is None or a.dtype not in _TMA_DTYPES or b.dtype != a.dtype or (gather and mode == "ws"):
        return None
    if a.stride(-1) != 1 or (not gather and not _addressable(a, 2)):
        return None
    b_kn = b_layout(b, b_strides)
    if b_kn is None or (epi == 1 and (b_kn or b_up % b.stride(1))):
        return None
    return b_kn, (b_up // b.stride(1) if epi == 1 else 0)


MODES = ("host", "device", "ws")


def _scratch(size: int, alignment: int, stream):
    """Global scratch for device-side descriptors (``triton.set_allocator``): a torch allocation on the current
    device, stream-ordered by the caching allocator (and from the graph's pool under CUDA-graph capture)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Install ``_scratch`` as Triton's allocator in this context unless one is set (the setting is a context
    variable: autograd's backward thread starts without the forward thread's)."""
    # lazy: a private Triton module (present in 3.6 and 3.9), read only when the TMA switch is on
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def launch(
    grid: int, a, a_idx, b, b_kn: bool, b_up_rows: int, out, h, w_rows, wact, dw_part, tile_expert, tile_row,
    offsets, n: int, k: int, m_tiles: int, num_n: int, *, epi: int, store_h: bool, need_dw: bool, dot_f32: bool,
    cfg: tuple[int, int, int, int, int, int, str],
) -> None:  # fmt: skip
    """One ``_grouped_rows_tma_kernel`` launch; ``cfg`` = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, mode),
    mode one of ``MODES``: "host" descriptors, "device" descriptors (built in the kernel), "ws" device descriptors
    and a warp-specialised K loop (``warps`` is then per warpgroup: Triton's Hopper pass adds a producer warpgroup
    and splits the tile over consumer warpgroups; it engages at ``warps == 4`` only). The arguments mirror
    ``_grouped_rows_kernel``'s (``out`` stands in for unused pointers)."""
    bm, bn, bk, warps, stages, group_m, mode = cfg
    if mode not in MODES:
        raise ValueError(f"TMA mode {mode!r} is not one of {MODES}")
    gather = a_idx is not None
    device_desc = mode != "host"
    a_desc = b_desc = None
    if device_desc:
        _ensure_allocator()
    else:
        b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [1, bk, bn] if b_kn else [1, bn, bk])
        if not gather:
            a_desc = TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [bm, bk])
    h_arg = h if h is not None else out
    _grouped_rows_tma_kernel[(grid,)](
        a_desc, a, a_idx if gather else tile_row, b_desc, b, a.shape[0], b.shape[1], b.shape[2], b.stride(0),
        b.stride(1), out, h_arg, w_rows if w_rows is not None else out, wact if wact is not None else out,
        dw_part if dw_part is not None else out, tile_expert, tile_row, offsets, n, k, a.stride(0), b_up_rows,
        out.stride(0), h_arg.stride(0), m_tiles, num_n, GATHER_A=gather, B_KN=b_kn, EPI=epi, STORE_H=store_h,
        NEED_DW=need_dw, DOT_F32=dot_f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, NUM_STAGES=stages,
        WARP_SPEC=mode == "ws", DEVICE_DESC=device_desc, EVEN_K=k % bk == 0, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
