"""Supervised fine-tuning as a registered algorithm: the ``[sft]`` config, its loss and its data.

The loss is token cross-entropy on the target tokens (the data pipeline masks prompts; ``data.loss_on``
chooses which assistant turns count), through the fused ``kernels.linear_cross_entropy`` so no
``[T, V]`` logits are materialised. ``normalize`` picks the step's divisor: every target token weighs
the same ("tokens", the default and TRL's behaviour), or every sequence weighs the same ("sequences":
each sequence's mean token loss, averaged over the step's sequences).
The run loop is the shared offline one (``polyrl.run.offline``); nothing here loads models or data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polyrl import kernels
from polyrl.algorithms.spec import AlgorithmSpec
from polyrl.data.batch import PackedBatch
from polyrl.data.config import DataConfig
from polyrl.data.dataset import TokenizedData, build_sft
from polyrl.errors import ConfigError
from polyrl.train.losses import attention_metadata, causal_lm_loss

NORMALIZE = ("tokens", "sequences")


@dataclass
class SFTConfig:
    """The ``[sft]`` table."""

    normalize: str = "tokens"

    def __post_init__(self) -> None:
        if self.normalize not in NORMALIZE:
            raise ConfigError(f"sft.normalize must be one of {', '.join(NORMALIZE)}, got {self.normalize!r}")


def sequence_mean_loss(model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over the batch's sequences of each sequence's mean target-token cross-entropy (fp32 scalar).
    Sequences without target tokens contribute 0."""

    hidden = model(batch.input_ids, batch.position_ids, attention_metadata(batch))
    per_token = kernels.linear_cross_entropy(hidden, model.lm_head_weight, batch.labels, reduction="none")  # [T]
    seq_index = _sequence_index(batch.cu_seqlens, per_token.shape[0])  # [T]
    nseq = batch.cu_seqlens.numel() - 1
    sums = torch.zeros(nseq, dtype=torch.float32, device=per_token.device).index_add_(0, seq_index, per_token)
    counts = torch.zeros(nseq, dtype=torch.float32, device=per_token.device).index_add_(
        0, seq_index, (batch.labels != -100).float()
    )
    return (sums / counts.clamp(min=1.0)).sum(), {}


def _sequence_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` int64: which packed sequence each token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)


def make_loss(cfg: SFTConfig):
    """The engine loss function for ``cfg``."""
    if cfg.normalize == "sequences":
        return sequence_mean_loss

    return causal_lm_loss


def normalizer(cfg: SFTConfig, micro_batches: Sequence[Any]) -> float | None:
    """Divisor of the step's summed loss: None (target tokens, the engine default) or the sequence count."""
    if cfg.normalize == "sequences":
        return float(sum(_sequences_with_targets(b) for b in micro_batches))
    return None


def _sequences_with_targets(batch: PackedBatch) -> int:
    seq_index = _sequence_index(batch.cu_seqlens, batch.labels.numel())
    return int(torch.unique(seq_index[batch.labels != -100]).numel())


def build_data(data_cfg: DataConfig, tokenizer: Any, part: str, micro_batch_tokens: int) -> TokenizedData:
    """Tokenised, packable SFT data (``polyrl.data.build_sft``)."""
    return build_sft(data_cfg, tokenizer, part, micro_batch_tokens)


SPEC = AlgorithmSpec(
    name="sft",
    description="supervised fine-tuning: cross-entropy on assistant tokens of packed conversations",
    fixed_shapes=True,
    config_cls=SFTConfig,
    build_data=build_data,
    make_loss=make_loss,
    normalizer=normalizer,
)
