"""rmsnorm_linear in Triton: the residual add, RMSNorm, projection and (optionally) SwiGLU of a decode step in one
launch, with the rounding points of the unfused ops (listed in the package docstring).

Program ``(pm, pn)`` owns output rows ``[pm * BLOCK_M, +BLOCK_M)`` and columns ``[pn * BLOCK_N, +BLOCK_N)``:

1. pass over K in ``BLOCK_K`` chunks: ``s = round(x + residual)``, the rows' fp32 sums of squares; the programs of
   column tile 0 store ``s`` as ``new_residual`` (one writer per row);
2. pass over K again (the rows are a few hundred KiB, L2-resident): ``a = round(round(s * rstd) * norm_weight)``,
   the weight tile ``[BLOCK_N, BLOCK_K]`` (and for SwiGLU the matching up tile ``I`` rows further), ``tl.dot``
   into fp32 accumulators;
   (fp32 inputs: IEEE dots, no TF32; under the CPU interpreter 16-bit operands are upcast to fp32 first, its
   16-bit dot being wrong - the products are exact either way);
3. round to the dtype; SwiGLU: ``silu(g) * u`` in fp32 from the rounded g and u, rounded once.

Every program re-reads its rows' x (and residual) in both passes - from L2, but at ``BLOCK_M = 64`` rows and
``BLOCK_N = 64`` columns that is 2-4x the bytes of its weight tile. ``tuning["one_pass"]`` (an experiment for
``scripts/decode_fusion_ab.py``, off by default, outside the contract's rounding points) reads them once:
``a = round(s * norm_weight)`` feeds the dot, the sums of squares are taken from the same tiles and ``rstd`` scales
the fp32 accumulator at the end (one rounding of the normalised activations fewer, so not bit-close to the unfused
ops; within bf16 rounding of them).

``tuning`` (``block_m``, ``block_n``, ``block_k``, ``num_warps``, ``num_stages``, ``one_pass``) overrides the launch
heuristics for ``scripts/decode_fusion_ab.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from polyrl.kernels.rmsnorm_linear.reference import check_args


@triton.jit
def _rmsnorm_linear_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_x,
    stride_r,
    stride_w,
    stride_y,
    stride_s,
    up_offset,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    DOT_F32: tl.constexpr,
    ONE_PASS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_x
    r_rows = r_ptr + rows64[:, None] * stride_r
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w

    s_rows_ok = rows < tl.where(pid_n == 0, M, 0)  # new_residual: column tile 0 writes it
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    if not ONE_PASS:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            mask = row_ok[:, None] & (k < K)[None, :]
            s = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_rows + k[None, :], mask=mask, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded as the rmsnorm op's residual add
                tl.store(s_ptr + rows64[:, None] * stride_s + k[None, :], s, mask=s_rows_ok[:, None] & (k < K)[None, :])
            sf = s.to(tl.float32)
            sumsq += tl.sum(sf * sf, axis=1)
    rstd = tl.rsqrt(sumsq / K + eps)  # (ONE_PASS: recomputed after the loop)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        mask = row_ok[:, None] & k_ok[None, :]
        s = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_rows + k[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if ONE_PASS:
                tl.store(s_ptr + rows64[:, None] * stride_s + k[None, :], s, mask=s_rows_ok[:, None] & k_ok[None, :])
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        if ONE_PASS:
            sf = s.to(tl.float32)
            sumsq += tl.sum(sf * sf, axis=1)
            a = (sf * nw[None, :]).to(dtype)  # rstd applied to the accumulator after the loop
        else:
            normed = (s.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
            a = (normed * nw[None, :]).to(dtype)  # the rmsnorm op's output, rounded
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
        if SWIGLU:
            wu = tl.load(w_rows + up_offset + k[None, :], mask=w_mask, other=0.0)
        if DOT_F32:  # the interpreter's 16-bit dot is wrong; fp32 operands hold the same (exact) products
            a = a.to(tl.float32)
            w = w.to(tl.float32)
            if SWIGLU:
                wu = wu.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)
        if SWIGLU:
            acc_up = tl.dot(a, tl.trans(wu), acc_up, input_precision=DOT_PREC)
    if ONE_PASS:
        rstd = tl.rsqrt(sumsq / K + eps)
        acc = acc * rstd[:, None]
        if SWIGLU:
            acc_up = acc_up * rstd[:, None]

    out = acc.to(dtype)
    if SWIGLU:
        g = out.to(tl.float32)
        u = acc_up.to(dtype).to(tl.float32)  # gate and up rounded as the GEMM's outputs are
        out = (g * tl.sigmoid(g) * u).to(dtype)
    y = y_ptr + rows64[:, None] * stride_y + cols[None, :]
    tl.store(y, out, mask=row_ok[:, None] & col_ok[None, :])


def launch_config(m: int, n_out: int, k: int, swiglu: bool) -> dict:
    """The default tiles: 64 (or fewer, at least 16) rows, 64 output columns (32 when that leaves fewer programs
    than about one wave of an H200), 64-wide K chunks, 4 warps, 3 stages."""
    block_m = max(16, min(64, triton.next_power_of_2(max(m, 1))))
    block_n = 64
    if triton.cdiv(m, block_m) * triton.cdiv(n_out, block_n) < 128:
        block_n = 32
    return {"block_m": block_m, "block_n": block_n, "block_k": 64, "num_warps": 4, "num_stages": 3}


def _interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(knobs.runtime.interpret)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rmsnorm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    epilogue: str = "none",
    tuning: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's signature and results (see the package docstring); x, residual, norm_weight and weight of
    one dtype. ``tuning`` overrides ``launch_config``'s keys."""
    check_args(x, residual, norm_weight, weight, epilogue)
    dtypes = {t.dtype for t in (x, norm_weight, weight) + ((residual,) if residual is not None else ())}
    if len(dtypes) != 1:
        raise ValueError(f"rmsnorm_linear (triton): x, residual, norm_weight and weight must share a dtype: {dtypes}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, norm_weight, weight)):
        raise ValueError("rmsnorm_linear is inference-only: run it under torch.no_grad() / inference_mode()")
    x = _rows(x)
    weight = _rows(weight)
    norm_weight = norm_weight.contiguous()
    m, k = x.shape
    swiglu = epilogue == "swiglu"
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    has_res = residual is not None
    if has_res:
        r = _rows(residual)
        s = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        r, s = x, x
    cfg = dict(launch_config(m, n_out, k, swiglu), **(tuning or {}))
    if m > 0 and n_out > 0:
        grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n_out, cfg["block_n"]))
        _rmsnorm_linear_kernel[grid](
            x, r, norm_weight, weight, y, s, m, n_out, k,
            x.stride(0), r.stride(0), weight.stride(0), y.stride(0), s.stride(0),
            n_out * weight.stride(0), float(eps),
            HAS_RESIDUAL=has_res, SWIGLU=swiglu, DOT_F32=_interpreting() and x.dtype != torch.float32,
            ONE_PASS=bool(cfg.get("one_pass", False)), DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    return y, (s if has_res else None)
