"""8-bit AdamW update in Triton: dequantise both moments, AdamW, requantise, in one pass over memory.

Each program owns ``ROWS`` quantisation blocks of ``BLOCK`` (256) elements, a ``[ROWS, BLOCK]`` tile: it reads the
weights, the gradient, the two uint8 states and the block absmaxes once, and writes the weights (and, for an fp32
master, the compute copy in bf16/fp16), the two requantised states and the new absmaxes once. Rounding to the
nearest code is an 8-step binary search over the 255 midpoints (a 1 KB table that stays in L1). Division and
square root are the IEEE-rounded ones (``div_rn``, ``sqrt_rn``) and fp fusion is off at launch, so the kernel
gives the bits of ``reference.adamw8bit_step`` (the op order is written there). Not here: multi-tensor launches
(one launch per parameter), stochastic rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels.adamw8bit.reference import BLOCK, StepScalars, num_blocks, tables

ROWS = 4


@triton.jit
def _nearest(x, mid_ptr):
    """Index of the nearest code value: the number of midpoints strictly below ``x`` (255 sorted midpoints)."""
    lo = tl.zeros(x.shape, dtype=tl.int32)
    for i in tl.static_range(8):
        cand = lo + (128 >> i)  # steps 128, 64, ..., 1: lo ends as the count (0..255)
        t = tl.load(mid_ptr + cand - 1)
        lo = tl.where(t < x, cand, lo)
    return lo


@triton.jit
def _adamw8bit_kernel(
    p_ptr,
    g_ptr,
    qm_ptr,
    am_ptr,
    qs_ptr,
    as_ptr,
    out_ptr,
    code_m_ptr,
    mid_m_ptr,
    code_s_ptr,
    mid_s_ptr,
    N,
    NB,
    beta1,
    omb1,
    beta2,
    omb2,
    eps,
    decay,
    step_size,
    rsqrt_bc2,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_OUT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # block indices [ROWS]
    offs = rows.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [ROWS, BLOCK]
    ok = offs < N
    row_ok = rows < NB
    p = tl.load(p_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    qm = tl.load(qm_ptr + offs, mask=ok, other=0).to(tl.int32)
    qs = tl.load(qs_ptr + offs, mask=ok, other=0).to(tl.int32)
    am = tl.load(am_ptr + rows, mask=row_ok, other=0.0)
    as_ = tl.load(as_ptr + rows, mask=row_ok, other=0.0)
    m = tl.load(code_m_ptr + qm) * am[:, None]
    s = tl.load(code_s_ptr + qs) * as_[:, None]
    v = s * s
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    s = tl.sqrt_rn(v)
    p = p * decay
    p = p - tl.math.div_rn(m, s * rsqrt_bc2 + eps) * step_size
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=ok)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=ok)
    # requantise; lanes past N decoded index 0 (code -1.0 for m): zero them so they never raise a block's absmax
    m = tl.where(ok, m, 0.0)
    s = tl.where(ok, s, 0.0)
    am_new = tl.max(tl.abs(m), axis=1)
    as_new = tl.max(s, axis=1)
    m_scale = tl.where(am_new > 0, am_new, 1.0)
    s_scale = tl.where(as_new > 0, as_new, 1.0)
    qm_new = _nearest(tl.math.div_rn(m, m_scale[:, None]), mid_m_ptr)
    qs_new = _nearest(tl.math.div_rn(s, s_scale[:, None]), mid_s_ptr)
    tl.store(qm_ptr + offs, qm_new.to(tl.uint8), mask=ok)
    tl.store(qs_ptr + offs, qs_new.to(tl.uint8), mask=ok)
    tl.store(am_ptr + rows, am_new, mask=row_ok)
    tl.store(as_ptr + rows, as_new, mask=row_ok)


@torch.no_grad()
def adamw8bit_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    sc: StepScalars,
    param_out: torch.Tensor | None = None,
) -> None:
    """Same contract as ``reference.adamw8bit_step`` (contiguous tensors on one device)."""
    n = param.numel()
    if not (param.is_contiguous() and grad.is_contiguous()) or grad.numel() != n:
        raise ValueError("adamw8bit: param and grad must be contiguous and of one size")
    if param_out is not None and (not param_out.is_contiguous() or param_out.numel() != n):
        raise ValueError("adamw8bit: param_out must be contiguous and of the parameter's size")
    if n == 0:
        return
    code_m, mid_m, code_s, mid_s = tables(param.device)
    nb = num_blocks(n)
    grid = (triton.cdiv(nb, ROWS),)
    _adamw8bit_kernel[grid](
        param,
        grad,
        state["qm"],
        state["am"],
        state["qs"],
        state["as"],
        param_out if param_out is not None else param,
        code_m,
        mid_m,
        code_s,
        mid_s,
        n,
        nb,
        sc.beta1,
        sc.one_minus_beta1,
        sc.beta2,
        sc.one_minus_beta2,
        sc.eps,
        sc.decay,
        sc.step_size,
        sc.rsqrt_bc2,
        BLOCK=BLOCK,
        ROWS=ROWS,
        HAS_OUT=param_out is not None,
        enable_fp_fusion=False,
    )
