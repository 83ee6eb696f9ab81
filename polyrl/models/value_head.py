"""The PPO critic: a ``DecoderLM`` backbone with a scalar value head, as a SEPARATE model from the policy.

This is what verl (``critic.model.path``, an ``AutoModelForTokenClassification`` with ``num_labels=1``) and TRL
(``value_model``) users expect: the critic has its own weights, optimizer and learning rate, and is initialised
from the policy checkpoint (or any other compatible folder, e.g. a reward model) with a fresh head.

- ``ValueModel(cfg)``: a ``DecoderLM`` subclass (same ``model.*`` parameter names, ``forward -> hidden [T, H]``,
  gradient checkpointing, compile and FLOPs as the policy, so ``TrainEngine`` trains it unchanged) without an LM
  head, plus ``score = Linear(H, 1)`` (HF's token-classification head name, with bias). ``values(hidden) -> [T]``
  fp32; ``value(input_ids, position_ids, meta)`` does both.
- ``load_value_model(path)``: from a critic folder (it has ``score.*``) or from a causal-LM folder (the backbone
  is taken, ``lm_head`` ignored, the head starts at zero so every initial value is 0).
- ``save_value_model(model, out)``: an HF folder whose config says ``<Family>ForTokenClassification`` with
  ``num_labels = 1``: transformers' ``AutoModelForTokenClassification`` (and verl) load it.
Not here: the value loss, GAE or the critic's training loop (``polyrl.algorithms.ppo``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyrl.errors import CheckpointError
from polyrl.models.checkpoint import save_model
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import DecoderLM
from polyrl.models.hf_io import read_safetensors_folder

HEAD_PREFIX = "score."
_IGNORED = ("lm_head.weight", ".rotary_emb.inv_freq")


class ValueModel(DecoderLM):
    """Backbone + scalar head (see the module docstring). ``lm_head_weight`` still names the embedding (unused)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.lm_head = None  # a critic predicts values, not tokens
        self.score = nn.Linear(cfg.hidden_size, 1, bias=True)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T]`` fp32: the value of the state at each position (after seeing tokens <= t)."""
        return self.score(hidden).squeeze(-1).float()

    def value(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        return self.values(self(input_ids, position_ids, meta))


def zero_head(model: ValueModel) -> ValueModel:
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.bias.zero_()
    return model


def load_value_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> ValueModel:
    """A critic from ``path``: a saved critic (with ``score.*``) or a causal LM whose backbone starts the critic."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"critic model folder {folder} has no config.json; give an HF model folder")
    cfg = ModelConfig.from_pretrained(folder)
    tensors = {k: v for k, v in read_safetensors_folder(folder).items() if not k.endswith(_IGNORED)}
    with torch.device("meta"):
        model = ValueModel(cfg)
    model = model.to(dtype)
    own = model.state_dict()
    fresh_head = not any(k.startswith(HEAD_PREFIX) for k in tensors)
    missing = sorted(k for k in own if k not in tensors and not (fresh_head and k.startswith(HEAD_PREFIX)))
    unexpected = sorted(set(tensors) - set(own))
    bad = sorted(k for k in set(own) & set(tensors) if tuple(own[k].shape) != tuple(tensors[k].shape))
    if missing or unexpected or bad:
        raise CheckpointError(
            f"{folder} does not fit a {cfg.model_type} critic: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {bad[:5]}"
        )
    state = {k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}
    if fresh_head:
        state[HEAD_PREFIX + "weight"] = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device)
        state[HEAD_PREFIX + "bias"] = torch.zeros(1, dtype=dtype, device=device)
    model.load_state_dict(state, assign=True, strict=True)
    return model


def save_value_model(model: ValueModel, out_dir: str | Path, tokenizer: Any = None) -> Path:
    """An HF ``<Family>ForTokenClassification`` folder (``num_labels = 1``) holding the critic, atomically."""
    return mark_token_classification(save_model(model, out_dir, tokenizer=tokenizer))


def mark_token_classification(out: Path) -> Path:
    """Rewrite a saved folder's config as ``<Family>ForTokenClassification`` with ``num_labels = 1``."""
    cfg_path = out / "config.json"
    d = json.loads(cfg_path.read_text())
    d["architectures"] = [a.replace("ForCausalLM", "ForTokenClassification") for a in d.get("architectures", [])]
    d["num_labels"] = 1
    d["id2label"], d["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    cfg_path.write_text(json.dumps(dict(sorted(d.items())), indent=2) + "\n")
    return out


__all__ = ["ValueModel", "load_value_model", "mark_token_classification", "save_value_model", "zero_head"]
