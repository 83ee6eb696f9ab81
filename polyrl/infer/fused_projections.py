"""Fused projections for the rollout engine (``RolloutConfig.fuse_projections``): the engine's own concatenated copies
of each decoder layer's q/k/v weights and gate/up weights, so a decode step runs one GEMM per group instead of one per
projection.

Why: at decode batch 256 (qwen3-0.6b shape, H200) each of a layer's seven projection GEMMs takes 5-8 us whatever its
width (latency-bound: launch, tile setup, the tail wave), 1.13 ms of a step, while their bytes and FLOPs would allow
~0.35 ms. One ``[T, K] x [K, N_q + N_k + N_v]`` GEMM and one ``[T, K] x [K, 2 I]`` GEMM per layer remove three of the
seven launches.

What is fused (``groups``): every ``Attention``'s ``(q_proj, k_proj, v_proj)`` and every dense ``MLP``'s
``(gate_proj, up_proj)`` (a Qwen2-MoE shared expert's included) whose members are plain ``nn.Linear`` modules with
plain ``nn.Parameter`` weights of one dtype and device, one input width, and all with or all without a bias. Left
alone: MoE routed experts (their own grouped kernels), LoRA-wrapped modules (``polyrl.models.lora``: the wrapper is not
a plain ``nn.Linear``, and a group with one wrapped member is not fused at all), FP8 training linears, o_proj and
down_proj (one GEMM each already). Adapters attached after the engine was built (``LLM.load_adapters``) replace the
modules, so their groups stop matching; ``prune`` drops those copies.

``project(linears, x)`` is the decoder's projection override (``polyrl.models.decoder.projection_override``, entered
by the ``ModelRunner`` around its own forwards only; the training forward never sees it): for exactly a fused group's
tuple of modules and an ``x [T, K]`` with more rows than the batch-1 skinny route takes
(``kernels.skinny_linear.ROUTE_MAX_ROWS``: the tuned batch-1 path stays as it is), one ``F.linear`` with the
concatenated weight (and bias) and the outputs as its column slices; otherwise None (the decoder's own path).

The slices are views with row stride ``sum N``, and no copy is made for the consumers, which all take them as they
are: ``q.view(T, Hq, D)`` is a view; ``kernels.qk_norm_rope`` and ``kernels.apply_rope`` (Triton: strided heads with a
unit last stride; reference: torch ops) return new contiguous tensors; ``kernels.write_kv_cache`` (Triton: strided k/v;
reference: ``index_copy_``) and ``varlen_attention`` (Triton strides; cuDNN/SDPA views; reference einsums) read
strided k/v; ``kernels.swiglu`` has a strided-rows Triton kernel (the reference is ``F.silu(g) * u``); OLMoE's norm
over the whole q / k projection (``kernels.rmsnorm``) reads strided rows. The one copy left is off the default path:
with ``DecoderOptions.fused_qk_norm_rope`` off, the per-head ``rmsnorm`` of a Qwen3 q/k slice flattens ``[T, H, D]``
to rows, which ``reshape`` must copy (the same bytes the contiguous case writes anyway as its output).

Numerics: each output column is the same dot product as in the separate GEMM; only the GEMM's kernel choice for the
wider N can change the summation order (fp32 on the CPU: equal to ~1e-7; bf16 on the GPU: within the bf16 rounding
the other decode-path options show).

Life cycle (as ``fp8_weights.Fp8Weights``): the copies are made in ``LLM.__init__`` before the KV cache is sized
from free memory, so the cache accounts for them; ``mark_stale`` after every weight update (``LLM.reset_prefix_cache``
-> ``ModelRunner.weights_changed``, which RL weight syncs call) and ``refresh`` before the next forward, in place (one
``torch.cat(..., out=)`` per group, so captured CUDA graphs keep reading the same tensors); ``LLM.release()`` frees them
(``free``) and the next forward makes them anew. Memory: one more copy of the fused weights in the model's dtype
(~0.59 GB at the qwen3-0.6b shape in bf16, two thirds of its projection bytes); ``nbytes`` reports it.

With FP8 rollout weights (``weight_precision = "fp8"``) no copies are made here: the FP8 copies serve every
projection, and ``fuse_projections`` makes them fuse their groups (``fp8_weights.Fp8Weights``, row slices of one
buffer per group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from polyrl.kernels.skinny_linear import ROUTE_MAX_ROWS
from polyrl.models.decoder import MLP, Attention, ProjectionOverride

Group = tuple[nn.Linear, ...]


def eligible(group: tuple[nn.Module, ...]) -> bool:
    """Whether ``group`` can share one concatenated weight: plain ``nn.Linear`` modules with plain ``nn.Parameter``
    weights (not meta), one input width, dtype and device, and all with a plain bias or none without."""
    for lin in group:
        if type(lin) is not nn.Linear or type(lin.weight) is not nn.Parameter or lin.weight.is_meta:
            return False
        if lin.bias is not None and type(lin.bias) is not nn.Parameter:
            return False
    first = group[0].weight
    same = all(
        lin.in_features == group[0].in_features
        and lin.weight.dtype == first.dtype
        and lin.weight.device == first.device
        for lin in group
    )
    return same and len({lin.bias is None for lin in group}) == 1


def candidate_groups(model: nn.Module) -> list[tuple[nn.Module, ...]]:
    """Every q/k/v and gate/up tuple the decoder hands to ``project_group``, in module order (eligible or not)."""
    out: list[tuple[nn.Module, ...]] = []
    for m in model.modules():
        if isinstance(m, Attention):
            out.append((m.q_proj, m.k_proj, m.v_proj))
        elif isinstance(m, MLP):
            out.append((m.gate_proj, m.up_proj))
    return out


def _concat(group: Group, out: tuple[torch.Tensor, torch.Tensor | None] | None = None):
    """(weight ``[sum N, K]``, bias ``[sum N]`` or None) of ``group``, written into ``out``'s tensors when given."""
    w = torch.cat([lin.weight for lin in group], dim=0, out=None if out is None else out[0])
    if group[0].bias is None:
        return w, None
    b = torch.cat([lin.bias for lin in group], dim=0, out=None if out is None else out[1])
    return w, b


class FusedProjections(ProjectionOverride):
    """Concatenated copies of a model's q/k/v and gate/up weights and the projection override that uses them (module
    docstring). ``entries``: group (the tuple of modules, as the decoder passes it) -> (weight, bias or None), or None
    after ``free``; ``splits``: group -> its members' ``out_features``."""

    def __init__(self, model: nn.Module) -> None:
        self.entries: dict[Group, tuple[torch.Tensor, torch.Tensor | None] | None] = {}
        self.splits: dict[Group, list[int]] = {}
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: a later refresh may write them anywhere
            for group in candidate_groups(model):
                if eligible(group):
                    self.entries[group] = _concat(group)
                    self.splits[group] = [lin.out_features for lin in group]
        self.stale = False
        self.refreshes = 0  # how many times the copies were rewritten after a weight change

    @classmethod
    def for_engine(cls, model: nn.Module, fuse: bool, weight_precision: str | None) -> FusedProjections | None:
        """The engine's copies for ``RolloutConfig.fuse_projections`` (None: off, or FP8 weights, which take
        precedence)."""
        return cls(model) if fuse and weight_precision != "fp8" else None

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold now (0 after ``free``)."""
        total = 0
        for entry in self.entries.values():
            if entry is not None:
                total += sum(t.numel() * t.element_size() for t in entry if t is not None)
        return total

    def mark_stale(self) -> None:
        """The source weights changed: rewrite the copies before the next forward (``refresh``)."""
        self.stale = True

    def free(self) -> None:
        """Drop the copies' memory (the engine released its KV cache and graphs); the next ``refresh`` makes new
        tensors."""
        self.entries = dict.fromkeys(self.entries)  # type: ignore[arg-type]
        self.stale = True

    def prune(self, model: nn.Module) -> int:
        """Forget the groups that are no longer the model's own eligible groups (modules replaced after the engine was
        built: LoRA adapters attached for serving); returns how many were dropped."""
        live = {g for g in candidate_groups(model) if eligible(g)}
        gone = [g for g in self.entries if g not in live]
        for g in gone:
            del self.entries[g], self.splits[g]
        return len(gone)

    def refresh(self) -> bool:
        """Rewrite the copies from the modules' weights if stale; returns whether it did. In place (captured graphs
        keep reading the same tensors), except after ``free``. Outside inference mode, as the copies were made."""
        if not self.stale:
            return False
        with torch.inference_mode(False), torch.no_grad():
            for group, entry in self.entries.items():
                self.entries[group] = _concat(group, entry)
        self.stale = False
        self.refreshes += 1
        return True

    def project(self, linears: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """``tuple(l(x) for l in linears)`` as column slices of one GEMM when ``linears`` is a fused group and ``x``
        is past the batch-1 skinny route (autograd off); else None (the decoder's own path)."""
        if x.dim() != 2 or x.shape[0] <= ROUTE_MAX_ROWS or torch.is_grad_enabled():
            return None
        entry = self.entries.get(linears)  # type: ignore[arg-type]
        if entry is None or entry[0].dtype != x.dtype:
            return None
        return F.linear(x, entry[0], entry[1]).split(self.splits[linears], dim=-1)  # type: ignore[index]


__all__ = ["FusedProjections", "candidate_groups", "eligible"]
