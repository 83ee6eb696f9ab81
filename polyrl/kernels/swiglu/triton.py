"""SwiGLU in Triton: ``silu(gate) * up`` forward and backward, one pass each, fp32 math, one rounding.

Forward reads gate and up once and writes the product; backward reads dy, gate and up once and writes
``dgate = dy * up * sig * (1 + gate * (1 - sig))`` and ``dup = dy * silu(gate)`` (``sig`` =
sigmoid(gate), recomputed rather than stored). gate/up are ``[..., I]`` and may be strided row views
(e.g. the two halves of a fused gate_up projection) as long as the last dim is contiguous; the tile is
``[BLOCK_M rows, BLOCK_N columns]`` of about 4096 elements, so rows of any width stream with wide loads.

Deliberately not here: in-place gradients into the gate/up buffers (saves memory, breaks autograd
expectations) and other activations (GeGLU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr,
    u_ptr,
    y_ptr,
    n_rows,
    n_cols,
    stride_g,
    stride_u,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr,
    g_ptr,
    u_ptr,
    dg_ptr,
    du_ptr,
    n_rows,
    n_cols,
    stride_dy,
    stride_g,
    stride_u,
    stride_d,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    r64 = rows.to(tl.int64)[:, None]
    dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(dg_ptr + r64 * stride_d + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + r64 * stride_d + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int, int]:
    """(grid, BLOCK_M, BLOCK_N, num_warps) for tiles of about 4096 elements."""
    # 1024 columns divide the usual widths (3072, 12288, ...) exactly: no half-empty edge blocks.
    block_n = min(1024, triton.next_power_of_2(max(n_cols, 1)))
    block_m = max(1, min(64, 4096 // block_n))
    num_warps = max(1, min(8, block_m * block_n // 512))
    return (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n)), block_m, block_n, num_warps


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        shape = gate.shape
        g2, u2 = _rows2d(gate), _rows2d(up)
        n_rows, n_cols = g2.shape
        y = torch.empty((n_rows, n_cols), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
        if y.numel():
            grid, bm, bn, warps = _grid(n_rows, n_cols)
            _swiglu_fwd_kernel[grid](
                g2, u2, y, n_rows, n_cols, g2.stride(0), u2.stride(0), y.stride(0),
                BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            )  # fmt: skip
        ctx.save_for_backward(g2, u2)
        ctx.shapes = (gate.shape, up.shape)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dy2 = _rows2d(dy)
        n_rows, n_cols = g2.shape
        dg = torch.empty((n_rows, n_cols), dtype=g2.dtype, device=g2.device)
        du = torch.empty((n_rows, n_cols), dtype=u2.dtype, device=u2.device)
        if dg.numel():
            grid, bm, bn, warps = _grid(n_rows, n_cols)
            _swiglu_bwd_kernel[grid](
                dy2, g2, u2, dg, du, n_rows, n_cols, dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0),
                BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            )  # fmt: skip
        return dg.view(ctx.shapes[0]), du.view(ctx.shapes[1])


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu(gate) * up`` with the reference's signature (gate and up of one shape)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu expects gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("swiglu expects tensors with at least one dimension")
    return _SwiGLUFn.apply(gate, up)
