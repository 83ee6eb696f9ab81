"""Varlen causal flash attention in Triton: forward and backward, GQA, optional sliding window.

Packed sequences are addressed through ``cu_seqlens``: the grid is (query block, head, sequence) sized
by ``max_seqlen``, and programs past their sequence's end return at once, so mixed lengths pay no
padding. Key blocks that are fully masked (above the causal diagonal or left of the window) are never
visited; only the diagonal blocks pay for the mask. Online softmax in base 2 (the log-sum-exp, also in
base 2, is saved for the backward), fp32 accumulation, no [T, T] matrix.

Backward: a preprocess (``delta = rowsum(dO * O)``), a dK/dV kernel that owns one key block of one KV
head and walks all query heads of its GQA group (so dK/dV accumulate in registers, without atomics or
races), and a dQ kernel that walks key blocks. fp32 inputs use ``input_precision="ieee"`` dots (no TF32).

Head dims must be powers of two in 16..256; other head dims (and window < 1, which masks every key) go
to the SDPA/reference path or raise. This module does not pick itself: the registry does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton import knobs

from polyrl.errors import ConfigError
from polyrl.kernels.attention.sdpa import varlen_attention as _sdpa

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return bool(knobs.runtime.interpret)


def _configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples -> configs; one tiny config under the interpreter."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu]


_FIXED_CONFIG = [0]  # > 0 inside ``fixed_config()``


@contextlib.contextmanager
def fixed_config() -> Iterator[None]:
    """Inside: autotuning keeps only the last config of each list (it fits every head dim and dtype), so a new
    autotuning key costs one compile and no benchmarking. For correctness sweeps (``polyrl validate ops``),
    where compile time dominates. The choice is remembered per key for the rest of the process."""
    _FIXED_CONFIG[0] += 1
    try:
        yield
    finally:
        _FIXED_CONFIG[0] -= 1


def _prune(configs, named_args, **kwargs):
    """Drop tiles too big for shared memory / registers: head dim 256, or 128 in fp32 (4-byte elements)."""
    if _FIXED_CONFIG[0]:
        return configs[-1:]
    d = named_args["HEAD_DIM"] if "HEAD_DIM" in named_args else kwargs["HEAD_DIM"]
    width = d * (2 if named_args["Q"].dtype == torch.float32 else 1)
    keep = [c for c in configs if width < 256 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32]
    return keep or configs[-1:]


# Small lists (compile time grows with each entry); the last entry of each fits every head dim and dtype.
# Forward and dQ: BLOCK_M is a multiple of BLOCK_N (the diagonal of a query block is whole key blocks).
_FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)])
_DQ_CONFIGS = _configs([(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)])
# dK/dV: BLOCK_N (keys, held) is a multiple of BLOCK_M (queries, streamed).
_DKDV_CONFIGS = _configs([(64, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 3), (32, 32, 4, 2)])


# fmt: off
# (Kernel signatures stay compact: one argument per line would triple the length of this file.)
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, seq_len, qk_scale, window,
               MASK: tl.constexpr, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols[None, :] * stride_kt + offs_d[:, None]  # [D, BLOCK_N]
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]  # [BLOCK_N, D]
        if MASK:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < seq_len, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < seq_len, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        if MASK or WINDOW:
            allowed = cols[None, :] <= offs_m[:, None]
            if WINDOW:
                allowed = allowed & ((offs_m[:, None] - cols[None, :]) < window)
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=["seq_bucket", "HEAD_DIM", "GROUP", "WINDOW", "DOT_PREC"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU, qk_scale, window, seq_bucket,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Heaviest (last) query blocks first: causal work grows with the block index.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seq_start = tl.load(CU + b).to(tl.int64)
    seq_len = (tl.load(CU + b + 1) - tl.load(CU + b)).to(tl.int32)
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        return
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < seq_len
    q = tl.load(Q + (seq_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    k_base = K + seq_start * stride_kt + hk * stride_kh
    v_base = V + seq_start * stride_vt + hk * stride_vh

    # Finite start for the running max: rows that see no key in a block stay exact (p = 0, alpha = 1).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo = 0
    if WINDOW:
        lo = (tl.maximum(start_m - window + 1, 0) // BLOCK_N) * BLOCK_N
    # Key blocks strictly below the diagonal: no causal mask, always in bounds.
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, start_m, offs_m, seq_len,
                               qk_scale, window, False, WINDOW, HEAD_DIM, BLOCK_N, DOT_PREC)
    # Diagonal key blocks: causal mask and sequence bound.
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, start_m, hi, offs_m, seq_len,
                               qk_scale, window, True, WINDOW, HEAD_DIM, BLOCK_N, DOT_PREC)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + (seq_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_valid[:, None])
    tl.store(LSE + h * stride_lh + seq_start + offs_m, m_i + tl.math.log2(l_safe), mask=m_valid)


@triton.jit
def _bwd_preprocess(O, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh, stride_dh,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = offs_t < T
    o = tl.load(O + offs_t[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(DO + offs_t[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=valid[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + h * stride_dh + offs_t, delta, mask=valid)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, lo, hi, offs_n, seq_len,
                qk_scale, window, MASK: tl.constexpr, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_valid = offs_m < seq_len
        qt = tl.load(q_base + offs_m[None, :] * stride_qt + offs_d[:, None], mask=m_valid[None, :], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=m_valid[:, None], other=0.0)
        # lse = +inf past the sequence end makes p exactly 0 there.
        lse = tl.load(lse_base + offs_m, mask=m_valid, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=m_valid, other=0.0)
        pt = tl.math.exp2(tl.dot(k, qt, input_precision=DOT_PREC) * qk_scale - lse[None, :])  # [BLOCK_N, BLOCK_M]
        if MASK or WINDOW:
            allowed = offs_m[None, :] >= offs_n[:, None]
            if WINDOW:
                allowed = allowed & ((offs_m[None, :] - offs_n[:, None]) < window)
            pt = tl.where(allowed, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PREC)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=["seq_bucket", "HEAD_DIM", "GROUP", "WINDOW", "DOT_PREC"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, CU, qk_scale, sm_scale, window, seq_bucket,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)  # the first key blocks see the most queries: they start first
    hk = tl.program_id(1)
    b = tl.program_id(2)
    seq_start = tl.load(CU + b).to(tl.int64)
    seq_len = (tl.load(CU + b + 1) - tl.load(CU + b)).to(tl.int32)
    start_n = pid_n * BLOCK_N
    if start_n >= seq_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = offs_n < seq_len
    k = tl.load(K + (seq_start + offs_n[:, None]) * stride_kt + hk * stride_kh + offs_d[None, :],
                mask=n_valid[:, None], other=0.0)
    v = tl.load(V + (seq_start + offs_n[:, None]) * stride_vt + hk * stride_vh + offs_d[None, :],
                mask=n_valid[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    diag_hi = tl.minimum(start_n + BLOCK_N, seq_len)
    q_hi = seq_len
    if WINDOW:
        q_hi = tl.minimum(seq_len, start_n + BLOCK_N - 1 + window)
    # One program owns this key block for every query head of the group: no atomics, no races.
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + seq_start * stride_qt + h * stride_qh
        do_base = DO + seq_start * stride_dot + h * stride_doh
        lse_base = LSE + h * stride_lh + seq_start
        delta_base = DELTA + h * stride_lh + seq_start
        # Query blocks on the diagonal (causal mask), then those entirely below it.
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, start_n,
                             diag_hi, offs_n, seq_len, qk_scale, window, True, WINDOW, HEAD_DIM, BLOCK_M, DOT_PREC)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                             start_n + BLOCK_N, q_hi, offs_n, seq_len, qk_scale, window, False, WINDOW, HEAD_DIM,
                             BLOCK_M, DOT_PREC)
    dk = dk * sm_scale
    tl.store(DK + (seq_start + offs_n[:, None]) * stride_dkt + hk * stride_dkh + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=n_valid[:, None])
    tl.store(DV + (seq_start + offs_n[:, None]) * stride_dvt + hk * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=n_valid[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, seq_len, qk_scale,
              window, MASK: tl.constexpr, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT_PREC: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols[None, :] * stride_kt + offs_d[:, None]
        vt_ptrs = v_base + cols[None, :] * stride_vt + offs_d[:, None]
        if MASK:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < seq_len, other=0.0)
            vt = tl.load(vt_ptrs, mask=cols[None, :] < seq_len, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        p = tl.math.exp2(tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale - lse[:, None])
        if MASK or WINDOW:
            allowed = cols[None, :] <= offs_m[:, None]
            if WINDOW:
                allowed = allowed & ((offs_m[:, None] - cols[None, :]) < window)
            p = tl.where(allowed, p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PREC)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=["seq_bucket", "HEAD_DIM", "GROUP", "WINDOW", "DOT_PREC"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, CU, qk_scale, sm_scale, window, seq_bucket,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dqt, stride_dqh, stride_lh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    seq_start = tl.load(CU + b).to(tl.int64)
    seq_len = (tl.load(CU + b + 1) - tl.load(CU + b)).to(tl.int32)
    start_m = pid_m * BLOCK_M
    if start_m >= seq_len:
        return
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < seq_len
    q = tl.load(Q + (seq_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    do = tl.load(DO + (seq_start + offs_m[:, None]) * stride_dot + h * stride_doh + offs_d[None, :],
                 mask=m_valid[:, None], other=0.0)
    lse = tl.load(LSE + h * stride_lh + seq_start + offs_m, mask=m_valid, other=float("inf"))
    delta = tl.load(DELTA + h * stride_lh + seq_start + offs_m, mask=m_valid, other=0.0)
    k_base = K + seq_start * stride_kt + hk * stride_kh
    v_base = V + seq_start * stride_vt + hk * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo = 0
    if WINDOW:
        lo = (tl.maximum(start_m - window + 1, 0) // BLOCK_N) * BLOCK_N
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, start_m, offs_m, seq_len,
                   qk_scale, window, False, WINDOW, HEAD_DIM, BLOCK_N, DOT_PREC)
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, start_m, hi, offs_m, seq_len,
                   qk_scale, window, True, WINDOW, HEAD_DIM, BLOCK_N, DOT_PREC)
    dq = dq * sm_scale
    tl.store(DQ + (seq_start + offs_m[:, None]) * stride_dqt + h * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_valid[:, None])
# fmt: on


def _seq_bucket(max_seqlen: int) -> int:
    """Autotuning key for the sequence length: the power of two at or above it (at least 64)."""
    return 1 << max(6, (int(max_seqlen) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full-precision dots (TF32 would cost ~1e-3 relative error); bf16/fp16 ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ConfigError(f"triton attention supports head dims {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}")
    if q.shape[1] % k.shape[1] != 0 or k.shape != v.shape:
        raise ConfigError(
            f"attention needs q [T, Hq, D] and k/v [T, Hk, D] with Hq % Hk == 0; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if window is not None and window < 1:
        raise ConfigError(f"sliding window must be >= 1 (or None for full causal attention), got {window}")


def _lastdim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(q, k, v, cu_seqlens, max_seqlen, scale, window):
    T, Hq, D = q.shape
    B = cu_seqlens.shape[0] - 1
    o = torch.empty_like(q)
    lse = torch.empty((Hq, T), device=q.device, dtype=torch.float32)
    if T == 0 or B == 0 or max_seqlen == 0:
        return o, lse
    grid = lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_M"]), Hq, B)
    _fwd_kernel[grid](
        q, k, v, o, lse, cu_seqlens, scale * LOG2E, window or 0, _seq_bucket(max_seqlen),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        lse.stride(0),
        GROUP=Hq // k.shape[1], HEAD_DIM=D, WINDOW=window is not None, DOT_PREC=_dot_precision(q.dtype),
    )  # fmt: skip
    return o, lse


def _backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, window):
    T, Hq, D = q.shape
    Hk = k.shape[1]
    B = cu_seqlens.shape[0] - 1
    # Zeros, not empty: rows past cu_seqlens[-1] (if any) get no program and must read as zero gradients.
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if T == 0 or B == 0 or max_seqlen == 0:
        return dq, dk, dv
    delta = torch.empty_like(lse)
    pre_block = 16 if interpreting() else 64
    _bwd_preprocess[(triton.cdiv(T, pre_block), Hq)](
        o, do, delta, T, o.stride(0), o.stride(1), do.stride(0), do.stride(1), delta.stride(0),
        HEAD_DIM=D, BLOCK=pre_block,
    )  # fmt: skip
    common = dict(GROUP=Hq // Hk, HEAD_DIM=D, WINDOW=window is not None, DOT_PREC=_dot_precision(q.dtype))
    qk_scale = scale * LOG2E
    _bwd_dkdv_kernel[lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_N"]), Hk, B)](
        q, k, v, do, dk, dv, lse, delta, cu_seqlens, qk_scale, scale, window or 0, _seq_bucket(max_seqlen),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), **common,
    )  # fmt: skip
    _bwd_dq_kernel[lambda meta: (triton.cdiv(max_seqlen, meta["BLOCK_M"]), Hq, B)](
        q, k, v, do, dq, lse, delta, cu_seqlens, qk_scale, scale, window or 0, _seq_bucket(max_seqlen),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1), lse.stride(0), **common,
    )  # fmt: skip
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, window):
        o, lse = _forward(q, k, v, cu_seqlens, max_seqlen, scale, window)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.window = max_seqlen, scale, window
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        do = _lastdim_contiguous(do)
        dq, dk, dv = _backward(do, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.scale, ctx.window)
        return dq, dk, dv, None, None, None, None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence (see ``polyrl.kernels.varlen_attention``).

    Head dims outside ``SUPPORTED_HEAD_DIMS`` fall back to the SDPA implementation (same result).
    """
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return _sdpa(q, k, v, cu_seqlens, max_seqlen, scale, window)
    _check(q, k, v, window)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = (_lastdim_contiguous(t) for t in (q, k, v))
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return _VarlenAttention.apply(q, k, v, cu_seqlens, int(max_seqlen), scale, window)
