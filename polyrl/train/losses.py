"""Loss functions in the engine's ``loss_fn(model, batch) -> (loss_sum, metrics)`` form, and the
attention metadata a packed batch needs.

A loss function returns the SUM of its per-token (or per-sequence) losses over the micro-batch; the
engine divides by the normaliser of the whole optimizer step. ``causal_lm_loss`` is the token-level
cross-entropy SFT uses (fused linear + cross-entropy, no [T, V] logits). Algorithm losses (DPO, GRPO,
PPO) live in ``polyrl.algorithms`` and follow the same form; this module holds none of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polyrl import kernels
from polyrl.models.attention_metadata import AttnMetadata


def attention_metadata(batch: Any) -> AttnMetadata:
    """Training-form attention metadata of a packed batch: its ``cu_seqlens`` int32 [B+1] (already on
    the batch's device, no host round trip) and ``max_seqlen``; paged fields None."""
    return AttnMetadata(cu_seqlens=batch.cu_seqlens, max_seqlen=int(batch.max_seqlen))


def causal_lm_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed next-token cross-entropy over ``batch.labels != -100`` (fp32 scalar), for ``DecoderLM``-like
    models: ``model(input_ids [T], position_ids [T], meta) -> hidden [T, H]`` and ``model.lm_head_weight``."""
    meta = attention_metadata(batch)
    hidden = model(batch.input_ids, batch.position_ids, meta)
    loss_sum = kernels.linear_cross_entropy(hidden, model.lm_head_weight, batch.labels, reduction="sum")
    return loss_sum, {}


causal_lm_loss.graph_safe = True  # no host sync, reads only tensors + max_seqlen (train/graphed_step.py)
