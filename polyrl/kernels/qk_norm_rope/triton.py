"""qk_norm_rope in Triton: one program per token normalises every q and k head (fp32 statistics over the whole head)
and rotates it, reading each head once and writing it once. Rounding as the unfused Triton kernels: ``(x * rstd)``
to the dtype, times the weight to the dtype, then the rotation in fp32 from those values with cos/sin cast to the
dtype, rounded once. q/k may be strided views with a contiguous head dim; outputs are new contiguous tensors.
``qk_norm_rope_cache`` (the decode step's) takes part in Programmatic Dependent Launch with ``POLYRL_PDL=1``
(``kernels/pdl.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.kernels import pdl
from polyrl.kernels.paged_attention.reference import FP8_E4M3_MAX, is_fp8
from polyrl.kernels.pdl import launch_dependents as pdl_launch_dependents
from polyrl.kernels.pdl import wait as pdl_wait


@triton.jit
def _norm_rotated(x_ptr, w_ptr, c1, c2, s1, s2, t, n_heads, half, stride_xt, stride_xh, eps, dt: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Heads of token ``t`` normalised and rotated: the two halves ``[BLOCK_H, BLOCK_D]`` in fp32, not yet rounded to
    ``dt`` (the caller's store rounds them once)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < n_heads) & (d[None, :] < half)
    x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_row, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * half) + eps)  # [BLOCK_H]
    w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
    n1 = ((x1 * rstd[:, None]).to(dt).to(tl.float32) * w1[None, :]).to(dt).to(tl.float32)
    n2 = ((x2 * rstd[:, None]).to(dt).to(tl.float32) * w2[None, :]).to(dt).to(tl.float32)
    return n1 * c1[None, :] - n2 * s1[None, :], n2 * c2[None, :] + n1 * s2[None, :]


@triton.jit
def _norm_rotate(x_ptr, o_ptr, w_ptr, c1, c2, s1, s2, t, n_heads, half, stride_xt, stride_xh, stride_ot, stride_oh,
                 eps, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    dt = o_ptr.dtype.element_ty
    o1, o2 = _norm_rotated(x_ptr, w_ptr, c1, c2, s1, s2, t, n_heads, half, stride_xt, stride_xh, eps, dt,
                           BLOCK_H, BLOCK_D)  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < n_heads) & (d[None, :] < half)
    o_row = o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o_row, o1.to(dt), mask=ok)
    tl.store(o_row + half, o2.to(dt), mask=ok)


@triton.jit
def _cache_store(c_ptr, slot, x1, x2, n_heads, half, stride_cb, stride_cs, stride_ch, dt: tl.constexpr,
                 PAGE: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Both halves of a token's heads into the paged cache at flat ``slot``, rounded to ``dt`` first (the tensor
    ``write_kv_cache`` would have been handed) and then as ``write_kv_cache`` stores (FP8: saturated to +-448)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < n_heads) & (d[None, :] < half)
    x1 = x1.to(dt)
    x2 = x2.to(dt)
    if FP8_MAX > 0:
        x1 = tl.clamp(x1.to(tl.float32), -FP8_MAX, FP8_MAX)
        x2 = tl.clamp(x2.to(tl.float32), -FP8_MAX, FP8_MAX)
    row = c_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(row, x1.to(c_ptr.dtype.element_ty), mask=ok)
    tl.store(row + half, x2.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, t, half, stride_ct, stride_st, d, dm, dt: tl.constexpr):
    """Token ``t``'s cos and sin, each as its two halves, cast to the model dtype and back to fp32 (as the
    reference rounds them)."""
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + half + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, n_q_heads, n_k_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct, stride_st,
    eps, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < half
    dt = qo_ptr.dtype.element_ty
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, t, half, stride_ct, stride_st, d, dm, dt)
    _norm_rotate(q_ptr, qo_ptr, wq_ptr, c1, c2, s1, s2, t, n_q_heads, half, stride_qt, stride_qh, stride_qot,
                 stride_qoh, eps, BLOCK_HQ, BLOCK_D)  # fmt: skip
    _norm_rotate(k_ptr, ko_ptr, wk_ptr, c1, c2, s1, s2, t, n_k_heads, half, stride_kt, stride_kh, stride_kot,
                 stride_koh, eps, BLOCK_HK, BLOCK_D)  # fmt: skip


@triton.jit
def _qk_norm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slots_ptr, n_q_heads, n_k_heads,
    half, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_ct,
    stride_st, stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, eps,
    PAGE: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)  # before any load or store (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < half
    dt = qo_ptr.dtype.element_ty
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, t, half, stride_ct, stride_st, d, dm, dt)
    _norm_rotate(q_ptr, qo_ptr, wq_ptr, c1, c2, s1, s2, t, n_q_heads, half, stride_qt, stride_qh, stride_qot,
                 stride_qoh, eps, BLOCK_HQ, BLOCK_D)  # fmt: skip
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        k1, k2 = _norm_rotated(k_ptr, wk_ptr, c1, c2, s1, s2, t, n_k_heads, half, stride_kt, stride_kh, eps, dt,
                               BLOCK_HK, BLOCK_D)  # fmt: skip
        _cache_store(kc_ptr, slot, k1, k2, n_k_heads, half, stride_kb, stride_ks, stride_kch, dt, PAGE, FP8_MAX,
                     BLOCK_HK, BLOCK_D)  # fmt: skip
        h = tl.arange(0, BLOCK_HK)
        ok = (h[:, None] < n_k_heads) & dm[None, :]
        v_row = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
        v1 = tl.load(v_row, mask=ok, other=0.0).to(tl.float32)
        v2 = tl.load(v_row + half, mask=ok, other=0.0).to(tl.float32)
        pdl_launch_dependents(PDL)  # the last load (a program with no slot triggers as it exits)
        _cache_store(vc_ptr, slot, v1, v2, n_k_heads, half, stride_vb, stride_vs, stride_vch, dt, PAGE, FP8_MAX,
                     BLOCK_HK, BLOCK_D)  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``polyrl.kernels.qk_norm_rope``; no autograd (inference)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_weight, k_weight)):
        raise RuntimeError("qk_norm_rope has no backward: call it with autograd off (decoding)")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(
            f"expected q [T, Hq, D] and k [T, Hk, D] with an even D, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    n_tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    half = head_dim // 2
    q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
    qo = torch.empty((n_tokens, n_q, head_dim), dtype=q.dtype, device=q.device)
    ko = torch.empty((n_tokens, n_k, head_dim), dtype=k.dtype, device=k.device)
    if n_tokens == 0:
        return qo, ko
    _qk_norm_rope_kernel[(n_tokens,)](
        q, k, q_weight.contiguous(), k_weight.contiguous(), cos, sin, qo, ko, n_q, n_k, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        cos.stride(0), sin.stride(0), eps,
        BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HK=triton.next_power_of_2(n_k),
        BLOCK_D=triton.next_power_of_2(half), num_warps=4,
    )  # fmt: skip
    return qo, ko


def qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """See ``polyrl.kernels.qk_norm_rope``: ``qk_norm_rope`` whose k (and the given v) go straight into the paged
    caches at ``slot_mapping`` (negative: skipped) instead of coming back; returns q'. No autograd, no host sync."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, q_weight, k_weight)):
        raise RuntimeError("qk_norm_rope_cache has no backward: call it with autograd off (decoding)")
    if q.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(
            f"expected q [T, Hq, D], k and v [T, Hk, D] with an even D, got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape or k_cache.stride(-1) != 1:
        raise ValueError(
            f"expected caches [blocks, block_size, {k.shape[1]}, {k.shape[2]}] contiguous in the head dim, got "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    n_tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    q, k, v, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin))
    qo = torch.empty((n_tokens, n_q, head_dim), dtype=q.dtype, device=q.device)
    if n_tokens == 0:
        return qo
    _qk_norm_rope_cache_kernel[(n_tokens,)](
        q, k, v, q_weight.contiguous(), k_weight.contiguous(), cos, sin, qo, k_cache, v_cache, slot_mapping, n_q, n_k,
        head_dim // 2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), qo.stride(0),
        qo.stride(1), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), eps,
        PAGE=k_cache.shape[1], FP8_MAX=FP8_E4M3_MAX if is_fp8(k_cache.dtype) else 0.0,
        BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HK=triton.next_power_of_2(n_k),
        BLOCK_D=triton.next_power_of_2(head_dim // 2), num_warps=4, **pdl.kernel_kwargs(qo.device),
    )  # fmt: skip
    return qo
