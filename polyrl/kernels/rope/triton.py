"""Rotate-half RoPE in Triton: q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in one launch, forward and backward.

With ``x = [x1, x2]`` (halves of the head dim) and cos/sin ``[T, D]`` as built by ``rope_cos_sin``
(cast to q's dtype first, as the reference does), the forward is
``out1 = x1 * cos1 - x2 * sin1``, ``out2 = x2 * cos2 + x1 * sin2``, computed in fp32 and rounded once.
The backward is the transpose (the inverse rotation when the halves of cos/sin agree):
``dx1 = g1 * cos1 + g2 * sin2``, ``dx2 = g2 * cos2 - g1 * sin1`` -- the same kernel with the sin
halves swapped and negated. Each program handles a block of tokens and all heads of q and k, so
cos/sin are read once per token and every load is a whole contiguous half head.

q/k may be strided views (e.g. slices of a fused qkv projection) as long as the head dim is
contiguous; outputs are new contiguous tensors.

Deliberately not here: gradients for cos/sin (they come from positions and never need one -- they are
returned as None), the interleaved (GPT-J) convention, and in-place rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_tile(
    x_ptr,
    o_ptr,
    c1,
    c2,
    sa,
    sb,
    t_offs,
    t_ok,
    n_heads,
    half,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None, None] & (h[None, :, None] < n_heads) & (d[None, None, :] < half)
    t64 = t_offs.to(tl.int64)
    x_off = t64[:, None, None] * stride_xt + h[None, :, None] * stride_xh + d[None, None, :]
    o_off = t64[:, None, None] * stride_ot + h[None, :, None] * stride_oh + d[None, None, :]
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[:, None, :] - x2 * sa[:, None, :]
    o2 = x2 * c2[:, None, :] + x1 * sb[:, None, :]
    tl.store(o_ptr + o_off, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + o_off + half, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    n_tokens,
    n_q_heads,
    n_k_heads,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_ct,
    stride_st,
    BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    t_offs = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t_offs < n_tokens
    d = tl.arange(0, BLOCK_D)
    cs_mask = t_ok[:, None] & (d[None, :] < half)
    t64 = t_offs.to(tl.int64)
    c_off = t64[:, None] * stride_ct + d[None, :]
    s_off = t64[:, None] * stride_st + d[None, :]
    # The reference casts cos/sin to q's dtype before multiplying: same rounding here.
    dt = qo_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + c_off, mask=cs_mask, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + c_off + half, mask=cs_mask, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + s_off, mask=cs_mask, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + s_off + half, mask=cs_mask, other=0.0).to(dt).to(tl.float32)
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    _rotate_tile(
        q_ptr, qo_ptr, c1, c2, sa, sb, t_offs, t_ok, n_q_heads, half,
        stride_qt, stride_qh, stride_qot, stride_qoh, BLOCK_HQ, BLOCK_D,
    )  # fmt: skip
    _rotate_tile(
        k_ptr, ko_ptr, c1, c2, sa, sb, t_offs, t_ok, n_k_heads, half,
        stride_kt, stride_kh, stride_kot, stride_koh, BLOCK_HK, BLOCK_D,
    )  # fmt: skip


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, cos, sin, backward: bool):
    """Rotate (or un-rotate) q/k into new contiguous tensors."""
    n_tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    half = head_dim // 2
    q, k, cos, sin = (_unit_last(t) for t in (q, k, cos, sin))
    qo = torch.empty((n_tokens, n_q, head_dim), dtype=q.dtype, device=q.device)
    ko = torch.empty((n_tokens, n_k, head_dim), dtype=k.dtype, device=k.device)
    if n_tokens == 0:
        return qo, ko
    block_d = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    per_token = 2 * (block_hq + block_hk) * block_d  # elements of q + k per token
    block_t = max(1, min(64, triton.next_power_of_2(max(1, 8192 // per_token))))
    # A power of two (Triton requires it): about 1024 elements per warp, at most 8 warps.
    num_warps = min(8, triton.next_power_of_2(max(1, block_t * per_token // 1024)))
    _rope_kernel[(triton.cdiv(n_tokens, block_t),)](
        q, k, cos, sin, qo, ko, n_tokens, n_q, n_k, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        cos.stride(0), sin.stride(0),
        BACKWARD=backward, BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
        num_warps=num_warps,
    )  # fmt: skip
    return qo, ko


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = _launch(dq, dk, cos, sin, backward=True)
        return dq_in, dk_in, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Triton rotate-half RoPE with the reference's signature; returns new ``(q, k)``."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rope expects q [T, Hq, D] and k [T, Hk, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"apply_rope needs an even head dim, got {q.shape[2]}")
    if cos.shape != (q.shape[0], q.shape[2]) or sin.shape != cos.shape:
        raise ValueError(f"apply_rope expects cos/sin [T, D] = {(q.shape[0], q.shape[2])}, got {tuple(cos.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"apply_rope expects q and k of one dtype, got {q.dtype} and {k.dtype}")
    return _RopeFn.apply(q, k, cos, sin)
