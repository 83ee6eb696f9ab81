"""Sequence-classification reward models: the model (``RewardModel``: polyrl's decoder + a scalar ``score`` head
read at each sequence's last token), its HF folder (``load_reward_model`` / ``save_reward_model``) and the scorer
an online run uses (``ModelScorer``, ``--reward-model PATH``).

The folder is what transformers' ``AutoModelForSequenceClassification`` reads and writes for Llama / Qwen2 /
Qwen3 / Mistral with ``num_labels = 1``: the backbone's ``model.*`` weights, ``score.weight`` ``[1, hidden]`` (no
bias), ``architectures = ["<Family>ForSequenceClassification"]``. transformers pools the last non-padding token of
each row; polyrl scores packed sequences at their last token, the same token (``pad_token_id`` is written to the
config so transformers can batch padded rows). ``polyrl train --algo rm`` (``polyrl.algorithms.rm``) trains one;
``load_reward_model`` also starts one from a causal LM (``lm_head`` dropped, a fresh seeded head).

``ModelScorer`` renders each (prompt messages + completion) with the reward model's own tokenizer and chat
template, exactly as ``--algo rm`` tokenised its training pairs, keeps the last ``model_max_len`` tokens, and scores
``model_batch_size`` sequences per forward on the run's device, without gradients.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyrl.data.batch import pack_sequences
from polyrl.data.chat import ChatTokenizer
from polyrl.data.examples import TokenizedSeq
from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.checkpoint import load_tokenizer, save_model
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import DecoderLM
from polyrl.models.hf_io import read_safetensors_folder
from polyrl.platform import device as pdevice
from polyrl.train.losses import attention_metadata

HEAD = "score.weight"
_IGNORED = ("lm_head.weight", ".rotary_emb.inv_freq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RewardModel(DecoderLM):
    """Decoder backbone (``forward -> hidden [T, H]``) + ``score = Linear(H, 1, bias=False)``, no LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.lm_head = None
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False)

    def sequence_rewards(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``[B]`` fp32: the score of each packed sequence, read at its last token."""
        last = (cu_seqlens[1:] - 1).long()
        return self.score(hidden[last]).squeeze(-1).float()

    def rewards(self, batch: Any) -> torch.Tensor:
        """``[B]`` fp32 scores of a packed batch (differentiable)."""
        hidden = self(batch.input_ids, batch.position_ids, attention_metadata(batch))
        return self.sequence_rewards(hidden, batch.cu_seqlens)


def load_reward_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0
) -> RewardModel:
    """A reward model from ``path``: a sequence-classification folder (``score.weight``), or a causal LM whose
    backbone starts one (the head drawn from N(0, initializer_range) with ``seed``)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"reward model folder {folder} has no config.json; give an HF model folder")
    cfg = ModelConfig.from_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    if raw.get("num_labels", 1) != 1 and any("SequenceClassification" in a for a in raw.get("architectures", [])):
        raise CheckpointError(f"{folder} has num_labels={raw['num_labels']}; a reward model has one score (1)")
    tensors = {k: v for k, v in read_safetensors_folder(folder).items() if not k.endswith(_IGNORED)}
    with torch.device("meta"):
        model = RewardModel(cfg)
    own = model.state_dict()
    fresh = HEAD not in tensors
    missing = sorted(k for k in own if k not in tensors and not (fresh and k == HEAD))
    unexpected = sorted(set(tensors) - set(own))
    bad = sorted(k for k in set(own) & set(tensors) if tuple(own[k].shape) != tuple(tensors[k].shape))
    if missing or unexpected or bad:
        raise CheckpointError(
            f"{folder} does not fit a {cfg.model_type} reward model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, wrong shape {bad[:5]}"
        )
    state = {k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}
    if fresh:
        gen = torch.Generator().manual_seed(seed)
        std = float(raw.get("initializer_range", 0.02))
        state[HEAD] = (torch.randn(1, cfg.hidden_size, generator=gen) * std).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    return model


def mark_sequence_classification(out: str | Path, pad_token_id: int | None = None) -> Path:
    """Rewrite a saved folder's config as ``<Family>ForSequenceClassification`` with ``num_labels = 1``."""
    out = Path(out)
    cfg_path = out / "config.json"
    d = json.loads(cfg_path.read_text())
    archs = d.get("architectures") or []
    d["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification") for a in archs]
    d["num_labels"] = 1
    d["id2label"], d["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    d["problem_type"] = "regression"
    if d.get("pad_token_id") is None and pad_token_id is not None:
        d["pad_token_id"] = int(pad_token_id)
    cfg_path.write_text(json.dumps(dict(sorted(d.items())), indent=2) + "\n")
    return out


def save_reward_model(model: RewardModel, out_dir: str | Path, tokenizer: Any = None) -> Path:
    """An HF ``<Family>ForSequenceClassification`` folder holding ``model``, atomically."""
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return mark_sequence_classification(save_model(model, out_dir, tokenizer=tokenizer), pad)


class ModelScorer:
    """Scores completions with the reward model at ``path`` (``cfg``: the run's ``RewardConfig``)."""

    def __init__(self, path: str, cfg: Any, device: Any = None, dtype: torch.dtype | None = None) -> None:
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"reward model {path!r} has no config.json; give a sequence-classification model folder")
        self.device = torch.device(device) if device is not None else pdevice.torch_device()
        if cfg.model_dtype != "auto":
            dtype = DTYPES[cfg.model_dtype]
        self.dtype = dtype or torch.float32
        self.model = load_reward_model(folder, self.dtype, self.device).eval().requires_grad_(False)
        self.chat = ChatTokenizer(load_tokenizer(str(folder)))
        self.batch_size, self.max_len = cfg.model_batch_size, cfg.model_max_len

    def close(self) -> None:
        self.model = None

    def encode(self, completion: str, example: Mapping[str, Any]) -> list[int]:
        """The token ids the reward model reads for ``completion`` after the example's prompt messages."""
        messages = list(example.get("messages") or [{"role": "user", "content": example.get("prompt", "")}])
        seq = self.chat.tokenize_messages([*messages, {"role": "assistant", "content": completion}], len(messages))
        return seq.input_ids[-self.max_len :]

    @torch.no_grad()
    def score_ids(self, ids: Sequence[Sequence[int]]) -> list[float]:
        """Scores of token sequences, ``batch_size`` per forward."""
        out: list[float] = []
        for start in range(0, len(ids), self.batch_size):
            chunk = [TokenizedSeq(list(x), [1] * len(x)) for x in ids[start : start + self.batch_size]]
            batch = pack_sequences(chunk).to(self.device)
            out += self.model.rewards(batch).tolist()
        return out

    def outcomes(
        self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, Any, dict[str, float]]]:
        results: list[tuple[str, Any, dict[str, float]] | None] = [None] * len(completions)
        ok, ids = [], []
        for i, (c, e) in enumerate(zip(completions, examples)):
            try:
                x = self.encode(c, e)
            except Exception as exc:  # noqa: BLE001 - a row the template refuses is that sample's failure
                results[i] = ("error", f"reward model input: {type(exc).__name__}: {exc}"[:300], {})
                continue
            if not x:
                results[i] = ("error", "reward model input is empty", {})
                continue
            ok.append(i)
            ids.append(x)
        for i, r in zip(ok, self.score_ids(ids)):
            results[i] = ("ok", r, {}) if torch.isfinite(torch.tensor(r)) else ("non_number", f"score {r}", {})
        return [r for r in results if r is not None]


__all__ = ["ModelScorer", "RewardModel", "load_reward_model", "mark_sequence_classification", "save_reward_model"]
