"""What moe_experts' rows GEMMs (``triton._grouped_rows_kernel`` and the TMA variant ``tma._grouped_rows_tma_kernel``)
share: the tile a program computes and the epilogue on it, ``@triton.jit`` functions inlined into each kernel."""

import triton
import triton.language as tl


@triton.jit
def tile_rows(
    pid, NUM_M, NUM_N, GROUP_M: tl.constexpr, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M: tl.constexpr
):
    """Program ``pid``'s tile: ``(pid_n, expert, first row, the expert's row end, rows, row mask)``. GROUP_M
    consecutive m-tiles (an expert's few tiles and its neighbours') sweep the n-tiles together, m fastest: the programs
    sharing an expert's weight tile run side by side and read it from L2, not HBM."""
    per_group = GROUP_M * NUM_N
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(NUM_M - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    e = tl.load(tile_expert_ptr + pid_m)
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    return pid_n, e, row0, row_end, rows, rows < row_end


@triton.jit
def rows_epilogue(
    acc, acc_u, rows, rmask, cols, nmask, pid_n, c_ptr, h_ptr, w_ptr, wact_ptr, dwp_ptr, N, stride_cm, stride_hm,
    NUM_N, EPI: tl.constexpr, STORE_H: tl.constexpr, NEED_DW: tl.constexpr,
):  # fmt: skip
    """The rows GEMMs' epilogue on a (BLOCK_M rows, BLOCK_N columns) tile: EPI 0 stores C; 1: SwiGLU forward (``acc``
    the gate, ``acc_u`` the up columns; h stored too with STORE_H); 2: SwiGLU backward (``acc`` the unweighted d act,
    dy[token] @ down[e], whose masked rows and columns hold zeros): d gate and d up, w * act for the d down weight
    gradient, and with NEED_DW this n-tile's share of d topk_weights."""
    r64 = rows.to(tl.int64)[:, None]
    mask = rmask[:, None] & nmask[None, :]
    if EPI == 0:
        tl.store(c_ptr + r64 * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    elif EPI == 1:
        g16 = acc.to(c_ptr.dtype.element_ty)
        u16 = acc_u.to(c_ptr.dtype.element_ty)
        if STORE_H:
            tl.store(h_ptr + r64 * stride_hm + cols[None, :], g16, mask=mask)
            tl.store(h_ptr + r64 * stride_hm + N + cols[None, :], u16, mask=mask)
        g = g16.to(tl.float32)
        act = g * tl.sigmoid(g) * u16.to(tl.float32)
        tl.store(c_ptr + r64 * stride_cm + cols[None, :], act.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        g = tl.load(h_ptr + r64 * stride_hm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + r64 * stride_hm + N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        # the forward's act, bit for bit (same expression on the same rounded g and u)
        act = (g * sig * u).to(c_ptr.dtype.element_ty).to(tl.float32)
        if NEED_DW:
            # d w[r] = <y[r], dy[token]> = <act[r], dy[token] @ down[e]>
            tl.store(dwp_ptr + rows.to(tl.int64) * NUM_N + pid_n, tl.sum(act * acc, axis=1), mask=rmask)
        w = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(wact_ptr + r64 * N + cols[None, :], (act * w).to(c_ptr.dtype.element_ty), mask=mask)
        acc = acc * w
        dg = acc * u * sig * (1.0 + g * (1.0 - sig))
        du = acc * g * sig
        tl.store(c_ptr + r64 * stride_cm + cols[None, :], dg.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(c_ptr + r64 * stride_cm + N + cols[None, :], du.to(c_ptr.dtype.element_ty), mask=mask)
