"""moe_experts in Triton: grouped GEMMs over tokens sorted by expert, forward and backward, no host sync.

Routing (all on the device, capturable in a CUDA graph): the ``T*k`` (token, slot) pairs are sorted by expert
(``argsort``, stable), per-expert row counts come from ``scatter_add`` and their ``cumsum`` gives each expert's
row range in sorted order. Every grouped GEMM is ONE launch over a fixed, host-known grid of
``cdiv(T*k, BLOCK_M) + min(T*k, E)`` m-tiles (times the n-tiles): a small device-side schedule maps each m-tile
to (expert, first row); tiles past the last expert's rows run an empty K loop and store nothing.

Forward (three launches after the routing):

1. ``h = x[token] @ gate_up[e]^T`` with SwiGLU fused: each program computes a gate tile and the matching up
   tile (two accumulators sharing the gathered x tile) and writes ``act = silu(g) * u``; when a gradient is
   needed it also writes ``h`` (pre-activation) for the backward.
2. ``y = act @ down[e]^T`` (unweighted rows in sorted order; a forward temporary).
3. Un-permute fused with the routing weights: ``out[t] = sum_j w[t, j] * y[pos(t, j)]``, gathering each
   token's k rows (deterministic: no atomics), fp32 sum.

Saved for the backward: the inputs, ``h`` ``[T*k, 2I]`` and the integer routing. Neither ``y`` ``[T*k, H]`` nor
``act`` ``[T*k, I]`` is kept (537 + 201 MB per layer at Qwen3-30B-A3B's shapes, 16384 tokens, bf16): ``d w`` is
``<act_r, dy[token] @ down[e]>`` (= ``<y_r, dy[token]>``, the product the d-act GEMM computes anyway) and ``act``
is recomputed elementwise from ``h`` in that GEMM's epilogue, which already reads ``h``. No GEMM is recomputed and
the weight-gradient GEMMs read contiguous rows as before (the reverted variant of commit 906a984 gathered and scaled
dy and recomputed act inside the d-down GEMM's K loop, and lost 22% of the kernels' throughput).

Backward (``w_r``: the routing weight of sorted row ``r``):

- ``dyr = dy[token]``: dy's rows in sorted order, unweighted (one gather);
- ``g = dyr @ down[e]`` (the unweighted d act) with the epilogue fused: ``act`` recomputed from ``h`` as the
  forward rounded it, ``d w[r] = <act_r, g_r>`` as fp32 partial sums per (row, n-tile), summed after the launch
  (deterministic, no atomics); ``wact = w_r * act`` stored for d down; ``d act = w_r * g`` into the SwiGLU backward
  (writes ``dh``);
- ``d down[e] = dyr_e^T @ wact_e`` and ``d gate_up[e] = dh_e^T @ x[token]_e``: variable-K grouped GEMMs, one
  program per (expert, output tile) walking that expert's rows (an expert with no rows gets zeros);
- ``dx_rows = dh @ gate_up[e]`` then the un-permute gather (unweighted) sums each token's k rows.

fp32 inputs use ``input_precision="ieee"`` dots unless ``torch.backends.cuda.matmul.allow_tf32`` is on. Under
the Triton interpreter (CPU tests) 16-bit operands are upcast to fp32 before ``tl.dot`` (the interpreter's
bf16 dot multiplies raw bits); on the device they go to the tensor cores as they are.

Opt-in (``TMA = True``, default off): the rows GEMMs through TMA tensor descriptors on
compute capability >= 9.0 (``polyrl/kernels/moe/tma.py``; falls back to the kernels here wherever it cannot run).

Not here: expert parallelism, fp8, a persistent/stream-K schedule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from polyrl.errors import UserError
from polyrl.kernels.moe import tma as _tma
from polyrl.kernels.moe.rows_tile import rows_epilogue, tile_rows
from polyrl.platform import device as platform_device

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return bool(knobs.runtime.interpret)


# --- tile configurations ------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M) per GEMM for 16-bit inputs; "*_small" when an expert
# has few rows (decode). fp32 inputs halve BLOCK_K and cap BLOCK_N at 128 (shared memory). Picked by a sweep on the
# H200 at Qwen3-30B-A3B's expert shapes, T=4096 (docs/performance.md, "MoE experts").
CONFIGS: dict[str, tuple[int, int, int, int, int, int]] = {
    "up": (128, 128, 64, 8, 4, 8),  # x @ gate_up^T + SwiGLU (two accumulators: BLOCK_N gate + BLOCK_N up columns)
    "down": (128, 256, 64, 8, 4, 8),  # act @ down^T
    "dact": (64, 128, 64, 4, 4, 4),  # dys @ down (+ SwiGLU backward)
    "dx": (128, 256, 64, 8, 4, 8),  # dh @ gate_up
    "wgrad": (128, 128, 64, 4, 3, 1),  # d down, d gate_up (BLOCK_K = rows per step)
    "up_small": (16, 64, 128, 4, 4, 1),
    "rows_small": (16, 128, 128, 4, 4, 1),
    "wgrad_small": (64, 64, 32, 4, 3, 1),
}
_INTERP = (16, 16, 16, 1, 1, 2)

# Opt-in TMA variant of the rows GEMMs (polyrl/kernels/moe/tma.py): off by default. When on, a rows GEMM whose config
# name has an entry below runs ``_grouped_rows_tma_kernel`` on a CUDA device of compute capability >= 9.0 outside the
# interpreter, for 16-bit inputs TMA can address and no LoRA segment; everything else keeps the pointer kernel.
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M). Measured against the pointer kernel at Qwen3-30B-A3B's
# shapes (H100, T=4096, scripts/moe_tile_sweep.py): "down" 1.14x, "up" 1.02x, "dx" 1.01x; "dact" was 0.94x at its
# best tile, so it has no entry (bounded by its SwiGLU-backward epilogue, which spills either way). fp32 and the
# "*_small" (decode) configs never take this path. End to end (SFT at qwen3-30b-a3b-L8 4 x 4096, H100, one run each):
# 65,072 tokens/s on against 64,319 off (+1.2%), the same loss: kept off until repeated runs show it above the noise.
TMA = False
TMA_CONFIGS: dict[str, tuple[int, int, int, int, int, int]] = {
    "up": (128, 128, 64, 8, 4, 8),
    "down": (128, 256, 64, 8, 4, 8),
    "dx": (128, 256, 64, 8, 4, 8),
}
_TMA_INTERP = (16, 16, 16, 1, 1, 2)


tma_launches = 0  # rows GEMMs run by the TMA kernel in this process (lets a sweep or test see the switch engage)


def _tma_device_ok(device: torch.device) -> bool:
    """Hopper or newer CUDA device, compiled Triton (not the interpreter). The CPU tests patch this to run the TMA
    kernel under the interpreter (which emulates descriptor loads), with ``_TMA_INTERP``'s tiles."""
    if interpreting() or device.type != "cuda" or torch.version.hip is not None:  # TMA: NVIDIA Hopper and newer
        return False
    cap = platform_device.capability(device.index or 0)
    return cap is not None and tuple(cap) >= (9, 0)


def _tma_cfg(name: str, rows_per_expert: float, dtype: torch.dtype, device: torch.device):
    """The TMA config for this rows GEMM when ``TMA`` is on and it applies (else None)."""
    if not TMA or name not in TMA_CONFIGS or rows_per_expert < 48 or dtype == torch.float32:
        return None
    if not _tma_device_ok(device):
        return None
    return _TMA_INTERP if interpreting() else TMA_CONFIGS[name]


def _cfg(name: str, rows_per_expert: float, dtype: torch.dtype) -> tuple[int, int, int, int, int, int]:
    if interpreting():
        return _INTERP
    if rows_per_expert < 48:
        name = {"up": "up_small", "wgrad": "wgrad_small"}.get(name, "rows_small")
    bm, bn, bk, warps, stages, group_m = CONFIGS[name]
    if dtype == torch.float32:
        bn, bk = min(bn, 128), max(16, bk // 2)
    return bm, bn, bk, warps, stages, group_m


def _prec(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _grouped_rows_kernel(
    a_ptr,  # [rows, K] (gathered through a_idx when GATHER_A)
    a_idx_ptr,
    b_ptr,  # per expert: B[e, k, n] at b_ptr + e*stride_be + k*stride_bk + n*stride_bn
    c_ptr,  # [rows, N] (EPI 0, 1: act) or [rows, 2N] (EPI 2: dh)
    h_ptr,  # [rows, 2N] pre-activation (EPI 1 writes it when STORE_H, EPI 2 reads it)
    w_ptr,  # [rows] routing weight of each sorted row (EPI 2)
    wact_ptr,  # [rows, N] out (EPI 2): w * act, act recomputed from h
    dwp_ptr,  # [rows, NUM_N] fp32 out (EPI 2 with NEED_DW): this n-tile's share of <act[r], d act[r] / w[r]>
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    a2_ptr,  # [rows, K2] in sorted order (HAS_A2): a second K segment, a LoRA branch's rank-r rows
    b2_ptr,  # per expert: B2[e, k, n] at b2_ptr + e*stride_b2e + k*stride_b2k + n*stride_b2n (HAS_A2)
    N,
    K,
    K2,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    b_up,  # element offset from the gate block to the up block of B (EPI 1)
    stride_a2m,
    stride_b2e,
    stride_b2k,
    stride_b2n,
    b2_up,  # the same for B2
    stride_cm,
    stride_hm,
    NUM_M,
    NUM_N,
    HAS_A2: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    GATHER_A: tl.constexpr,
    EPI: tl.constexpr,  # 0: store C; 1: SwiGLU forward; 2: SwiGLU backward
    STORE_H: tl.constexpr,
    NEED_DW: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_n, e, row0, row_end, rows, rmask = tile_rows(
        tl.program_id(0), NUM_M, NUM_N, GROUP_M, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M
    )
    if GATHER_A:
        arows = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        arows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + arows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_k = tl.where(row0 < row_end, tl.cdiv(K, BLOCK_K), 0)
    for kk in range(0, num_k):
        if EVEN_K:
            kmask = ks < BLOCK_K
        else:
            kmask = (kk * BLOCK_K + ks) < K
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if EPI == 1:
            bu = tl.load(b_ptrs + b_up, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if DOT_F32:
                bu = bu.to(tl.float32)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if HAS_A2:
        # the LoRA branch: acc += A2[rows] @ B2[e] over its K2 <= BLOCK_K2 (one tile), into the same accumulators,
        # so the epilogue (SwiGLU forward or backward) sees the adapted product
        k2 = tl.arange(0, BLOCK_K2)
        k2mask = k2 < K2
        a2 = tl.load(
            a2_ptr + rows.to(tl.int64)[:, None] * stride_a2m + k2[None, :], mask=rmask[:, None] & k2mask[None, :],
            other=0.0,
        )  # fmt: skip
        b2_ptrs = b2_ptr + e.to(tl.int64) * stride_b2e + k2[:, None] * stride_b2k + cols[None, :] * stride_b2n
        b2 = tl.load(b2_ptrs, mask=k2mask[:, None] & nmask[None, :], other=0.0)
        if DOT_F32:
            a2 = a2.to(tl.float32)
            b2 = b2.to(tl.float32)
        acc = tl.dot(a2, b2, acc, input_precision=PREC)
        if EPI == 1:
            bu2 = tl.load(b2_ptrs + b2_up, mask=k2mask[:, None] & nmask[None, :], other=0.0)
            if DOT_F32:
                bu2 = bu2.to(tl.float32)
            acc_u = tl.dot(a2, bu2, acc_u, input_precision=PREC)
    rows_epilogue(acc, acc_u, rows, rmask, cols, nmask, pid_n, c_ptr, h_ptr, w_ptr, wact_ptr, dwp_ptr, N, stride_cm,
                  stride_hm, NUM_N, EPI, STORE_H, NEED_DW)  # fmt: skip


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,  # [rows, M] row-major (contiguous in m)
    b_ptr,  # [rows', N] (rows gathered through b_idx when GATHER_B)
    b_idx_ptr,
    c_ptr,  # [E, M, N]
    offsets_ptr,
    M,
    N,
    stride_am,
    stride_bm,
    stride_ce,
    stride_cm,
    NUM_N,
    GATHER_B: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``C[e] = A[rows of e]^T @ B[rows of e]``: K is the expert's (variable) row count."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    pid_m = pid // NUM_N
    pid_n = pid % NUM_N
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = ms < M
    nmask = ns < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        r = r0 + ks
        rmask = r < end
        at = tl.load(
            a_ptr + r.to(tl.int64)[None, :] * stride_am + ms[:, None], mask=mmask[:, None] & rmask[None, :], other=0.0
        )
        if GATHER_B:
            brows = tl.load(b_idx_ptr + r, mask=rmask, other=0).to(tl.int64)
        else:
            brows = r.to(tl.int64)
        b = tl.load(b_ptr + brows[:, None] * stride_bm + ns[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        if DOT_F32:
            at = at.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(at, b, acc, input_precision=PREC)
    c = c_ptr + e.to(tl.int64) * stride_ce + ms.to(tl.int64)[:, None] * stride_cm + ns[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _combine_kernel(
    y_ptr,  # [rows, H] in sorted order
    pos_ptr,  # [T*k]: sorted position of each (token, slot)
    w_ptr,  # [T*k] routing weights (HAS_W)
    out_ptr,  # [T, H]
    H,
    k,
    stride_y,
    stride_o,
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, k):
        slot = t.to(tl.int64) * k + j
        r = tl.load(pos_ptr + slot).to(tl.int64)
        v = tl.load(y_ptr + r * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + slot).to(tl.float32)
        acc += v
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


# --- host side (no host reads: every size below is known from shapes) -------------------------------------


class Segment:
    """A second K segment of a rows GEMM (``_rows_gemm(second=...)``): ``a [rows, K2]`` in sorted order, ``b``
    with ``B2[e][k, n]`` at ``b_strides`` = (expert, k, n) strides, ``b_up`` the up block's offset (SwiGLU
    forward)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int], k: int, b_up: int = 0):
        self.a, self.b, self.b_strides, self.k, self.b_up = a, b, b_strides, k, b_up


def rank_block(r: int) -> int:
    """The tile that holds a LoRA rank ``r`` whole: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(max(int(r), 1)))


class _Routing:
    """Sorted order of the (token, slot) pairs and per-expert row ranges, all device tensors."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int):
        t, k = topk_ids.shape
        self.n = t * k
        self.k = k
        self.num_experts = num_experts
        flat = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        self.order = order
        self.token = torch.div(order, k, rounding_mode="floor").to(torch.int32)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        self.counts = counts
        offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
        offsets[1:] = torch.cumsum(counts, 0)
        self.offsets = offsets
        pos = torch.empty_like(order)
        pos.scatter_(0, order, torch.arange(self.n, device=flat.device))
        self.pos = pos
        self.rows_per_expert = self.n / max(num_experts, 1)
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(expert of each m-tile, its first sorted row, number of m-tiles) for ``block_m``; the grid is the
        host-known bound ``cdiv(n, block_m) + min(n, E)``; tiles past the end point at an empty range."""
        if block_m in self._tiles:
            return self._tiles[block_m]
        e_count = self.num_experts
        max_tiles = triton.cdiv(self.n, block_m) + min(self.n, e_count)
        dev = self.offsets.device
        per = torch.div(self.counts + block_m - 1, block_m, rounding_mode="floor")
        tile_end = torch.cumsum(per, 0)
        p = torch.arange(max_tiles, device=dev)
        expert = torch.searchsorted(tile_end, p, right=True)
        valid = expert < e_count
        ecl = expert.clamp(max=e_count - 1)
        first_tile = tile_end[ecl] - per[ecl]
        row = self.offsets[ecl] + (p - first_tile) * block_m
        row = torch.where(valid, row, torch.full_like(row, self.n))
        expert = torch.where(valid, ecl, torch.full_like(ecl, e_count - 1))
        out = (expert.to(torch.int32), row.to(torch.int32), max_tiles)
        self._tiles[block_m] = out
        return out


def _rows_gemm(
    route: _Routing,
    a: torch.Tensor,
    a_idx: torch.Tensor | None,
    b: torch.Tensor,
    b_strides: tuple[int, int, int],
    n: int,
    k: int,
    out: torch.Tensor,
    *,
    cfg: str,
    epi: int = 0,
    h: torch.Tensor | None = None,
    store_h: bool = False,
    b_up: int = 0,
    w_rows: torch.Tensor | None = None,
    wact: torch.Tensor | None = None,
    need_dw: bool = False,
    second: Segment | None = None,
    block_n: int | None = None,
) -> torch.Tensor | None:
    """One grouped GEMM over the sorted rows. ``epi=2`` (SwiGLU backward): ``a @ b`` is the unweighted d act, its
    rows are scaled by ``w_rows`` before the SwiGLU backward, ``wact`` gets ``w_rows * act`` (act recomputed from
    ``h``); ``need_dw`` then returns fp32 ``[rows, n-tiles]`` partial sums of ``<act, a @ b>`` per row (sum them
    over dim 1 for d topk_weights: deterministic, no atomics). ``second``: a LoRA branch's second K segment
    summed into the same product; ``block_n``: the n-tile when N is a LoRA rank (narrower than the configs')."""
    tma_cfg = None
    if second is None and block_n is None:
        tma_cfg = _tma_cfg(cfg, route.rows_per_expert, a.dtype, a.device)
    tma_plan = None if tma_cfg is None else _tma.plan(a, a_idx is not None, b, b_strides, b_up, epi)
    if tma_plan is not None:
        bm, bn = tma_cfg[0], tma_cfg[1]
    else:
        bm, bn, bk, warps, stages, group_m = _cfg(cfg, route.rows_per_expert, a.dtype)
    if block_n is not None:
        bn = block_n
    tile_expert, tile_row, m_tiles = route.tiles(bm)
    num_n = triton.cdiv(n, bn)
    h_arg = h if h is not None else out
    dw_part = torch.empty(route.n, num_n, device=out.device, dtype=torch.float32) if need_dw else None
    if tma_plan is not None:
        global tma_launches
        tma_launches += 1
        _tma.launch(m_tiles * num_n, a, a_idx, b, *tma_plan, out, h, w_rows, wact, dw_part, tile_expert, tile_row,
                    route.offsets, n, k, m_tiles, num_n, epi=epi, store_h=store_h, need_dw=need_dw,
                    dot_f32=interpreting(), cfg=tma_cfg)  # fmt: skip
        return dw_part
    seg = second if second is not None else Segment(out, out, (0, 0, 0), 0)
    _grouped_rows_kernel[(m_tiles * num_n,)](
        a, a_idx if a_idx is not None else tile_row, b, out, h_arg, w_rows if w_rows is not None else out,
        wact if wact is not None else out, dw_part if dw_part is not None else out, tile_expert, tile_row,
        route.offsets, seg.a, seg.b, n, k, seg.k, a.stride(0), *b_strides, b_up, seg.a.stride(0), *seg.b_strides,
        seg.b_up, out.stride(0), h_arg.stride(0), m_tiles, num_n, HAS_A2=second is not None,
        BLOCK_K2=rank_block(seg.k), GATHER_A=a_idx is not None, EPI=epi, STORE_H=store_h, NEED_DW=need_dw,
        DOT_F32=interpreting() and a.dtype != torch.float32, PREC=_prec(a.dtype), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=group_m, EVEN_K=k % bk == 0, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dw_part


def _wgrad_gemm(
    route: _Routing,
    a: torch.Tensor,
    b: torch.Tensor,
    b_idx: torch.Tensor | None,
    m: int,
    n: int,
    out: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    """``out[e] = a[rows of e]^T @ b[rows of e]`` (``b`` gathered through ``b_idx``); ``block_m`` / ``block_n``:
    the tile of a side that is a LoRA rank."""
    bm, bn, bk, warps, stages, _ = _cfg("wgrad", route.rows_per_expert, a.dtype)
    bm, bn = block_m or bm, block_n or bn
    num_n = triton.cdiv(n, bn)
    grid = (triton.cdiv(m, bm) * num_n, route.num_experts)
    _grouped_wgrad_kernel[grid](
        a, b, b_idx if b_idx is not None else route.offsets, out, route.offsets, m, n, a.stride(0), b.stride(0),
        out.stride(0), out.stride(1), num_n, GATHER_B=b_idx is not None,
        DOT_F32=interpreting() and a.dtype != torch.float32, PREC=_prec(a.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _combine(y: torch.Tensor, route: _Routing, w: torch.Tensor | None, t: int, h: int, dtype) -> torch.Tensor:
    out = torch.empty(t, h, device=y.device, dtype=dtype)
    if t == 0:
        return out
    block_h = 128 if interpreting() else 1024
    _combine_kernel[(t, triton.cdiv(h, block_h))](
        y, route.pos, w if w is not None else y, out, h, route.k, y.stride(0), out.stride(0),
        HAS_W=w is not None, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return out


def _forward(x, topk_ids, w_flat, gate_up, down, need_h: bool):
    t, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    route = _Routing(topk_ids, num_experts)
    n = route.n
    act = torch.empty(n, inter, device=x.device, dtype=x.dtype)
    h = torch.empty(n, two_i, device=x.device, dtype=x.dtype) if need_h else None
    y = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
    if n:
        # B[e][k, n] = gate_up[e][n, k]; the up block starts I rows further down gate_up[e].
        gu_strides = (gate_up.stride(0), gate_up.stride(2), gate_up.stride(1))
        _rows_gemm(route, x, route.token, gate_up, gu_strides, inter, hidden, act, cfg="up", epi=1, h=h,
                   store_h=need_h, b_up=inter * gate_up.stride(1))  # fmt: skip
        _rows_gemm(route, act, None, down, (down.stride(0), down.stride(2), down.stride(1)), hidden, inter, y,
                   cfg="down")  # fmt: skip
    out = _combine(y, route, w_flat, t, hidden, x.dtype)
    return out, route, h


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, gate_up, down):
        w_flat = topk_weights.reshape(-1).contiguous()
        need_grad = any(ctx.needs_input_grad)
        out, route, h = _forward(x, topk_ids, w_flat, gate_up, down, need_h=need_grad)
        if need_grad:
            ctx.route = route
            # act [T*k, I] and y [T*k, H] die here: the backward recomputes act from h in the d-act GEMM's epilogue,
            # and d topk_weights comes from act and the unweighted d act (module docstring).
            ctx.save_for_backward(x, w_flat, gate_up, down, h)
        ctx.w_shape, ctx.w_dtype = topk_weights.shape, topk_weights.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w_flat, gate_up, down, h = ctx.saved_tensors
        route: _Routing = ctx.route
        need_x, _, need_w, need_gu, need_down = ctx.needs_input_grad
        t, hidden = x.shape
        num_experts, two_i, _ = gate_up.shape
        inter = two_i // 2
        n = route.n
        dx = dw = dgu = ddown = None
        dy_rows = dy.index_select(0, route.token)  # [T*k, H] unweighted, sorted order: read in order by both GEMMs
        w_rows = w_flat[route.order]  # routing weight of each sorted row
        dh = torch.empty(n, two_i, device=x.device, dtype=x.dtype)
        wact = torch.empty(n, inter, device=x.device, dtype=x.dtype)
        dw_rows = torch.zeros(n, device=x.device, dtype=torch.float32)
        if n:
            # B[e][k, n] = down[e][k, n]: K = H, N = I. The epilogue sums <act, unweighted d act> per row and n-tile
            # (need_w), stores w * act (d down's B) and turns w * d act into (d gate, d up).
            dn_strides = (down.stride(0), down.stride(1), down.stride(2))
            dw_part = _rows_gemm(route, dy_rows, None, down, dn_strides, inter, hidden, dh, cfg="dact", epi=2, h=h,
                                 w_rows=w_rows, wact=wact, need_dw=need_w)  # fmt: skip
            if need_w:
                dw_rows = dw_part.sum(1)
        if need_w:
            dw = dw_rows[route.pos].to(w_flat.dtype).reshape(ctx.w_shape).to(ctx.w_dtype)
        if need_down:
            ddown = torch.empty(num_experts, hidden, inter, device=x.device, dtype=down.dtype)
            _wgrad_gemm(route, dy_rows, wact, None, hidden, inter, ddown)
        del wact, dy_rows  # the rest of the backward reads dh only
        if need_gu:
            dgu = torch.empty(num_experts, two_i, hidden, device=x.device, dtype=gate_up.dtype)
            _wgrad_gemm(route, dh, x, route.token, two_i, hidden, dgu)
        if need_x:
            dx_rows = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
            if n:
                # B[e][k, n] = gate_up[e][k, n]: K = 2I, N = H.
                _rows_gemm(route, dh, None, gate_up, (gate_up.stride(0), gate_up.stride(1), gate_up.stride(2)),
                           hidden, two_i, dx_rows, cfg="dx")  # fmt: skip
            dx = _combine(dx_rows, route, None, t, hidden, x.dtype)
        return dx, None, dw, dgu, ddown


def _check(x, topk_ids, topk_weights, gate_up, down) -> None:
    if x.dim() != 2 or topk_ids.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise UserError(
            "moe_experts wants x [T, H], topk_ids [T, k], topk_weights [T, k], gate_up [E, 2I, H], down [E, H, I]; "
            f"got x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, gate_up {tuple(gate_up.shape)}, "
            f"down {tuple(down.shape)}"
        )
    t, hidden = x.shape
    num_experts, two_i, h2 = gate_up.shape
    if (
        topk_ids.shape[0] != t
        or tuple(topk_weights.shape) != tuple(topk_ids.shape)
        or h2 != hidden
        or two_i % 2
        or tuple(down.shape) != (num_experts, hidden, two_i // 2)
    ):
        raise UserError(
            f"moe_experts shapes disagree: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
            f"{tuple(topk_weights.shape)}, gate_up {tuple(gate_up.shape)} (want [E, 2I, H]), down "
            f"{tuple(down.shape)} (want [E, H, I])"
        )
    if topk_ids.is_floating_point() or topk_ids.is_complex():
        raise UserError(f"moe_experts: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if x.dtype not in _DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise UserError(
            f"moe_experts (triton) wants x, gate_up and down in one of fp32/bf16/fp16, got {x.dtype}, "
            f"{gate_up.dtype}, {down.dtype}; cast the expert weights to the activation dtype"
        )


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``polyrl.kernels.moe.reference.moe_experts``; topk_ids must lie in ``[0, E)`` (not
    checked: checking would read the device). Differentiable in x, topk_weights, gate_up and down."""
    _check(x, topk_ids, topk_weights, gate_up, down)
    # The kernels index rows with a unit inner stride: make the last dims contiguous (no copy when they are).
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    return _MoEExperts.apply(x, topk_ids, topk_weights, gate_up, down)
