"""Named model shapes for ``polyrl init-model``: random-initialised HF checkpoints the project makes itself.

``tiny`` and ``small`` are for CPU tests and demos (seconds to train on CPU), ``tiny-moe`` is their
mixture-of-experts sibling (Qwen3-MoE, 8 experts, top-2); the ``*-shape`` presets and ``qwen3-30b-a3b`` keep
the real dimensions and vocabulary size of public models for benchmarks (random weights, our own BPE
tokenizer padded to the real vocab size, ChatML template). Any preset name with a ``-LN`` suffix keeps only its
first N layers (``qwen3-30b-a3b-L8``: a shape that fits one GPU for full training); ``PRESETS[name]`` and
``name in PRESETS`` resolve such names. Not here: training, or any real weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from polyrl.errors import UserError
from polyrl.models import tokenizer as tk
from polyrl.models.checkpoint import save_model
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import build_model


@dataclass(frozen=True)
class Preset:
    hf: dict[str, Any]  # config.json fields (tokenizer-dependent ids are filled in by create_model_from_preset)
    dtype: torch.dtype
    description: str
    trained_vocab: int = 4096  # BPE merges actually learnt; the rest of the vocab is filler
    extra: dict[str, Any] = field(default_factory=dict)


# the tiny preset's shape, shared by its MoE sibling
_TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=2048,
    rope_theta=10000.0,
    max_position_embeddings=2048,
)


def _qwen3(**kw: Any) -> dict[str, Any]:
    base = dict(
        model_type="qwen3",
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        vocab_size=151936,
        initializer_range=0.02,
    )
    base.update(kw)
    return base


class _Presets(dict):
    """The preset table; a name ``<preset>-L<N>`` (N from 1 to the preset's layer count) is that preset with its
    first N layers, resolved on lookup (``PRESETS["qwen3-30b-a3b-L8"]``, ``"qwen3-30b-a3b-L8" in PRESETS``) and
    never listed."""

    def __missing__(self, name: str) -> Preset:
        m = re.fullmatch(r"(.+)-L(\d+)", name) if isinstance(name, str) else None
        if m is None or not dict.__contains__(self, m[1]):
            raise KeyError(name)
        base, layers = dict.__getitem__(self, m[1]), int(m[2])
        if not 1 <= layers <= base.hf["num_hidden_layers"]:
            raise KeyError(name)
        hf = {**base.hf, "num_hidden_layers": layers}
        return replace(base, hf=hf, description=f"{base.description}; first {layers} layers only")

    def __contains__(self, name: object) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True


PRESETS: dict[str, Preset] = _Presets(
    {
        "tiny": Preset(
            _qwen3(**_TINY),
            torch.float32,
            "qwen3 family, hidden 64, 2 layers, vocab 2048 (~0.2M params): CPU tests",
            trained_vocab=2048,
        ),
        "tiny-moe": Preset(
            _qwen3(
                **_TINY,
                model_type="qwen3_moe",
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                router_aux_loss_coef=0.01,
                output_router_logits=True,
            ),
            torch.float32,
            "qwen3_moe family, hidden 64, 2 layers, 8 experts top-2, vocab 2048 (~0.2M params, aux loss on): CPU tests",
            trained_vocab=2048,
        ),
        "small": Preset(
            _qwen3(
                hidden_size=256,
                intermediate_size=768,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                vocab_size=4096,
                rope_theta=10000.0,
                max_position_embeddings=4096,
            ),
            torch.float32,
            "qwen3 family, hidden 256, 4 layers, vocab 4096 (~4M params): CPU demos",
        ),
        "qwen3-0.6b-shape": Preset(
            _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
            torch.bfloat16,
            "Qwen3-0.6B dimensions (596M params, vocab 151936), random weights",
        ),
        "qwen3-1.7b-shape": Preset(
            _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
            torch.bfloat16,
            "Qwen3-1.7B dimensions (1.7B params, vocab 151936), random weights",
        ),
        "qwen3-8b-shape": Preset(
            _qwen3(
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=36,
                num_attention_heads=32,
                tie_word_embeddings=False,
            ),
            torch.bfloat16,
            "Qwen3-8B dimensions (8.2B params, vocab 151936, untied head), random weights",
        ),
        "llama3.2-1b-shape": Preset(
            dict(
                model_type="llama",
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                rms_norm_eps=1e-5,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
                max_position_embeddings=131072,
                tie_word_embeddings=True,
                vocab_size=128256,
                initializer_range=0.02,
            ),
            torch.bfloat16,
            "Llama-3.2-1B dimensions (1.24B params, vocab 128256), random weights",
        ),
        "qwen3-30b-a3b": Preset(
            _qwen3(
                model_type="qwen3_moe",
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                tie_word_embeddings=False,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                norm_topk_prob=True,
                router_aux_loss_coef=0.001,
            ),
            torch.bfloat16,
            "Qwen3-30B-A3B dimensions (30.5B params, 3.3B active, 128 experts top-8, vocab 151936), random weights",
        ),
    }
)


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)} (a -LN suffix, e.g. "
            "qwen3-30b-a3b-L8, keeps the first N layers)"
        )
    return PRESETS[name]


def preset_config(name: str, tokenizer: Any = None) -> ModelConfig:
    """The preset's ``ModelConfig``; special-token ids come from ``tokenizer`` (the ChatML one when None)."""
    hf = dict(get_preset(name).hf)
    if tokenizer is None:  # ids are fixed by the trainer: special tokens first, in SPECIAL_TOKENS order
        ids = {t: i for i, t in enumerate(tk.SPECIAL_TOKENS)}
        eos, pad = ids[tk.EOS_TOKEN], ids[tk.PAD_TOKEN]
    else:
        eos, pad = tokenizer.convert_tokens_to_ids(tk.EOS_TOKEN), tokenizer.convert_tokens_to_ids(tk.PAD_TOKEN)
    hf.update(bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    return ModelConfig.from_hf_dict(hf)


def create_model_from_preset(
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a random-initialised HF checkpoint (weights, config, generation config, tokenizer with chat
    template) for ``preset`` to ``out_dir`` (atomically) and return the folder. Deterministic per seed."""
    spec = get_preset(preset)
    tokenizer = tk.build_tokenizer(
        spec.hf["vocab_size"],
        trained_vocab=spec.trained_vocab,
        seed=0,
        model_max_length=spec.hf["max_position_embeddings"],
    )
    cfg = preset_config(preset, tokenizer)
    model = build_model(cfg, dtype=dtype or spec.dtype, device=device, seed=seed)
    generation = {"do_sample": True, "temperature": 1.0, "top_p": 1.0}
    return save_model(model, out_dir, tokenizer=tokenizer, generation_config=generation)
