"""``ModelConfig``: the decoder's shape and options, parsed from and written back to HF ``config.json``.

Reads both config dialects transformers has used (``rope_theta`` + ``rope_scaling`` in 4.x,
``rope_parameters`` in 5.x) and writes both, so 4.x and 5.x load what we save. Per-layer sliding windows
are resolved once into ``layer_types``. It does not build modules (``decoder.py``) or read weights
(``checkpoint.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.registry import FamilySpec, get_family

FULL = "full_attention"
SLIDING = "sliding_attention"
SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...} without rope_theta; None = default
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (o_proj follows the family: see ``o_bias``)
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Extras beyond the contract's fields.
    layer_types: list[str] | None = None  # per layer FULL / SLIDING; None = all FULL (or all SLIDING with a window)
    initializer_range: float = 0.02
    torch_dtype: str | None = None  # dtype the checkpoint was saved in ("bfloat16", ...)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # unknown config.json keys, written back as-is

    def __post_init__(self) -> None:
        family = get_family(self.model_type)
        if family.qk_norm:
            self.qk_norm = True
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE:
                raise ConfigError(
                    f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}"
                )
            if kind == "default":
                self.rope_scaling = None
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive or null, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - {FULL, SLIDING})
            if bad:
                raise ConfigError(f"unsupported layer_types {bad}; supported: {FULL}, {SLIDING}")

    # ----- derived facts -------------------------------------------------------------------------
    @property
    def family(self) -> FamilySpec:
        return get_family(self.model_type)

    @property
    def o_bias(self) -> bool:
        spec = self.family.o_bias
        return self.attention_bias if spec == "config" else bool(spec)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys with q_pos - k_pos < window), or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])

    # ----- HF dict in and out --------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if "model_type" not in d:
            raise CheckpointError("config.json has no 'model_type'; it is not a Hugging Face causal LM config")
        family = get_family(d["model_type"])
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported; only silu (SwiGLU) decoders are")
        if d.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported; only bias-free MLPs (Llama/Qwen/Mistral) are")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            theta, scaling = _rope_from_hf(d)
            sliding_window, layer_types = _sliding_from_hf(d, family, layers)
            known = {
                "model_type": d["model_type"],
                "vocab_size": int(d["vocab_size"]),
                "hidden_size": hidden,
                "intermediate_size": int(d["intermediate_size"]),
                "num_layers": layers,
                "num_heads": heads,
                "num_kv_heads": int(d.get("num_key_value_heads") or heads),
                "head_dim": int(d.get("head_dim") or hidden // heads),
                "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
                "rope_theta": theta,
                "rope_scaling": scaling,
                "max_position_embeddings": int(d.get("max_position_embeddings", 4096)),
                "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
                "attention_bias": _qkv_bias(d, family),
                "qk_norm": family.qk_norm,
                "sliding_window": sliding_window,
                "bos_token_id": d.get("bos_token_id"),
                "eos_token_id": d.get("eos_token_id"),
                "pad_token_id": d.get("pad_token_id"),
                "layer_types": layer_types,
                "initializer_range": float(d.get("initializer_range", 0.02)),
                "torch_dtype": d.get("torch_dtype") or d.get("dtype"),
            }
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks the required key {exc.args[0]!r}") from None
        extra = {k: v for k, v in d.items() if k not in _HF_KEYS_WE_WRITE}
        return cls(**known, extra=extra)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path} not found; point to a Hugging Face model folder with a config.json")
        try:
            data = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({exc}); re-save or restore the file") from None
        return cls.from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents (without ``torch_dtype``/``architectures``, which the saver adds)."""
        family = self.family
        d: dict[str, Any] = dict(self.extra)
        d.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            attention_dropout=0.0,
            # Both rope dialects: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters.
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})},
        )
        if family.qkv_bias == "config":
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if family.sliding == "all":
            d["sliding_window"] = self.sliding_window
        elif family.sliding == "layer_types":
            types = self.layer_types or [FULL] * self.num_layers
            uses = self.sliding_window is not None and SLIDING in types
            d["use_sliding_window"] = uses
            d["sliding_window"] = self.sliding_window if uses else None
            d["max_window_layers"] = types.index(SLIDING) if uses else self.num_layers
            d["layer_types"] = list(types) if uses else [FULL] * self.num_layers
        return d


_HF_KEYS_WE_WRITE = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "initializer_range",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "attention_dropout",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "torch_dtype",
    "dtype",
    "architectures",
    "transformers_version",
    "_name_or_path",
}


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict | None]:
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        params = dict(params)
        theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
    if scaling is not None:
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return theta, scaling


def _qkv_bias(d: dict[str, Any], family: FamilySpec) -> bool:
    return bool(d.get("attention_bias", False)) if family.qkv_bias == "config" else bool(family.qkv_bias)


def _sliding_from_hf(d: dict[str, Any], family: FamilySpec, layers: int) -> tuple[int | None, list[str] | None]:
    """(window, layer_types) as transformers resolves them for this family."""
    if family.sliding == "none":
        return None, None
    window = d.get("sliding_window", family.default_sliding_window)
    if family.sliding == "all":
        return (int(window) if window else None), None
    # Qwen: the window applies only with use_sliding_window, to the layers layer_types (or max_window_layers) name.
    if not d.get("use_sliding_window", False) or not window:
        return None, None
    types = d.get("layer_types")
    if not types:
        first = int(d.get("max_window_layers", layers))
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    return int(window), list(types)
