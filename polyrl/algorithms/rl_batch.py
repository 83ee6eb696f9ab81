"""The data that flows between the rollout engine and the RL losses: ``Sample`` (one completion or agentic episode
with the rollout's per-token log-probs), ``RLBatch`` (samples packed into one varlen micro-batch with per-token
fields), ``pack_samples`` / ``padding_batch`` to build them, and ``completion_logprobs`` (the differentiable
log-probs of a batch's completion tokens, through the fused ``kernels.token_logprobs``).

- ``Sample``: prompt ids, completion ids, the rollout engine's per-token log-probs (``log_softmax(logits / T)`` at
  each sampled token), finish reason, text, and its group (prompt index). An agentic episode (``polyrl.agents``) is
  one Sample whose ``mask`` (one per completion id) marks the policy's own tokens: only those are trained (labels
  -100 on tool outputs and user turns) and ``logprobs`` / per-token fields then hold one value per masked token.
  With partial rollouts (``polyrl.run.async_rollout``) ``token_versions`` gives each completion id's policy version
  (its ``logprobs`` entry is that version's behaviour log-prob) and ``policy_version`` the oldest of them.
- ``RLBatch``: a packed micro-batch of samples (``PackedBatch`` fields: labels are the completion tokens, -100 on
  the prompt) plus ``mask [T]`` (1.0 where ``labels`` is a completion token), ``seq_index [T]`` (sample within the
  micro-batch), ``sample_ids`` (positions in the caller's sample list) and ``fields``: per-token float tensors
  aligned with ``labels`` (``fields["adv"][t]`` belongs to the token predicted at t). Samples that carry the
  rollout's routing record (``routed_experts``, MoE) give the batch ``routing`` ``[T, L, k]`` and so its
  ``routing_replay`` (layer -> ``[T, k]``), which the training engine and ``ColocatedPolicy.logprobs`` force.

Not here: generating samples or training on batches (``polyrl.run.colocated``), the loss math (``losses``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from polyrl import kernels
from polyrl.train.losses import attention_metadata


@dataclass
class Sample:
    """One rollout completion (``group`` = index of its prompt in the ``rollout`` call, ``index`` = j of n)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    group: int = 0
    index: int = 0
    mask: list[int] | None = None  # per completion id, 1 = a policy token (trained); None = all of them
    masked_logmass: float | None = None  # constrained rollouts: sum of log(mass the grammar allowed) over its tokens
    # rollout-routing replay (MoE): the experts the rollout engine chose, int [num_tokens, L, k] (-1: a missing row,
    # e.g. the last token), L = the MoE layers ``routing_layers`` in order; None = not recorded
    routed_experts: torch.Tensor | None = None
    routing_layers: tuple[int, ...] = ()
    policy_version: int | None = None  # RL steps applied to the weights that generated it (async RL: staleness)
    # partial rollouts (async RL): per completion id, the policy version that generated it (a weight update may land
    # in the middle of a sequence); policy_version is then the oldest of them. None: one version for the whole sample
    token_versions: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_policy_tokens(self) -> int:
        return len(self.completion_ids) if self.mask is None else sum(1 for m in self.mask if m)


@dataclass
class RLBatch:
    """Packed samples for training or log-prob recompute (see the module docstring). Shapes: T tokens, B samples."""

    input_ids: torch.Tensor  # int64 [T]
    labels: torch.Tensor  # int64 [T], completion tokens, -100 elsewhere
    position_ids: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [B+1]
    max_seqlen: int
    num_target_tokens: int
    mask: torch.Tensor  # fp32 [T]
    seq_index: torch.Tensor  # int64 [T]
    sample_ids: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 [T] each
    routing: torch.Tensor | None = None  # int [T, L, k]: the samples' routed_experts packed (-1: missing rows)
    routing_layers: tuple[int, ...] = ()  # the MoE layer of each of routing's L columns
    # int64 [N]: the positions where ``mask`` is set, ascending (built on the host by ``pack_samples``), so the loss
    # gathers the completion rows without ``nonzero``'s host sync (a CUDA-graphed step cannot sync); None: derived
    targets: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.sample_ids)

    @property
    def routing_replay(self) -> dict[int, torch.Tensor] | None:
        """MoE layer -> int64 ``[T, k]`` experts to force (rollout-routing replay; ``models.moe.Routing.replay``), on
        the batch's device; None when its samples carry no record."""
        if self.routing is None:
            return None
        return {layer: self.routing[:, j].long() for j, layer in enumerate(self.routing_layers)}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RLBatch:
        """The batch on ``device``. Host -> CUDA copies never wait for the device (pageable memory is staged
        before the copy returns), so moving a micro-batch does not drain the queue of the one before it."""
        dest = torch.device(device)

        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(dest, non_blocking=non_blocking or (t.device.type == "cpu" and dest.type == "cuda"))

        return RLBatch(
            mv(self.input_ids),
            mv(self.labels),
            mv(self.position_ids),
            mv(self.cu_seqlens),
            self.max_seqlen,
            self.num_target_tokens,
            mv(self.mask),
            mv(self.seq_index),
            list(self.sample_ids),
            {k: mv(v) for k, v in self.fields.items()},
            mv(self.routing) if self.routing is not None else None,
            self.routing_layers,
            mv(self.targets) if self.targets is not None else None,
        )

    def per_sample(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``[T]`` tensor into each sample's completion-token values (in completion order)."""
        out = []
        sel = self.mask > 0
        for b in range(self.num_sequences):
            out.append(values[(self.seq_index == b) & sel])
        return out


def pack_samples(
    samples: Sequence[Sample],
    fields: dict[str, Sequence[Any]] | None = None,
    max_tokens: int = 8192,
    order: Sequence[int] | None = None,
) -> list[RLBatch]:
    """Pack ``samples`` (in ``order``, default as given) into micro-batches of at most ``max_tokens`` tokens (a
    longer sample gets a micro-batch of its own). ``fields[name][i]`` is sample i's value: a number (broadcast over
    its completion tokens) or a list with one value per completion token (per policy token for a masked sample)."""
    fields = fields or {}
    order = list(range(len(samples))) if order is None else list(order)
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = samples[i].num_tokens
        if cur and used + n > max_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return [_pack(samples, ids, fields) for ids in groups]


def _pack(samples: Sequence[Sample], ids: list[int], fields: dict[str, Sequence[Any]]) -> RLBatch:
    tokens: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    seq_index: list[int] = []
    cu = [0]
    vals: dict[str, list[float]] = {k: [] for k in fields}
    for b, i in enumerate(ids):
        s = samples[i]
        p, c = len(s.prompt_ids), s.num_policy_tokens
        seq = list(s.prompt_ids) + list(s.completion_ids)
        tokens.extend(seq)
        keep = s.mask if s.mask is not None else [1] * len(s.completion_ids)
        if len(keep) != len(s.completion_ids):
            raise ValueError(f"sample {i} has a mask of {len(keep)} for {len(s.completion_ids)} completion tokens")
        labels.extend([-100] * (p - 1) + [t if m else -100 for t, m in zip(s.completion_ids, keep)] + [-100])
        positions.extend(range(len(seq)))
        seq_index.extend([b] * len(seq))
        cu.append(cu[-1] + len(seq))
        for k, per in fields.items():
            v = per[i]
            per_tok = [float(x) for x in v] if isinstance(v, (list, tuple, torch.Tensor)) else [float(v)] * c
            if len(per_tok) != c:
                raise ValueError(f"field {k!r} of sample {i} has {len(per_tok)} values for {c} completion tokens")
            if s.mask is not None:  # scatter the policy tokens' values; 0 on observation tokens
                it = iter(per_tok)
                per_tok = [next(it) if m else 0.0 for m in keep]
            vals[k].extend([0.0] * (p - 1) + per_tok + [0.0])
    labels_t = torch.tensor(labels, dtype=torch.int64)
    mask = (labels_t != -100).float()
    routing, layers = _pack_routing(samples, ids)
    return RLBatch(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        labels=labels_t,
        position_ids=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(samples[i].num_tokens for i in ids),
        num_target_tokens=int(mask.sum()),
        mask=mask,
        seq_index=torch.tensor(seq_index, dtype=torch.int64),
        sample_ids=list(ids),
        fields={k: torch.tensor(v, dtype=torch.float32) for k, v in vals.items()},
        routing=routing,
        routing_layers=layers,
        targets=torch.nonzero(labels_t != -100).squeeze(-1),  # on the host: no device sync
    )


def _pack_routing(samples: Sequence[Sample], ids: list[int]) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """The packed samples' routing records ``[T, L, k]`` (a sample without one: rows of -1, its tokens keep the
    router's own choice), or (None, ()) when none has one."""
    recs = [samples[i] for i in ids if samples[i].routed_experts is not None]
    if not recs:
        return None, ()
    first = recs[0]
    layers, shape, dtype = tuple(first.routing_layers), first.routed_experts.shape[1:], first.routed_experts.dtype
    parts = []
    for i in ids:
        s = samples[i]
        r = s.routed_experts
        if r is None:
            parts.append(torch.full((s.num_tokens, *shape), -1, dtype=dtype))
            continue
        if tuple(s.routing_layers) != layers or r.shape[1:] != shape:
            raise ValueError(f"sample {i}'s routing record (layers {s.routing_layers}) does not match the others'")
        if r.shape[0] != s.num_tokens:
            raise ValueError(f"sample {i} has a routing record of {r.shape[0]} rows for {s.num_tokens} tokens")
        parts.append(r.to(device="cpu", dtype=dtype))
    return torch.cat(parts), layers


def padding_batch(like: RLBatch, keys: Sequence[str] | None = None) -> RLBatch:
    """A micro-batch with ``like``'s tokens but no target token (mask 0, labels -100, every field 0; ``keys``: the
    fields, default ``like``'s): it runs forward and backward (so a data-parallel rank with fewer micro-batches still
    joins every FSDP collective) and adds exactly 0 to the loss and its gradients."""
    return RLBatch(
        input_ids=like.input_ids,
        labels=torch.full_like(like.labels, -100),
        position_ids=like.position_ids,
        cu_seqlens=like.cu_seqlens,
        max_seqlen=like.max_seqlen,
        num_target_tokens=0,
        mask=torch.zeros_like(like.mask),
        seq_index=like.seq_index,
        sample_ids=list(like.sample_ids),
        fields={k: torch.zeros_like(like.mask) for k in (like.fields if keys is None else keys)},
        routing=like.routing,
        routing_layers=like.routing_layers,
        targets=torch.zeros(0, dtype=torch.int64, device=like.input_ids.device),
    )


def target_positions(batch: RLBatch) -> torch.Tensor:
    """int64 ``[N]``: where ``batch.mask`` is set, ascending; the packed ``targets`` (no device sync) when the batch
    has them, else ``nonzero`` of the mask (a host sync on an accelerator)."""
    if batch.targets is not None:
        return batch.targets
    return torch.nonzero(batch.mask > 0).squeeze(-1)


def completion_logprobs(
    model: nn.Module, batch: RLBatch, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[T]`` (0 off the completion) of each completion token under ``model`` at ``temperature``, and
    optionally the entropy ``[T]`` of the tempered distribution there; differentiable when grad is enabled.
    Uses the fused ``kernels.token_logprobs`` over the completion positions only (no ``[T, V]`` logits), gathered
    by ``target_positions`` (no host sync for a packed batch)."""
    hidden = model(batch.input_ids, batch.position_ids, attention_metadata(batch))  # [T, H]
    sel = target_positions(batch)
    out = kernels.token_logprobs(hidden[sel], model.lm_head_weight, batch.labels[sel], temperature, entropy)
    lp, ent = out if entropy else (out, None)
    full = torch.zeros(batch.input_ids.shape[0], dtype=torch.float32, device=hidden.device)
    full = full.index_put((sel,), lp.float())
    if ent is not None:
        ent = torch.zeros_like(full).index_put((sel,), ent.detach().float())
    return full, ent


__all__ = ["RLBatch", "Sample", "completion_logprobs", "pack_samples", "padding_batch", "target_positions"]
