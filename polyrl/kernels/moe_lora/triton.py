"""moe_experts_lora in Triton (the grouped GEMMs of ``polyrl.kernels.moe.triton``): the routed experts with a LoRA
adapter per expert on ``gate_up`` and/or ``down``, without materialising the adapted weights and without the frozen
base's weight gradients.

``W'_e = W_e + s * B_e @ A_e`` is never built. Each projection's rows GEMM (``triton._grouped_rows_kernel``) takes a
second K segment: the rank-r rows ``z = s * (a_rows @ A_e^T)`` against ``B_e^T``, summed into the same accumulator,
so the fused epilogues (SwiGLU forward, SwiGLU backward with ``d topk_weights``, the un-permute) see the adapted
product as in ``moe_experts``. Per sorted row ``r`` of expert ``e`` (token ``t``, routing weight ``w_r``; all
rank-r GEMMs are grouped GEMMs over the same sorted rows, N or M = r):

Forward
    ``za = s * x[t] @ A_gu_e^T``; ``h = x[t] @ W_gu_e^T + za @ B_gu_e^T``; ``act = silu(g) * u``;
    ``zd = s * act @ A_dn_e^T``; ``y = act @ W_dn_e^T + zd @ B_dn_e^T``; ``out[t] = sum w_r y_r``.
    Saved: the inputs, ``h`` ``[T*k, 2I]``, ``za`` and ``zd`` (``[T*k, r]`` each).
Backward (``dyr = dy[t]``, unweighted)
    ``q = s * dyr @ B_dn_e``; the d-act GEMM ``dyr @ W_dn_e + q @ A_dn_e`` with its epilogue as in ``moe_experts``
    (``w * act``, ``dh``, ``d w``); ``d A_dn_e = q_e^T @ (w act)_e``; ``d B_dn_e = dyr_e^T @ (w zd)_e``;
    ``p = s * dh @ B_gu_e``; ``d A_gu_e = p_e^T @ x[t]_e``; ``d B_gu_e = dh_e^T @ za_e``;
    ``dx = unpermute(dh @ W_gu_e + p @ A_gu_e)``.

Against the materialised path (``W'`` then ``moe_experts``) this drops the two ``[E, out, in]`` temporaries per
projection and forward (and their backward) and the two full weight-gradient GEMMs of the base, a third of the
experts' training FLOPs; it adds eight thin grouped GEMMs (N, M or K = r): ``za`` and ``zd`` forward, ``q`` and
``p`` and the four factor gradients backward. The base's own gradients are
not computed here (a frozen base: LoRA): use ``moe_experts`` for full fine-tuning. The rank must fit one tile
(``MAX_RANK``): a wider adapter goes through the materialised path (``W'``, then ``moe_experts``).
"""

from __future__ import annotations

import torch

from polyrl.errors import UserError
from polyrl.kernels.moe.triton import (
    _DTYPES,
    Segment,
    _check,
    _combine,
    _Routing,
    _rows_gemm,
    _wgrad_gemm,
    rank_block,
)
from polyrl.kernels.moe_lora import materialized
from polyrl.kernels.moe_lora.reference import frozen_base

MAX_RANK = 128  # the rank-r segment is one K tile of the rows GEMMs


def _adapter(a, b, e, out_f, in_f, name):
    """Check one projection's adapter ``(A [E, r, in], B [E, out, r])``; its rank (0 when absent)."""
    if a is None and b is None:
        return 0
    if a is None or b is None:
        raise UserError(f"moe_experts_lora: {name} needs both A and B (or neither)")
    r = a.shape[1] if a.dim() == 3 else -1
    if a.dim() != 3 or b.dim() != 3 or tuple(a.shape) != (e, r, in_f) or tuple(b.shape) != (e, out_f, r):
        raise UserError(
            f"moe_experts_lora: {name} adapter shapes must be A [E, r, in] = [{e}, r, {in_f}] and B [E, out, r] = "
            f"[{e}, {out_f}, r]; got A {tuple(a.shape)}, B {tuple(b.shape)}"
        )
    if r < 1:  # above MAX_RANK: moe_experts_lora takes the materialised path
        raise UserError(f"moe_experts_lora: rank {r} of {name} is outside 1..{MAX_RANK} (the fused path's tile)")
    return r


def _thin(route: _Routing, a, a_idx, b, b_strides, r: int, k: int, dtype, scale: float) -> torch.Tensor:
    """``scale * a_rows @ B_e`` with N = r: the rank-r rows of a LoRA branch, ``[T*k, r]`` in ``dtype``."""
    out = torch.empty(route.n, r, device=a.device, dtype=torch.float32)  # scaled in fp32: one rounding to dtype
    if route.n:
        _rows_gemm(route, a, a_idx, b, b_strides, r, k, out, cfg="dact", block_n=rank_block(r))
    return (out * scale).to(dtype)


class _MoEExpertsLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, gate_up, down, gu_a, gu_b, dn_a, dn_b, scale):
        t, hidden = x.shape
        num_experts, two_i, _ = gate_up.shape
        inter = two_i // 2
        route = _Routing(topk_ids, num_experts)
        n = route.n
        w_flat = topk_weights.reshape(-1).contiguous()
        r_gu = gu_a.shape[1] if gu_a is not None else 0
        r_dn = dn_a.shape[1] if dn_a is not None else 0
        need_grad = any(ctx.needs_input_grad)
        act = torch.empty(n, inter, device=x.device, dtype=x.dtype)
        h = torch.empty(n, two_i, device=x.device, dtype=x.dtype) if need_grad else None
        y = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
        za = zd = seg = None
        if r_gu:  # (every rank-r product exists, empty, when no row is routed: the backward reads them)
            # A[e][k, n] = gu_a[e][n, k] (K = H, N = r); the segment's B2[e][k, n] = gu_b[e][n, k], up I rows on
            za = _thin(route, x, route.token, gu_a, (gu_a.stride(0), gu_a.stride(2), gu_a.stride(1)), r_gu, hidden,
                       x.dtype, scale)  # fmt: skip
            seg = Segment(za, gu_b, (gu_b.stride(0), gu_b.stride(2), gu_b.stride(1)), r_gu, inter * gu_b.stride(1))
        if n:
            gu_strides = (gate_up.stride(0), gate_up.stride(2), gate_up.stride(1))
            _rows_gemm(route, x, route.token, gate_up, gu_strides, inter, hidden, act, cfg="up", epi=1, h=h,
                       store_h=need_grad, b_up=inter * gate_up.stride(1), second=seg)  # fmt: skip
        seg = None
        if r_dn:
            zd = _thin(route, act, None, dn_a, (dn_a.stride(0), dn_a.stride(2), dn_a.stride(1)), r_dn, inter,
                       x.dtype, scale)  # fmt: skip
            seg = Segment(zd, dn_b, (dn_b.stride(0), dn_b.stride(2), dn_b.stride(1)), r_dn)
        if n:
            _rows_gemm(route, act, None, down, (down.stride(0), down.stride(2), down.stride(1)), hidden, inter, y,
                       cfg="down", second=seg)  # fmt: skip
        out = _combine(y, route, w_flat, t, hidden, x.dtype)
        if need_grad:
            ctx.route, ctx.scale, ctx.ranks = route, scale, (r_gu, r_dn)
            ctx.save_for_backward(x, w_flat, gate_up, down, h, gu_a, gu_b, dn_a, dn_b, za, zd)
        ctx.w_shape, ctx.w_dtype = topk_weights.shape, topk_weights.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w_flat, gate_up, down, h, gu_a, gu_b, dn_a, dn_b, za, zd = ctx.saved_tensors
        route: _Routing = ctx.route
        s, (r_gu, r_dn) = ctx.scale, ctx.ranks
        need = ctx.needs_input_grad  # never the base's (frozen_base refused that before the forward)
        t, hidden = x.shape
        num_experts, two_i, _ = gate_up.shape
        inter = two_i // 2
        n = route.n
        dev, dt = x.device, x.dtype
        dy_rows = dy.index_select(0, route.token)
        w_rows = w_flat[route.order]
        dh = torch.empty(n, two_i, device=dev, dtype=dt)
        wact = torch.empty(n, inter, device=dev, dtype=dt)
        dw_rows = torch.zeros(n, device=dev, dtype=torch.float32)
        grads: dict[str, torch.Tensor | None] = dict.fromkeys(("x", "w", "gu_a", "gu_b", "dn_a", "dn_b"))
        q = seg = None
        if r_dn:
            # q = s * dyr @ B_dn_e (K = H, N = r); the segment adds q @ A_dn_e (B2[e][k, n] = dn_a[e][k, n])
            q = _thin(route, dy_rows, None, dn_b, (dn_b.stride(0), dn_b.stride(1), dn_b.stride(2)), r_dn, hidden, dt,
                      s)  # fmt: skip
            seg = Segment(q, dn_a, (dn_a.stride(0), dn_a.stride(1), dn_a.stride(2)), r_dn)
        if n:
            dn_strides = (down.stride(0), down.stride(1), down.stride(2))
            dw_part = _rows_gemm(route, dy_rows, None, down, dn_strides, inter, hidden, dh, cfg="dact", epi=2, h=h,
                                 w_rows=w_rows, wact=wact, need_dw=need[2], second=seg)  # fmt: skip
            if need[2]:
                dw_rows = dw_part.sum(1)
        if need[2]:
            grads["w"] = dw_rows[route.pos].to(w_flat.dtype).reshape(ctx.w_shape).to(ctx.w_dtype)
        if r_dn and (need[7] or need[8]):
            if need[7]:  # d A_dn_e = q_e^T @ (w act)_e  [r, I]
                grads["dn_a"] = _wgrad(route, q, wact, None, r_dn, inter, dn_a, block_m=rank_block(r_dn))
            if need[8]:  # d B_dn_e = dyr_e^T @ (w zd)_e  [H, r]
                wzd = zd * w_rows.to(dt).unsqueeze(1)
                grads["dn_b"] = _wgrad(route, dy_rows, wzd, None, hidden, r_dn, dn_b, block_n=rank_block(r_dn))
        del wact, dy_rows, q
        p = None
        if r_gu:
            # p = s * dh @ B_gu_e (K = 2I, N = r)
            p = _thin(route, dh, None, gu_b, (gu_b.stride(0), gu_b.stride(1), gu_b.stride(2)), r_gu, two_i, dt, s)
        if r_gu and (need[5] or need[6]):
            if need[5]:  # d A_gu_e = p_e^T @ x[t]_e  [r, H]
                grads["gu_a"] = _wgrad(route, p, x, route.token, r_gu, hidden, gu_a, block_m=rank_block(r_gu))
            if need[6]:  # d B_gu_e = dh_e^T @ za_e  [2I, r]
                grads["gu_b"] = _wgrad(route, dh, za, None, two_i, r_gu, gu_b, block_n=rank_block(r_gu))
        if need[0]:
            dx_rows = torch.empty(n, hidden, device=dev, dtype=dt)
            if n:
                seg = Segment(p, gu_a, (gu_a.stride(0), gu_a.stride(1), gu_a.stride(2)), r_gu) if r_gu else None
                _rows_gemm(route, dh, None, gate_up, (gate_up.stride(0), gate_up.stride(1), gate_up.stride(2)),
                           hidden, two_i, dx_rows, cfg="dx", second=seg)  # fmt: skip
            grads["x"] = _combine(dx_rows, route, None, t, hidden, dt)
        g = grads
        return g["x"], None, g["w"], None, None, g["gu_a"], g["gu_b"], g["dn_a"], g["dn_b"], None


def _wgrad(route, a, b, b_idx, m, n, like, block_m=None, block_n=None) -> torch.Tensor:
    """``[E, m, n]`` per-expert ``a_rows^T @ b_rows`` in ``like``'s dtype (zeros for an expert with no rows)."""
    out = torch.empty(route.num_experts, m, n, device=a.device, dtype=like.dtype)
    _wgrad_gemm(route, a, b, b_idx, m, n, out, block_m=block_m, block_n=block_n)
    return out


def moe_experts_lora(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_a: torch.Tensor | None,
    gate_up_b: torch.Tensor | None,
    down_a: torch.Tensor | None,
    down_b: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``polyrl.kernels.moe.reference.moe_experts_lora``. Differentiable in x, topk_weights and
    the adapters (the base weights take no gradient)."""
    _check(x, topk_ids, topk_weights, gate_up, down)
    frozen_base(gate_up, down)
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    ranks = (
        _adapter(gate_up_a, gate_up_b, num_experts, two_i, hidden, "gate_up"),
        _adapter(down_a, down_b, num_experts, hidden, inter, "down"),
    )
    adapters = (gate_up_a, gate_up_b, down_a, down_b)
    if max(ranks) > MAX_RANK:  # wider than the one tile of the rank-r segment: W' built, then moe_experts
        return materialized.moe_experts_lora(x, topk_ids, topk_weights, gate_up, down, *adapters, scale)
    if any(a is not None and a.dtype != x.dtype for a in adapters) or x.dtype not in _DTYPES:
        raise UserError(
            f"moe_experts_lora (triton) wants the adapters in x's dtype ({x.dtype}), got "
            f"{[None if a is None else a.dtype for a in adapters]}; cast them to the compute dtype"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    return _MoEExpertsLora.apply(x, topk_ids, topk_weights, gate_up, down, *adapters, float(scale))
