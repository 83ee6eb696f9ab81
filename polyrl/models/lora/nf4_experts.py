"""QLoRA's 4-bit base for an MoE layer's routed experts: the stacked expert tensors (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) in NF4, and ``NF4Experts``, the frozen experts of a QLoRA model whose experts get no adapter.

Format: each ``[E, N, K]`` tensor is quantized as the 2-D ``[E * N, K]`` weight of the dense QLoRA base
(``polyrl.kernels.nf4``: blocks of 64 along K, one fp32 absmax per block, no double quantization, the same as the
dense layers), kept as ``<name>_nf4`` uint8 ``[E, N, Kp/2]`` and ``<name>_absmax`` fp32 ``[E, N, Kp/64]`` buffers, so
one expert is a slice and the bytes per element are 0.5 + 4/64 = 0.5625 (vs 2 in bf16: 3.56x smaller).

Forward (``dequantize_experts``): the experts a step needs are dequantized just in time to the compute dtype (one
fp32 code * absmax, one rounding: ``kernels.nf4_dequantize``, Triton on CUDA) and the op runs on them:
``kernels.moe_experts``, or with expert adapters ``kernels.moe_experts_lora`` (the adapters apart; its default
implementation builds ``W'``, its Triton one does not). With fewer routed slots than experts (``T * k < E``:
decode, short prompts) only the slots' experts are dequantized, one copy per slot, and the ids become
``arange(T * k)``: a sync-free subset (no ``unique``, fixed shapes, CUDA-graph safe); otherwise the whole stack.

With autograd (``run_nf4_experts``): the op would save the dequantized (adapted) stack of every MoE layer for its
backward, i.e. hold the whole model's experts in the compute dtype at peak, which is what QLoRA is there to avoid.
So, unless an outer saved-tensor hook already manages the layer's memory (activation checkpointing, offloading:
then the plain op runs inside it), the forward runs without a graph and saves only ``x``, the routing and the
adapter tensors; backward dequantizes again, re-runs the op's forward with autograd and back-propagates through it
(one extra expert forward per step, as a per-layer checkpoint of the experts would; no ``[E, N, K]`` or
``[T * k, 2I]`` tensor lives between forward and backward). Not here: a grouped GEMM that reads 4-bit weights
directly, the adapters' arithmetic (``experts.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from polyrl import kernels
from polyrl.kernels.nf4.reference import quantize_nf4
from polyrl.models.moe import Experts

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


@torch.no_grad()
def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> (packed uint8 ``[E, N, Kp/2]``, absmax fp32 ``[E, N, Kp/64]``), expert by expert (small
    fp32 temporaries)."""
    e, n, k = w.shape
    parts = [quantize_nf4(w[i]) for i in range(e)]
    return torch.stack([p for p, _ in parts]), torch.stack([a for _, a in parts])


def dequantize_experts(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense ``[E', N, K]`` tensor in ``dtype``: every expert, or those listed in ``experts`` (int ``[E']``,
    repeats allowed), gathered before dequantizing."""
    _, n, k = shape
    if experts is not None:
        packed, absmax = packed[experts], absmax[experts]
    e = packed.shape[0]
    w = kernels.nf4_dequantize(packed.reshape(e * n, -1), absmax.reshape(e * n, -1), (e * n, k), dtype)
    return w.view(e, n, k)


def slot_subset(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(experts to dequantize or None for all, the ids to run with): ``T * k < E`` routes each slot to its own copy
    of its expert (``ids.reshape(-1)``, new ids ``arange(T * k).view(T, k)``), else all experts, ids unchanged."""
    t, k = ids.shape
    if t * k >= num_experts:
        return None, ids
    return ids.reshape(-1), torch.arange(t * k, device=ids.device).view(t, k)


def _outer_hooks_active() -> bool:
    """Whether a saved-tensor hook (non-reentrant activation checkpointing, CPU offload) wraps this forward."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _direct(module: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    sel, run_ids = slot_subset(ids, module.num_experts)
    return module.run_dequantized(x, run_ids, weights, sel)


class _RecomputedExperts(torch.autograd.Function):
    """``_direct`` whose backward recomputes the forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, module, x, ids, weights, *adapters):  # type: ignore[override]
        ctx.module = module
        ctx.save_for_backward(x, ids, weights, *adapters)
        with torch.no_grad():
            return _direct(module, x, ids, weights)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, ids, weights, *adapters = ctx.saved_tensors
        need = ctx.needs_input_grad
        with torch.enable_grad():
            xd = x.detach().requires_grad_(need[1])
            wd = weights.detach().requires_grad_(need[3])
            y = _direct(ctx.module, xd, ids, wd)
        leaves = [(i, t) for i, t in enumerate([xd, wd, *ctx.module.adapter_tensors()]) if t.requires_grad]
        grads = [None] * (2 + len(adapters))
        if leaves and y.requires_grad:
            got = torch.autograd.grad(y, [t for _, t in leaves], dy, allow_unused=True)
            for (i, _), g in zip(leaves, got, strict=True):
                grads[i] = g
        return None, grads[0], None, grads[1], *grads[2:]


def run_nf4_experts(module: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of ``module`` (``NF4Experts`` or a quantized ``LoraExperts``: ``num_experts``,
    ``run_dequantized(x, ids, weights, experts)``, ``adapter_tensors()``) on ``x [T, H]``; see the module
    docstring."""
    if torch.is_grad_enabled() and not _outer_hooks_active():
        return _RecomputedExperts.apply(module, x, ids, weights, *module.adapter_tensors())
    return _direct(module, x, ids, weights)


class NF4Experts(nn.Module):
    """Frozen routed experts stored in NF4 (QLoRA without expert adapters): the ``Experts`` interface
    (``forward(x, ids, weights)``), buffers ``gate_up_proj_nf4`` / ``gate_up_proj_absmax`` / ``down_proj_nf4`` /
    ``down_proj_absmax``."""

    def __init__(self, base: Experts) -> None:
        super().__init__()
        self.shapes: dict[str, tuple[int, int, int]] = {}
        for name in EXPERT_TENSORS:
            w = getattr(base, name)
            packed, absmax = quantize_experts(w.detach())
            self.shapes[name] = tuple(w.shape)
            self.register_buffer(f"{name}_nf4", packed)
            self.register_buffer(f"{name}_absmax", absmax)
        self.num_experts = self.shapes["down_proj"][0]

    def dequantized(self, name: str, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_experts(
            getattr(self, f"{name}_nf4"), getattr(self, f"{name}_absmax"), self.shapes[name], dtype, experts
        )

    def expert_weights(
        self, dtype: torch.dtype, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequantized("gate_up_proj", dtype, experts), self.dequantized("down_proj", dtype, experts)

    def adapter_tensors(self) -> list[torch.Tensor]:
        return []

    def run_dequantized(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor | None
    ) -> torch.Tensor:
        """The op on the experts dequantized to x's dtype (those in ``experts``, if given; ``ids`` index them)."""
        return kernels.moe_experts(x, ids, weights, *self.expert_weights(x.dtype, experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_nf4_experts(self, x, ids, weights)

    @torch.no_grad()
    def to_experts(self, dtype: torch.dtype = torch.bfloat16) -> Experts:
        """A plain ``Experts`` with the dequantized tensors in ``dtype``."""
        with torch.device("meta"):
            plain = Experts(*self.shapes["down_proj"])
        for name in EXPERT_TENSORS:
            setattr(plain, name, nn.Parameter(self.dequantized(name, dtype), requires_grad=False))
        return plain

    def extra_repr(self) -> str:
        e, h, i = self.shapes["down_proj"]
        return f"experts={e}, hidden={h}, inter={i}, base=nf4"


def expert_param_bytes(num_experts: int, hidden: int, inter: int, nf4: bool) -> int:
    """Bytes of one MoE layer's routed-expert weights (``gate_up [E, 2I, H]`` + ``down [E, H, I]``): bf16, or NF4
    (packed nibbles + fp32 absmax per 64-element block, K padded to 64)."""
    total = 0
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        if nf4:
            kp = -(-k // 64) * 64
            total += num_experts * n * (kp // 2 + 4 * (kp // 64))
        else:
            total += num_experts * n * k * 2
    return total
