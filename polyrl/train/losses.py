"""Loss functions in the engine's ``loss_fn(model, batch) -> (loss_sum, metrics)`` form, and the
attention metadata a packed batch needs.

A loss function returns the SUM of its per-token (or per-sequence) losses over the micro-batch; the
engine divides by the normaliser of the whole optimizer step. ``causal_lm_loss`` is the token-level
cross-entropy SFT uses (fused linear + cross-entropy, no [T, V] logits). Algorithm losses (DPO, GRPO,
PPO) live in ``polyrl.algorithms`` and follow the same form; this module holds none of them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from polyrl import kernels


def attention_metadata(batch: Any) -> Any:
    """Training-form attention metadata for a packed batch (``cu_seqlens`` int32 [B+1], ``max_seqlen``).

    Uses ``polyrl.models.attention_metadata.AttnMetadata`` when the models package provides it, else
    a plain namespace with the same training fields (paged fields None)."""
    try:
        from polyrl.models.attention_metadata import AttnMetadata
    except ImportError:
        AttnMetadata = None  # noqa: N806 - the class, when present
    cu = batch.cu_seqlens
    if AttnMetadata is not None:
        seqlens = (cu[1:] - cu[:-1]).tolist()
        return AttnMetadata.from_seqlens(seqlens, cu.device)
    return SimpleNamespace(
        cu_seqlens=cu,
        max_seqlen=int(batch.max_seqlen),
        kv_caches=None,
        slot_mapping=None,
        block_tables=None,
        context_lens=None,
    )


def causal_lm_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed next-token cross-entropy over ``batch.labels != -100`` (fp32 scalar), for ``DecoderLM``-like
    models: ``model(input_ids [T], position_ids [T], meta) -> hidden [T, H]`` and ``model.lm_head_weight``."""
    meta = attention_metadata(batch)
    hidden = model(batch.input_ids, batch.position_ids, meta)
    loss_sum = kernels.linear_cross_entropy(hidden, model.lm_head_weight, batch.labels, reduction="sum")
    return loss_sum, {}
