"""Reward-model training (``polyrl train --algo rm``): Bradley-Terry on preference pairs, producing the
sequence-classification folder that ``--reward-model`` (``reward_sources.model``) and transformers'
``AutoModelForSequenceClassification`` load.

Data: the same (prompt, chosen, rejected) rows DPO reads (``polyrl.data.build_preference``: each pair packed into
one micro-batch, chosen first). The model (``RewardModel``) is the decoder of ``--model`` (a causal LM: its
``lm_head`` is dropped and a seeded ``score`` head added; or an existing reward model) with the score read at each
sequence's last token. Loss per pair, with ``r_c``, ``r_r`` the chosen and rejected scores:
``-logsigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2`` (``center_coef``: TRL's
``center_rewards_coefficient``, keeps scores near 0; 0 = off). Metrics (means over pairs): ``rewards/chosen``,
``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (r_c > r_r).
The final folder ``<out>/final`` is an HF ``<Family>ForSequenceClassification`` folder. Not here: the loop
(``polyrl.run.offline``), the data parsing (``polyrl.data``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from polyrl.algorithms.reward_sources.model import load_reward_model, mark_sequence_classification
from polyrl.algorithms.spec import AlgorithmSpec
from polyrl.data.batch import PackedBatch
from polyrl.data.config import DataConfig
from polyrl.data.dataset import TokenizedData, build_preference
from polyrl.errors import ConfigError


@dataclass
class RMConfig:
    """The ``[rm]`` table."""

    margin: float = 0.0
    center_coef: float = 0.0

    def __post_init__(self) -> None:
        for key in ("margin", "center_coef"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConfigError(f"rm.{key} must be a number, got {v!r}")
        if self.center_coef < 0:
            raise ConfigError(f"rm.center_coef must be >= 0 (0 = off; TRL suggests 0.01), got {self.center_coef}")


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Per-pair ``-log sigmoid(chosen - rejected - margin)`` ``[P]`` fp32."""
    return -F.logsigmoid(chosen.float() - rejected.float() - margin)


def make_loss(cfg: RMConfig):
    """The engine loss: sum over the batch's pairs, plus metric sums over pairs."""

    def loss_fn(model: Any, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if (batch.cu_seqlens.numel() - 1) % 2:
            raise RuntimeError("a reward-model batch must hold (chosen, rejected) pairs: an even number of sequences")
        r = model.rewards(batch)
        rc, rr = r[0::2], r[1::2]
        losses = bradley_terry_loss(rc, rr, cfg.margin)
        if cfg.center_coef:
            losses = losses + cfg.center_coef * (rc + rr) ** 2
        with torch.no_grad():
            metrics = {
                "rewards/chosen": rc.sum(),
                "rewards/rejected": rr.sum(),
                "rewards/margins": (rc - rr).sum(),
                "rewards/accuracies": (rc > rr).float().sum(),
            }
        return losses.sum(), metrics

    return loss_fn


def normalizer(cfg: RMConfig, micro_batches: Sequence[Any]) -> float:
    """The step's pair count: loss and metrics are means over preference pairs."""
    return float(sum((b.cu_seqlens.numel() - 1) // 2 for b in micro_batches))


def build_data(data_cfg: DataConfig, tokenizer: Any, part: str, micro_batch_tokens: int) -> TokenizedData:
    """Tokenised preference pairs, as DPO's (``polyrl.data.build_preference``)."""
    return build_preference(data_cfg, tokenizer, part, micro_batch_tokens)


def load_model(path: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """The model the run trains: a reward model from ``path`` (a causal LM gets a fresh head)."""
    return load_reward_model(path, dtype, device, seed=seed)


def finalize(folder: Path, tokenizer: Any) -> Path:
    """Mark a saved folder as ``<Family>ForSequenceClassification`` (num_labels 1, the tokenizer's pad id)."""
    return mark_sequence_classification(folder, getattr(tokenizer, "pad_token_id", None))


SPEC = AlgorithmSpec(
    name="rm",
    description="reward model: Bradley-Terry on (prompt, chosen, rejected) pairs -> a sequence-classification folder",
    config_cls=RMConfig,
    build_data=build_data,
    make_loss=make_loss,
    normalizer=normalizer,
    model_loader=load_model,
    finalize=finalize,
    plot_series=("rewards/margins", "rewards/accuracies"),
)
