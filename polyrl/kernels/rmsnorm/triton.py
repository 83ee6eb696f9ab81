"""RMSNorm in Triton: forward and backward, optional fused residual add, same numerics as the reference.

Forward, per row of ``x [N, H]`` (leading dims flattened): ``s = x + residual`` (rounded to x's dtype,
as the reference adds in that dtype), ``rstd = rsqrt(mean(s_f32^2) + eps)`` in fp32,
``y = weight * (s_f32 * rstd).to(x.dtype)`` computed in fp32 and rounded once to the promoted dtype
of weight and x. One pass over the data; several rows per program when rows are short, so that each
program moves a few KiB per load (wide vectorised loads keep an H200 near copy bandwidth).

Backward (rounding of the normalised value treated as identity, as autograd does for ``.to()``):
``dn = dy * w``, ``n = s_f32 * rstd``, ``ds = rstd * (dn - n * mean(dn * n))`` (+ the gradient of the
returned sum when residual is fused; x and residual both receive ``ds``). The weight gradient
``sum_rows(dy * n_rounded)`` is accumulated in fp32 per program (a persistent grid of about two
programs per multiprocessor), written as ``[P, H]`` partial sums and reduced by one small torch sum; a frozen
weight (LoRA) skips it.

With ``POLYRL_PDL=1`` on a Hopper or newer GPU the forward kernel is launched with Programmatic Dependent Launch
(``kernels/pdl.py``: it waits for its predecessor before touching memory); the backward is launched as before.

Deliberately not here: rows longer than 65536 elements (one row must fit one block), a weight offset
(Gemma's ``1 + w``), and in-place variants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels import pdl
from polyrl.kernels.pdl import launch_dependents as pdl_launch_dependents
from polyrl.kernels.pdl import wait as pdl_wait
from polyrl.platform import device as platform_device

_MAX_BLOCK_N = 65536


@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before any load or store (kernels/pdl.py)
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # The reference adds in x's dtype: round the sum before the statistics.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + rows64[:, None] * stride_s + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)  # [BLOCK_M]
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    pdl_launch_dependents(PDL)
    y = w[None, :] * normed
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr,
    ds_ptr,
    s_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    n_rows,
    n_cols,
    stride_dy,
    stride_ds,
    stride_s,
    stride_dx,
    HAS_DSUM: tl.constexpr,
    NEED_DW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        s = tl.load(s_ptr + rows64[:, None] * stride_s + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        n = s.to(tl.float32) * rstd[:, None]
        if NEED_DW:
            dw_acc += dy * n.to(s_ptr.dtype.element_ty).to(tl.float32)
        dn = dy * w[None, :]
        mean_dn_n = tl.sum(dn * n, axis=1) / n_cols
        ds = rstd[:, None] * (dn - n * mean_dn_n[:, None])
        if HAS_DSUM:
            ds += tl.load(ds_ptr + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], ds.to(dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        tl.store(dw_part_ptr + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` -> ``[N, H]`` with unit column stride (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def forward_tiling(n_cols: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): about 16 KiB of input per program, rows in whole powers of two."""
    block_n = triton.next_power_of_2(n_cols)
    if block_n > _MAX_BLOCK_N:
        raise ValueError(f"rmsnorm triton kernel supports rows up to {_MAX_BLOCK_N} elements, got {n_cols}")
    block_m = max(1, min(16, (16384 // elem_bytes) // block_n))
    num_warps = max(1, min(16, block_m * block_n // 512))
    return block_m, block_n, num_warps


def _bwd_tiling(n_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per multiprocessor) of the persistent backward: tiles of about 4096
    elements (at most 16 rows), one warp per 1024 of them, 8 programs a multiprocessor. From
    ``scripts/rmsnorm_sweep.py`` on the H200 at 32k tokens (run29): hidden 1024 with the fused residual 82.9 us (77%
    of copy bandwidth) against 106.5 us with the forward's 16 KiB / 16-warp tiles and 2 programs a multiprocessor;
    Qwen3's q / k norms over 128-wide heads 114 / 66 us (84% / 73%) against 202 / 109 us (16 rows, 2 warps)."""
    block_n = triton.next_power_of_2(n_cols)
    if block_n > _MAX_BLOCK_N:
        raise ValueError(f"rmsnorm triton kernel supports rows up to {_MAX_BLOCK_N} elements, got {n_cols}")
    block_m = max(1, min(16, 4096 // block_n))
    num_warps = max(1, min(16, block_m * block_n // 1024))
    return block_m, block_n, num_warps, 8


def _num_programs(device: torch.device, n_blocks: int, per_sm: int = 2) -> int:
    """Persistent grid size for the backward: ``per_sm`` programs per multiprocessor (the CPU counts 2)."""
    return max(1, min(n_blocks, per_sm * platform_device.multiprocessors(device, default=2)))


def rmsnorm_backward(
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_dw: bool,
    tuning: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(ds [N, H], dw [H] or None)`` from the saved ``s`` (the normalised input, ``[N, H]``) and ``rstd``, the
    output gradient ``dy`` and (fused residual) the returned sum's gradient ``dsum``. ``tuning`` overrides the
    launch heuristics for ``scripts/rmsnorm_sweep.py``: ``block_m`` (rows per iteration), ``num_warps``,
    ``per_sm`` (persistent programs per multiprocessor)."""
    tuning = tuning or {}
    n_rows, n_cols = s.shape
    dy2 = _rows2d(dy)
    ds2 = _rows2d(dsum) if dsum is not None else dy2
    dx = torch.empty((n_rows, n_cols), dtype=s.dtype, device=s.device)
    block_m, block_n, warps, per_sm = _bwd_tiling(n_cols)
    block_m = tuning.get("block_m", block_m)
    warps = tuning.get("num_warps", warps)
    n_prog = _num_programs(s.device, max(1, triton.cdiv(n_rows, block_m)), tuning.get("per_sm", per_sm))
    # Every program stores its whole row of partial sums (zeros if it got no rows): no memset needed.
    dw_part = torch.empty((n_prog if need_dw else 1, n_cols), dtype=torch.float32, device=s.device)
    if n_rows == 0:
        dw_part.zero_()
    else:
        _rmsnorm_bwd_kernel[(n_prog,)](
            dy2, ds2, s, weight, rstd, dx, dw_part, n_rows, n_cols,
            dy2.stride(0), ds2.stride(0), s.stride(0), dx.stride(0),
            HAS_DSUM=dsum is not None, NEED_DW=need_dw, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )  # fmt: skip
    return dx, (dw_part.sum(0).to(weight.dtype) if need_dw else None)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        shape = x.shape
        ctx.in_dtypes = (x.dtype, residual.dtype if residual is not None else None)
        if residual is not None and residual.dtype != x.dtype:
            # The reference's x + residual promotes; the sum (and its statistics) live in that dtype.
            x = x.to(torch.promote_types(x.dtype, residual.dtype))
        x2 = _rows2d(x)
        n_rows, n_cols = x2.shape
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        has_res = residual is not None
        if has_res:
            r2 = _rows2d(residual.to(x.dtype))  # no-op unless residual is the narrower one
            s = torch.empty_like(x2, memory_format=torch.contiguous_format)
        else:
            r2, s = x2, x2
        block_m, block_n, warps = forward_tiling(n_cols, x.element_size())
        if n_rows > 0:
            _rmsnorm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
                x2, r2, weight, y, s, rstd, n_rows, n_cols,
                x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), float(eps),
                HAS_RESIDUAL=has_res, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                **pdl.kernel_kwargs(x2.device),
            )  # fmt: skip
        ctx.save_for_backward(s, weight, rstd)
        ctx.has_res = has_res
        ctx.shape = shape
        if has_res:
            return y.view(shape[:-1] + (n_cols,)), s.view(shape)
        return y.view(shape[:-1] + (n_cols,))

    @staticmethod
    def backward(ctx, dy, dsum=None):
        s, weight, rstd = ctx.saved_tensors
        has_dsum = ctx.has_res and dsum is not None
        # a frozen norm (LoRA) skips the weight gradient and its reduction
        dx, dw = rmsnorm_backward(dy, dsum if has_dsum else None, s, weight, rstd, ctx.needs_input_grad[1])
        dx = dx.view(ctx.shape)
        x_dtype, res_dtype = ctx.in_dtypes
        if ctx.has_res:
            return dx.to(x_dtype), dw, None, dx.to(res_dtype)
        return dx.to(x_dtype), dw, None, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """Triton RMSNorm with the reference's signature: ``y`` or, with ``residual``, ``(y, x + residual)``."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rmsnorm: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rmsnorm: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    return _RMSNormFn.apply(x, weight, eps, residual)
