"""The mixture-of-experts block of ``DecoderLM`` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) and its routing record.

``SparseMoeBlock``: a router (``gate``, ``[E, H]``, no bias), ``experts`` holding transformers 5's fused expert
tensors (``gate_up_proj [E, 2I, H]``: gate rows then up rows; ``down_proj [E, H, I]``) and, for Qwen2-MoE, a shared
expert added after a sigmoid gate. Parameter names are transformers 5's in-memory names (``mlp.gate.weight``,
``mlp.experts.gate_up_proj``, ...), so a state dict is an HF state dict; ``checkpoint.py`` converts to and from the
hub's per-expert layout. The expert compute is the op ``kernels.moe_experts`` (never its reference directly).

Routing numerics follow HF: router logits in the hidden dtype (``F.linear``), softmax in fp32, top-k, the family's
renormalisation (``norm_topk_prob``; Mixtral always), then the weights cast to the hidden dtype (Qwen / OLMoE) or
kept fp32 (Mixtral, which multiplies in fp32).

``Routing`` is a per-forward record/replay object handed to ``DecoderLM.forward(..., routing=...)``: every MoE layer
reports its router logits and chosen experts, which ``DecoderLM.forward`` stores outside any activation checkpoint
(so a recomputed layer never records twice); ``replay`` forces each layer's experts (rollout-routing replay), their
weights recomputed from the current router's probabilities at those experts and normalised as the family does.
``load_balancing_loss`` / ``router_z_loss`` turn a record into the auxiliary losses; ``replay_flips`` says how
much of a replayed forward's routing the replay overrode.

Not here: the expert kernels (``polyrl.kernels.moe``), the training loss plumbing (``polyrl.train.engine``),
checkpoint layouts (``checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from polyrl import kernels
from polyrl.errors import UserError
from polyrl.models.config import ModelConfig


@dataclass
class Routing:
    """What the MoE layers of one forward chose, and what they must choose.

    ``record``: keep each MoE layer's ``topk_ids [T, k]`` (int64, detached). ``keep_logits``: keep each layer's
    ``router_logits [T, E]`` (hidden dtype, with autograd: the auxiliary losses backpropagate through them).
    ``replay``: layer -> ``topk_ids [T, k]`` to use instead of the router's top-k (the forward's T tokens, in order;
    a row of -1 is missing: that token takes the router's own top-k).
    Several forwards with one ``Routing`` append along the token axis (a loss that runs the model twice)."""

    record: bool = True
    keep_logits: bool = True
    replay: dict[int, torch.Tensor] | None = None
    router_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    topk_ids: dict[int, torch.Tensor] = field(default_factory=dict)

    def replay_ids(self, layer: int, tokens: int) -> torch.Tensor | None:
        if self.replay is None:
            return None
        ids = self.replay.get(layer)
        if ids is None:
            raise UserError(
                f"routing replay has no experts for MoE layer {layer} (it has layers {sorted(self.replay)}); "
                "replay a record of the same model"
            )
        if ids.dim() != 2 or ids.shape[0] != tokens:
            raise UserError(
                f"routing replay for layer {layer} has shape {list(ids.shape)}, the forward has {tokens} tokens; "
                "replay the record of exactly these packed tokens"
            )
        return ids

    def add(self, layer: int, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """Store one MoE layer's router output (called by ``DecoderLM.forward``, outside any checkpoint)."""
        if self.keep_logits:
            old = self.router_logits.get(layer)
            self.router_logits[layer] = logits if old is None else torch.cat([old, logits])
        if self.record:
            ids = ids.detach()
            old = self.topk_ids.get(layer)
            self.topk_ids[layer] = ids if old is None else torch.cat([old, ids])

    def first_rows(self, rows: int) -> Routing:
        """A view of the record keeping each layer's first ``rows`` tokens (a fixed-shape batch's real tokens, whose
        padding comes last)."""
        return Routing(
            record=self.record,
            keep_logits=self.keep_logits,
            replay=self.replay,
            router_logits={k: v[:rows] for k, v in self.router_logits.items()},
            topk_ids={k: v[:rows] for k, v in self.topk_ids.items()},
        )

    @property
    def layers(self) -> list[int]:
        return sorted(self.router_logits or self.topk_ids)


def route(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    weights_fp32: bool,
    replay_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, k]``, expert ids int64 ``[T, k]``): fp32 softmax, top-k (or the
    ``replay_ids``' probabilities; a replayed row of -1 is missing and takes the top-k), renormalised to sum 1 when
    ``normalize``, cast to the logits' dtype unless ``weights_fp32``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if replay_ids is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        ids = replay_ids.to(device=probs.device, dtype=torch.long)
        # rows marked missing (-1: a token the rollout never computed) take the router's own top-k
        ids = torch.where(ids < 0, torch.topk(probs, top_k, dim=-1).indices, ids)
        weights = probs.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        weights = weights.to(logits.dtype)
    return weights, ids


class Experts(nn.Module):
    """The routed experts' weights as transformers 5 holds them: ``gate_up_proj [E, 2I, H]`` (gate rows, then up
    rows) and ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj)

    @torch.no_grad()
    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        self.gate_up_proj.normal_(0.0, std, generator=generator)
        self.down_proj.normal_(0.0, std, generator=generator)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert, a dense SwiGLU MLP the caller builds).
    ``forward(x [T, H], options, replay_ids)`` -> ``(out [T, H], router_logits [T, E], topk_ids [T, k])``."""

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        moe = cfg.family.moe
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.normalize = cfg.norm_topk_prob
        self.weights_fp32 = moe.weights_fp32
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router (HF: mlp.gate.weight)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor, options, replay_ids: torch.Tensor | None = None):
        logits = F.linear(x, self.gate.weight)  # [T, E] in the hidden dtype, as HF
        weights, ids = route(logits, self.top_k, self.normalize, self.weights_fp32, replay_ids)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, options)
        return out, logits, ids


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """HF's (Switch Transformer) auxiliary loss over all recorded MoE layers' tokens (rows):
    ``num_experts * sum_e f_e * P_e``, ``f_e`` = top-k assignments to expert e per row, ``P_e`` = mean fp32 router
    probability of e; equal to transformers' ``load_balancing_loss_func`` on the same logits (which recomputes the
    top-k from them: the recorded ids are that top-k unless replayed). fp32 scalar, differentiable in the logits."""
    layers = sorted(routing.router_logits)
    if not layers or not routing.topk_ids:
        raise UserError("load_balancing_loss needs a Routing that kept router logits and expert ids (record=True)")
    first = routing.router_logits[layers[0]]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=first.device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=first.device)
    rows = 0
    for layer in layers:
        logits = routing.router_logits[layer]
        ids = routing.topk_ids[layer].reshape(-1)
        counts = counts + torch.zeros_like(counts).index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        prob_sum = prob_sum + torch.softmax(logits.float(), dim=-1).sum(dim=0)
        rows += logits.shape[0]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over all recorded layers' rows of ``logsumexp(logits)^2`` (fp32 scalar)."""
    layers = sorted(routing.router_logits)
    if not layers:
        raise UserError("router_z_loss needs a Routing that kept router logits")
    total = sum(torch.logsumexp(routing.router_logits[i].float(), dim=-1).square().sum() for i in layers)
    rows = sum(routing.router_logits[i].shape[0] for i in layers)
    return total / rows


def replay_flips(routing: Routing) -> torch.Tensor | None:
    """The fraction of replayed (token, MoE layer) rows (missing rows, -1, left out) whose router would have chosen
    another set of experts than the replayed one, from the kept logits (fp32 scalar): how much of the routing the
    replay overrode. None without a replay or kept logits."""
    if routing.replay is None or not routing.router_logits:
        return None
    differ = rows = None
    for layer, logits in routing.router_logits.items():
        want = routing.replay.get(layer)
        if want is None or want.shape[0] != logits.shape[0]:  # e.g. a loss that ran the model twice
            continue
        probs = torch.softmax(logits.detach(), dim=-1, dtype=torch.float32)
        own = torch.topk(probs, want.shape[1], dim=-1).indices.sort(dim=-1).values
        want = want.to(device=own.device, dtype=torch.long)
        given = (want >= 0).all(dim=-1)
        d = ((own != want.sort(dim=-1).values).any(dim=-1) & given).sum()
        differ = d if differ is None else differ + d
        rows = given.sum() if rows is None else rows + given.sum()
    if differ is None:
        return None
    return differ.float() / rows.clamp(min=1).float()


@contextmanager
def routing_scope(model: nn.Module, routing: Routing) -> Iterator[Routing]:
    """Hand ``routing`` to every ``model(...)`` call in the block that passes no ``routing`` itself (a loss
    function that does not know about MoE, run by the training engine). Restores the previous scope on exit."""
    previous = getattr(model, "default_routing", None)
    model.default_routing = routing
    try:
        yield routing
    finally:
        model.default_routing = previous
