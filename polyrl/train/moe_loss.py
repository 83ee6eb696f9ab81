"""The MoE auxiliary losses in a training step: the router's load-balancing loss and z-loss, reported per step as
metrics (``moe/aux_loss``, ``moe/z_loss``) and added to the loss with their coefficients.

``MoELoss.for_model(model, step_cfg)`` is None for a dense model. For an MoE ``DecoderLM`` it resolves the
coefficients with HF's semantics: the load-balancing loss is added with ``router_aux_loss_coef`` only when the
model's config sets ``output_router_logits`` (transformers adds ``router_aux_loss_coef * aux_loss`` to the loss then,
and only then); ``StepConfig.moe_aux_loss_coef`` overrides that (0 turns it off). The z-loss uses the config's
``router_z_loss_coef`` (0 unless config.json has one) unless ``StepConfig.moe_z_loss_coef`` is set.

``wrap(loss_fn, weight)`` runs a micro-batch's loss function under a recording ``Routing`` (``models.moe
.routing_scope``: every forward of the model inside it records, whatever the loss function) and adds
``weight * (aux_coef * aux + z_coef * z)`` to its summed loss. The engine divides the step's sums by one normaliser,
so ``weight = normaliser * tokens_of_micro_batch / tokens_of_step`` (real tokens: a fixed-shape batch's padding
routes through the experts but counts in neither the weights nor the losses): the step's loss gets the coefficient
times the token-weighted mean of the micro-batches' aux losses, as one HF forward over the whole batch would (the
metrics too).
A micro-batch with a ``routing_replay`` attribute (layer -> ``topk_ids [T, k]`` of its packed tokens, e.g. what
the rollout engine chose) is trained with those experts forced (rollout-routing replay, ``models.moe.Routing``);
metric ``moe/replay_flips``: the fraction of its (token, MoE layer) rows whose router alone would have chosen other
experts (token-weighted like the aux loss).
Not here: the loss formulas (``polyrl.models.moe``), the step itself (``engine.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polyrl.models.moe import Routing, load_balancing_loss, replay_flips, router_z_loss, routing_scope

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]


class MoELoss:
    def __init__(self, num_experts: int, aux_coef: float, z_coef: float) -> None:
        self.num_experts = num_experts
        self.aux_coef = float(aux_coef)
        self.z_coef = float(z_coef)

    @classmethod
    def for_model(cls, model: nn.Module, step_cfg: Any) -> MoELoss | None:
        cfg = getattr(model, "config", None)
        if not getattr(cfg, "is_moe", False) or not hasattr(model, "default_routing"):
            return None
        aux = getattr(step_cfg, "moe_aux_loss_coef", None)
        if aux is None:
            aux = cfg.router_aux_loss_coef if cfg.output_router_logits else 0.0
        z = getattr(step_cfg, "moe_z_loss_coef", None)
        if z is None:
            z = cfg.router_z_loss_coef
        return cls(cfg.num_experts, aux, z)

    def wrap(self, loss_fn: LossFn, weight: float, replay: dict[int, torch.Tensor] | None = None) -> LossFn:
        """``loss_fn`` plus ``weight * (aux_coef * aux + z_coef * z)``, with metrics ``moe/aux_loss`` and
        ``moe/z_loss`` (sums weighted like the loss: the engine reports them divided by its normaliser); ``replay``:
        the micro-batch's ``routing_replay`` (forced experts per MoE layer), if any."""

        def moe_loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            routing = Routing(record=True, keep_logits=True, replay=replay)
            with routing_scope(model, routing):
                loss_sum, metrics = loss_fn(model, batch)
            if not routing.router_logits:  # the loss ran no forward of this model (e.g. a frozen reference only)
                return loss_sum, metrics
            routing = _without_padding(routing, batch)
            with torch.set_grad_enabled(torch.is_grad_enabled() and bool(self.aux_coef or self.z_coef)):
                aux = load_balancing_loss(routing, self.num_experts)  # metrics only (no graph) at zero coefficients
                z = router_z_loss(routing)
            metrics = dict(metrics)
            metrics["moe/aux_loss"] = aux.detach() * weight
            metrics["moe/z_loss"] = z.detach() * weight
            flips = replay_flips(routing)
            if flips is not None:  # the rows whose router alone would have picked other experts than the replayed
                metrics["moe/replay_flips"] = flips * weight
            extra = self.aux_coef * aux + self.z_coef * z
            if self.aux_coef or self.z_coef:
                loss_sum = loss_sum + weight * extra.to(loss_sum.dtype)
            return loss_sum, metrics

        moe_loss_fn.__name__ = f"moe({getattr(loss_fn, '__name__', 'loss')})"
        return moe_loss_fn


def real_tokens(batch: Any) -> int:
    """A packed batch's tokens less a fixed-shape batch's trailing padding (``PackedBatch.padding_tokens``)."""
    return int(batch.input_ids.numel()) - int(getattr(batch, "padding_tokens", 0) or 0)


def _without_padding(routing: Routing, batch: Any) -> Routing:
    """The record of the batch's real tokens: the padding of a fixed-shape batch (its last rows) routes too, but
    must not count in the balance. Only for a loss that ran one forward over the batch (rows = its tokens)."""
    total, real = int(batch.input_ids.numel()), real_tokens(batch)
    if real == total or any(t.shape[0] != total for t in routing.router_logits.values()):
        return routing
    return routing.first_rows(real)
