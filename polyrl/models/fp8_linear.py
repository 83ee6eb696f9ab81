"""FP8 training linear: ``y = x W^T (+ b)`` with its three GEMMs in FP8, and the module swap that turns a decoder's
projections into it (``convert_to_fp8`` / ``convert_from_fp8``).

The GEMMs (``_Fp8Matmul``), x ``[T, K]``, W ``[N, K]``, dY ``[T, N]``:

- forward ``Y = X W^T``: X and W in e4m3 (3 mantissa bits: the precision activations and weights need), scaled
  tensor-wise (one scale each) or row-wise (a scale per token of X and per output channel of W: an outlier token or
  channel no longer squeezes everyone else's range; Hopper's CUTLASS row-wise kernel, bf16 output);
- backward ``dX = dY W``: dY in e5m2 (2 mantissa bits, 5 exponent bits: gradients span a wider range and need
  it more than precision), W in e4m3; ``dW = dY^T X``: e5m2 x e4m3. Both tensor-wise in either recipe (scales along
  the reduction dim cannot be factored out of a GEMM; row-wise X/W would need re-quantising along the other axis
  anyway, and torch's row-wise kernel takes e4m3 only on older versions).

Every product accumulates in fp32 and is rounded once to the compute dtype (bf16). The forward output uses the fast
(Hopper two-level) accumulation, the gradients the exact one: torchao's default ``Float8LinearConfig`` choices.

Scaling is *current* (just-in-time): each tensor's scale comes from its own ``amax`` right before the cast, not from
a history of earlier steps (*delayed* scaling). Why: it is stateless, so activation checkpointing recomputes the very
same FP8 values, a CUDA-graph replay and an exact resume need no amax history, FSDP2 ranks need no amax all-reduce,
and a sudden outlier saturates nothing (delayed scaling clips it for up to ``history`` steps). Its cost is one more
read of each tensor (the amax pass), a few percent of a GEMM's time at training shapes. It is torchao's default
(its delayed scaling was deprecated and removed) and Transformer Engine's ``Float8CurrentScaling`` recipe, which TE
added next to its original ``DelayedScaling`` default for the same reasons.

What is saved for the backward: tensor-wise, X in FP8 (1 byte per element instead of 2, reused exactly by dW) and W
itself (re-quantised in the backward: keeping an FP8 copy of every weight alive until its backward would cost one
byte per parameter); row-wise, X in the compute dtype (dW needs it quantised along the token axis).

``Fp8Linear`` is an ``nn.Linear`` whose class was swapped in place: the same ``weight`` / ``bias`` parameters and
names, so checkpoints, FSDP2 sharding, the optimizer's masters and the rollout engine's references are untouched.
It runs FP8 only in training mode (``module.train()``); in eval mode (evaluation, rollout in the same process) it is
the plain bf16 ``nn.Linear`` (FP8 inference is the rollout engine's own switch).

A LoRA layer (``models/lora/layer.py``) on a dense frozen base gets ``fp8_rowwise`` set instead: its base GEMMs run
in FP8 (forward and input gradient; no weight gradient) and the adapter in the compute dtype. A QLoRA (NF4) base is
left alone (``fp8_candidates`` reports it).

Not here: the quantisation and GEMM kernels (``polyrl.kernels.fp8``), deciding whether the device can run FP8
(``polyrl.train.precision``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from polyrl import kernels

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# The decoder's projections that run in FP8 (HF names). Not the lm_head, embeddings, norms, routers or experts.
FP8_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALINGS = ("tensorwise", "rowwise")


class _Fp8Matmul(torch.autograd.Function):
    """``x [T, K] @ weight[N, K]^T`` with FP8 GEMMs forward and backward (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, rowwise: bool) -> torch.Tensor:
        xq, xs = kernels.fp8_quantize(x, E4M3, rowwise)
        wq, ws = kernels.fp8_quantize(weight, E4M3, rowwise)  # row-wise: per output channel, [N, 1]
        y = kernels.fp8_scaled_mm(xq, wq.t(), xs, ws.reshape(1, -1) if rowwise else ws, x.dtype, True)
        ctx.rowwise = rowwise
        ctx.x_dtype = x.dtype
        if rowwise:
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(xq, xs, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.rowwise:
            x, weight = ctx.saved_tensors
            xq = xs = None
        else:
            xq, xs, weight = ctx.saved_tensors
        gq, gs = kernels.fp8_quantize(dy.contiguous(), E5M2, False)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wq, ws = kernels.fp8_quantize(weight, E4M3, False)
            dx = kernels.fp8_scaled_mm(gq, wq, gs, ws, ctx.x_dtype, False)  # [T, N] @ [N, K]
        if ctx.needs_input_grad[1]:
            if xq is None:
                xq, xs = kernels.fp8_quantize(x, E4M3, False)
            dw = kernels.fp8_scaled_mm(gq.t(), xq, gs, xs, weight.dtype, False)  # [N, T] @ [T, K]
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rowwise: bool = False):
    """``F.linear(x, weight, bias)`` with the three GEMMs in FP8; ``x [..., K]``, differentiable in all three."""
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, rowwise).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` that trains with FP8 GEMMs (``fp8_linear``) and evaluates as itself. Made only by
    ``convert_to_fp8`` (a class swap in place), which sets ``fp8_rowwise``."""

    fp8_rowwise: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, self.fp8_rowwise)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={'rowwise' if self.fp8_rowwise else 'tensorwise'}"


def fp8_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every decoder projection named in ``FP8_TARGETS``, whatever its type."""
    return [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] in FP8_TARGETS]


def is_fp8_lora(module: nn.Module) -> bool:
    """A LoRA layer whose base can run in FP8: it has the ``fp8_rowwise`` switch and a dense base."""
    return hasattr(module, "lora_A") and hasattr(module, "fp8_rowwise") and getattr(module, "quant_shape", 0) is None


def convert_to_fp8(model: nn.Module, scaling: str = "tensorwise") -> int:
    """Swap every plain ``nn.Linear`` among ``fp8_candidates`` to ``Fp8Linear`` in place (parameters kept) and switch
    on the FP8 base of every dense LoRA layer among them; returns how many. Converting twice only updates the
    scaling."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    n = 0
    for _, module in fp8_candidates(model):
        if type(module) in (nn.Linear, Fp8Linear):
            module.__class__ = Fp8Linear
            module.fp8_rowwise = scaling == "rowwise"
            n += 1
        elif is_fp8_lora(module):
            module.fp8_rowwise = scaling == "rowwise"
            n += 1
    return n


def convert_from_fp8(model: nn.Module) -> int:
    """Undo ``convert_to_fp8``: every ``Fp8Linear`` back to ``nn.Linear``; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is Fp8Linear:
            module.__class__ = nn.Linear
            module.__dict__.pop("fp8_rowwise", None)
            n += 1
        elif is_fp8_lora(module) and module.fp8_rowwise is not None:
            module.fp8_rowwise = None
            n += 1
    return n
