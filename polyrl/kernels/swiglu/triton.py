"""SwiGLU in Triton: ``silu(gate) * up`` forward and backward, one pass each, fp32 math, one rounding.

Forward reads gate and up once and writes only the product; backward reads dy, gate and up once and writes
``dgate = dy * up * sig * (1 + gate * (1 - sig))`` and ``dup = dy * silu(gate)`` in the same pass
(``sig`` = sigmoid(gate), recomputed rather than stored).

Two launch shapes, same math:

- flat (the common case: gate and up come from separate projections, as in ``models/decoder.py``, so
  both are contiguous): the tensors are one 1-D stream, each program handles ``_FLAT_BLOCK`` elements
  with 8 warps (16 elements per thread: two or four 16-byte loads per operand), no row/column masks
  beyond the tail, 64-bit offsets.
- rows (gate/up are strided row views, e.g. the two halves of a fused gate_up projection, with the
  last dim contiguous): a 2-D ``[BLOCK_M rows, BLOCK_N columns]`` tile of about 4096 elements.

With ``POLYRL_PDL=1`` on a Hopper or newer GPU both forward kernels are launched with Programmatic Dependent Launch
(``kernels/pdl.py``); the backward kernels as before.

Deliberately not here: in-place gradients into the gate/up buffers (saves memory, breaks autograd
expectations) and other activations (GeGLU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels import pdl
from polyrl.kernels.pdl import launch_dependents as pdl_launch_dependents
from polyrl.kernels.pdl import wait as pdl_wait

# Elements per program of the flat kernels and their warps (bandwidth-bound: big blocks, few programs).
_FLAT_BLOCK = 4096
_FLAT_WARPS = 8


@triton.jit
def _flat_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # before any load or store (kernels/pdl.py)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(PDL)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flat_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(dg_ptr + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * silu).to(du_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_fwd_kernel(
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
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before any load or store (kernels/pdl.py)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(PDL)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_bwd_kernel(
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


def _rows_grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int, int]:
    """(grid, BLOCK_M, BLOCK_N, num_warps) for 2-D tiles of about 4096 elements."""
    # 1024 columns divide the usual widths (3072, 12288, ...) exactly: no half-empty edge blocks.
    block_n = min(1024, triton.next_power_of_2(max(n_cols, 1)))
    block_m = max(1, min(64, 4096 // block_n))
    num_warps = max(1, min(8, block_m * block_n // 512))
    return (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n)), block_m, block_n, num_warps


def _flat_ok(*ts: torch.Tensor) -> bool:
    return all(t.is_contiguous() for t in ts)


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    if _flat_ok(gate, up):
        y = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
        n = y.numel()
        if n:
            _flat_fwd_kernel[(triton.cdiv(n, _FLAT_BLOCK),)](
                gate, up, y, n, BLOCK=_FLAT_BLOCK, num_warps=_FLAT_WARPS, **pdl.kernel_kwargs(y.device)
            )  # fmt: skip
        return y
    g2, u2 = _rows2d(gate), _rows2d(up)
    n_rows, n_cols = g2.shape
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=gate.device)
    if y.numel():
        grid, bm, bn, warps = _rows_grid(n_rows, n_cols)
        _rows_fwd_kernel[grid](
            g2, u2, y, n_rows, n_cols, g2.stride(0), u2.stride(0), y.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **pdl.kernel_kwargs(y.device),
        )  # fmt: skip
    return y.view(gate.shape)


def _backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if not dg.numel():
        return dg, du
    if _flat_ok(gate, up):
        dy = dy.contiguous()  # a no-op for the usual cotangent
        n = dg.numel()
        _flat_bwd_kernel[(triton.cdiv(n, _FLAT_BLOCK),)](
            dy, gate, up, dg, du, n, BLOCK=_FLAT_BLOCK, num_warps=_FLAT_WARPS
        )  # fmt: skip
        return dg, du
    dy2, g2, u2 = _rows2d(dy), _rows2d(gate), _rows2d(up)
    dg2, du2 = dg.view(g2.shape), du.view(u2.shape)
    n_rows, n_cols = g2.shape
    grid, bm, bn, warps = _rows_grid(n_rows, n_cols)
    _rows_bwd_kernel[grid](
        dy2, g2, u2, dg2, du2, n_rows, n_cols, dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip
    return dg, du


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return _backward(dy, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu(gate) * up`` with the reference's signature (gate and up of one shape)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu expects gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("swiglu expects tensors with at least one dimension")
    return _SwiGLUFn.apply(gate, up)
