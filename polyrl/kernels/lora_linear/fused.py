"""The LoRA linear as one autograd node: ``y = x W^T + b + s * (x A^T) B^T`` with the adapter's product added by
the GEMM itself (``addmm``'s ``beta=1`` epilogue) in forward and backward.

The plain composition (``linear(x, W) + linear(linear(x, A), B) * s``) spends, per LoRA layer, two extra
elementwise passes over the ``[T, out]`` output in forward (scale, add), one in backward (scale the gradient) and
one over ``[T, in]`` (summing the input gradients of the base and adapter branches); with activation checkpointing
the forward ones run twice. Here they are gone:

- forward: ``xa = x A^T`` (``[T, r]``), ``y = x W^T (+ b)``, then ``y += s * xa B^T`` in place (one GEMM);
- backward: ``g = s * dy B`` (``[T, r]``), ``dB = s * dy^T xa``, ``dA = g^T x``, ``dx = dy W`` then
  ``dx += g A`` in place (one GEMM). The frozen base weight gets no gradient.

``adapter_first`` (the registry's ``fused_adapter_first``, not the default until measured on a GPU) turns the
order around: the rank-r product is written first and the base GEMM accumulates onto it (``beta = 1``, read in the
epilogue of a compute-bound GEMM) in forward (``y = s * xa B^T (+ b); y += x W^T``) and backward (``dx = g A;
dx += dy W``). That replaces a memory-bound read-modify-write pass over ``[T, out]`` / ``[T, in]`` by a write: the
adapters' ``addmm_`` were 52 of 756 ms of kernels in the 8b LoRA step (docs/performance.md).

It saves ``x`` (which ``dA`` needs anyway), the small ``xa`` and the weights. An NF4 base (QLoRA) is dequantized
into a transient dense weight in forward and again in backward, never kept. Pure PyTorch: cuBLAS, hipBLAS and
the CPU BLAS all implement ``addmm``, so it runs on every platform; ``reference.py`` (the composition) is the spec.
"""

from __future__ import annotations

import torch

from polyrl.kernels import ops as kernels
from polyrl.kernels.nf4.reference import NF4Weight


def _dense(weight: torch.Tensor | NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The base as a dense ``[N, K]`` tensor: itself, or (NF4) a transient dequantized copy, never saved."""
    if isinstance(weight, NF4Weight):
        return kernels.nf4_dequantize(weight.packed, weight.absmax, weight.shape, dtype)
    return weight


_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _zero(like: torch.Tensor) -> torch.Tensor:
    """A cached 0-dim zero of ``like``'s device and dtype (the ignored ``input`` of a ``beta=0`` addmm)."""
    key = (like.device, like.dtype)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros((), device=like.device, dtype=like.dtype)
    return z


class _FusedLoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, nf4: NF4Weight | None, adapter_first: bool):  # type: ignore[override]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w = _dense(nf4, x.dtype) if nf4 is not None else weight
        xa = x2 @ lora_a.t()
        if adapter_first:
            if bias is not None:
                y = torch.addmm(bias, xa, lora_b.t(), alpha=scaling)
            else:
                y = torch.addmm(_zero(xa), xa, lora_b.t(), beta=0, alpha=scaling)
            y.addmm_(x2, w.t())
        else:
            y = torch.addmm(bias, x2, w.t()) if bias is not None else x2 @ w.t()
            y.addmm_(xa, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x2, xa, weight if nf4 is None else None, lora_a, lora_b)
        ctx.scaling, ctx.shape, ctx.has_bias, ctx.nf4 = scaling, shape, bias is not None, nf4
        ctx.adapter_first = adapter_first
        return y.view(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, xa, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        dy2 = dy.reshape(-1, dy.shape[-1])
        zero = _zero(dy2)  # beta=0: addmm ignores it, so the scale rides on the GEMM (alpha), no extra pass
        g = torch.addmm(zero, dy2, lora_b, beta=0, alpha=s)  # [T, r]: the gradient reaching xa
        d_b = torch.addmm(zero, dy2.t(), xa, beta=0, alpha=s) if ctx.needs_input_grad[4] else None
        d_a = g.t() @ x2 if ctx.needs_input_grad[3] else None
        dx = None
        if ctx.needs_input_grad[0]:
            w = _dense(ctx.nf4, dy.dtype) if ctx.nf4 is not None else weight
            if ctx.adapter_first:
                dx = g @ lora_a
                dx.addmm_(dy2, w)
            else:
                dx = dy2 @ w
                dx.addmm_(g, lora_a)
            dx = dx.view(ctx.shape)
        d_bias = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        d_w = dy2.t() @ x2 if ctx.needs_input_grad[1] else None  # only if someone unfroze a dense base
        return dx, d_w, d_bias, d_a, d_b, None, None, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | NF4Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``x W^T + b + scaling * (x A^T) B^T``; ``weight [out, in]`` dense or ``NF4Weight`` (dequantized transiently
    in forward and again in backward, as ``nf4_matmul`` does above its fused-kernel rows), ``lora_a [r, in]``,
    ``lora_b [out, r]``. The base product first, the adapter's added onto it."""
    return _apply(x, weight, bias, lora_a, lora_b, scaling, adapter_first=False)


def lora_linear_adapter_first(
    x: torch.Tensor,
    weight: torch.Tensor | NF4Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``lora_linear`` with the adapter's product first and the base GEMM accumulating onto it (module docstring)."""
    return _apply(x, weight, bias, lora_a, lora_b, scaling, adapter_first=True)


def _apply(x, weight, bias, lora_a, lora_b, scaling: float, adapter_first: bool) -> torch.Tensor:
    if isinstance(weight, NF4Weight):
        return _FusedLoraLinear.apply(x, None, bias, lora_a, lora_b, float(scaling), weight, adapter_first)
    return _FusedLoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scaling), None, adapter_first)


class _FrozenBaseOnto(torch.autograd.Function):
    """``y = acc + x W^T (+ b)`` for a frozen base ``W``: the GEMM accumulates onto ``acc`` (``beta = 1``). It saves
    the weight only (an NF4 base: nothing, dequantized again in backward), never ``x``: the input gradient
    ``dy W`` is all a frozen base needs."""

    @staticmethod
    def forward(ctx, acc, x, weight, bias, nf4: NF4Weight | None):  # type: ignore[override]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w = _dense(nf4, x.dtype) if nf4 is not None else weight
        if acc is not None:
            y = torch.addmm(acc.reshape(-1, w.shape[0]), x2, w.t())
            if bias is not None:
                y += bias
        else:
            y = torch.addmm(bias, x2, w.t()) if bias is not None else x2 @ w.t()
        ctx.save_for_backward(weight if nf4 is None else None)
        ctx.shape, ctx.nf4, ctx.has_acc, ctx.has_bias = shape, nf4, acc is not None, bias is not None
        return y.view(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        d_acc = dy if ctx.has_acc and ctx.needs_input_grad[0] else None
        dx = None
        if ctx.needs_input_grad[1]:
            w = _dense(ctx.nf4, dy.dtype) if ctx.nf4 is not None else weight
            dx = (dy.reshape(-1, dy.shape[-1]) @ w).view(ctx.shape)
        d_bias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return d_acc, dx, None, d_bias, None


def frozen_base_onto(
    acc: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | NF4Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``acc + x W^T (+ b)`` (``acc`` None: no addend) with ``W`` frozen (no weight gradient), saving no activation:
    the decoder runs a LoRA layer's frozen base this way after the layer's activation checkpoint, so the recomputed
    forward skips that GEMM (``DecoderOptions.skip_frozen_down_recompute``). ``weight [out, in]`` dense or
    ``NF4Weight``."""
    if isinstance(weight, NF4Weight):
        return _FrozenBaseOnto.apply(acc, x, None, bias, weight)
    if weight.requires_grad:
        raise ValueError("frozen_base_onto: the weight requires a gradient; it is for frozen bases only")
    return _FrozenBaseOnto.apply(acc, x, weight, bias, None)
