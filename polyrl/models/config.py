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
RUN_MARKERS = ("run_config.json", "checkpoints", "metrics.jsonl")  # what a `polyrl train` run directory holds
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
    # Mixture of experts (families with ``FamilySpec.moe``; ``polyrl/models/moe.py``). 0 experts = a dense model.
    num_experts: int = 0  # routed experts per MoE layer (Mixtral's num_local_experts)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int | None = None  # each expert's SwiGLU width (OLMoE/Mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum 1 (Mixtral always does)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's shared expert (None/0: none)
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers (intermediate_size MLP)
    router_aux_loss_coef: float = 0.001  # load-balancing loss coefficient (added when output_router_logits)
    output_router_logits: bool = False  # HF: training adds router_aux_loss_coef * aux_loss to the loss
    router_z_loss_coef: float = 0.0  # router z-loss coefficient (config.json ``router_z_loss_coef`` where present)
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
        self._check_moe(family)

    def _check_moe(self, family: FamilySpec) -> None:
        moe = family.moe
        if moe is None:
            if self.num_experts:
                raise ConfigError(f"model_type {self.model_type!r} is dense; num_experts must be 0")
            return
        if moe.expert_size_key == "intermediate_size" and self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if moe.topk_norm == "always":
            self.norm_topk_prob = True
        self.mlp_only_layers = sorted(int(i) for i in self.mlp_only_layers)
        if self.num_experts <= 0:
            raise ConfigError(f"{self.model_type}: {moe.experts_key} must be positive, got {self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"{self.model_type}: num_experts_per_tok must be in 1..{moe.experts_key} ({self.num_experts}), "
                f"got {self.num_experts_per_tok}"
            )
        if not self.moe_intermediate_size or self.moe_intermediate_size <= 0:
            raise ConfigError(f"{self.model_type}: {moe.expert_size_key} must be positive")
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step must be an integer >= 1, got {self.decoder_sparse_step!r}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers {bad} are not layers of this {self.num_layers}-layer model")
        if (self.decoder_sparse_step != 1 or self.mlp_only_layers) and not moe.sparse_step:
            raise ConfigError(f"{self.model_type} has no dense layers; drop decoder_sparse_step / mlp_only_layers")
        if self.shared_expert_intermediate_size and not moe.shared_expert:
            raise ConfigError(f"{self.model_type} has no shared expert; drop shared_expert_intermediate_size")
        if moe.shared_expert and not self.shared_expert_intermediate_size:
            raise ConfigError(f"{self.model_type} needs a positive shared_expert_intermediate_size")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if float(getattr(self, name)) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    # ----- derived facts -------------------------------------------------------------------------
    @property
    def family(self) -> FamilySpec:
        return get_family(self.model_type)

    @property
    def o_bias(self) -> bool:
        spec = self.family.o_bias
        return self.attention_bias if spec == "config" else bool(spec)

    @property
    def is_moe(self) -> bool:
        return self.family.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` holds a sparse MoE block (HF: not in mlp_only_layers and (i + 1) % step == 0)."""
        if not self.is_moe:
            return False
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

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
        _check_unsupported_moe(d, family)
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
        known.update(_moe_from_hf(d, family))
        extra = {k: v for k, v in d.items() if k not in _HF_KEYS_WE_WRITE and k not in _MOE_KEYS}
        return cls(**known, extra=extra)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            hint = run_dir_hint(path)
            if hint:
                raise CheckpointError(f"{path} is not a model folder (no config.json): {hint}")
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
            d[family.qkv_bias_key] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if family.sliding == "all":
            d["sliding_window"] = self.sliding_window
        elif family.sliding == "flag":
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
        elif family.sliding == "layer_types":
            types = self.layer_types or [FULL] * self.num_layers
            uses = self.sliding_window is not None and SLIDING in types
            d["use_sliding_window"] = uses
            d["sliding_window"] = self.sliding_window if uses else None
            d["max_window_layers"] = types.index(SLIDING) if uses else self.num_layers
            d["layer_types"] = list(types) if uses else [FULL] * self.num_layers
        if family.moe is not None:
            d.update(self._moe_to_hf(family))
        return d

    def _moe_to_hf(self, family: FamilySpec) -> dict[str, Any]:
        moe = family.moe
        d: dict[str, Any] = {
            moe.experts_key: self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": self.output_router_logits,
        }
        if moe.expert_size_key != "intermediate_size":
            d[moe.expert_size_key] = self.moe_intermediate_size
        if moe.topk_norm == "config":
            d["norm_topk_prob"] = self.norm_topk_prob
        if moe.sparse_step:
            d["decoder_sparse_step"] = self.decoder_sparse_step
            d["mlp_only_layers"] = list(self.mlp_only_layers)
        if moe.shared_expert:
            d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.router_z_loss_coef:
            d["router_z_loss_coef"] = self.router_z_loss_coef
        if self.model_type == "olmoe":
            d["clip_qkv"] = None
        if self.model_type == "mixtral":
            d["router_jitter_noise"] = 0.0
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


# MoE keys read into ModelConfig fields (never kept in ``extra``; written back by ``_moe_to_hf``).
_MOE_KEYS = {
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",
    "router_z_loss_coef",
    "qkv_bias",
    "clip_qkv",
    "router_jitter_noise",
}


def _check_unsupported_moe(d: dict[str, Any], family: FamilySpec) -> None:
    """Options of the MoE families that the decoder does not implement: a clear error, not a silent mismatch."""
    if d.get("clip_qkv") is not None:
        raise ConfigError(
            f"clip_qkv={d['clip_qkv']} (OLMoE's q/k/v clamping) is not supported; use a checkpoint trained without it "
            "(clip_qkv: null, as the released OLMoE models are)"
        )
    if float(d.get("router_jitter_noise") or 0.0) != 0.0:
        raise ConfigError(
            f"router_jitter_noise={d['router_jitter_noise']} is not supported; set it to 0.0 in config.json "
            "(the routing is then deterministic, as in the released Mixtral models)"
        )
    if family.moe is None:
        return
    extra_experts = {"n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group"} & set(d)
    if extra_experts:
        raise ConfigError(
            f"{d['model_type']} config has {sorted(extra_experts)}, which this family does not define; "
            "is the model_type right?"
        )


def _moe_from_hf(d: dict[str, Any], family: FamilySpec) -> dict[str, Any]:
    moe = family.moe
    if moe is None:
        return {}
    experts = d.get(moe.experts_key, d.get("num_experts", d.get("num_local_experts")))
    if experts is None:
        raise CheckpointError(f"config.json of a {d['model_type']} model lacks {moe.experts_key!r}")
    size = d.get(moe.expert_size_key)
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(d.get("num_experts_per_tok", 0)),
        "moe_intermediate_size": None if size is None else int(size),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)) or moe.topk_norm == "always",
        "shared_expert_intermediate_size": (
            int(d["shared_expert_intermediate_size"])
            if moe.shared_expert and d.get("shared_expert_intermediate_size")
            else None
        ),
        "decoder_sparse_step": _sparse_step(d.get("decoder_sparse_step")) if moe.sparse_step else 1,
        "mlp_only_layers": [int(i) for i in (d.get("mlp_only_layers") or [])] if moe.sparse_step else [],
        "router_aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001)),
        "output_router_logits": bool(d.get("output_router_logits", False)),
        "router_z_loss_coef": float(d.get("router_z_loss_coef") or 0.0),
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
    if family.qkv_bias != "config":
        return bool(family.qkv_bias)
    default = family.qkv_bias_key == "qkv_bias"  # Qwen2-MoE's qkv_bias defaults to true
    return bool(d.get(family.qkv_bias_key, default))


def _sliding_from_hf(d: dict[str, Any], family: FamilySpec, layers: int) -> tuple[int | None, list[str] | None]:
    """(window, layer_types) as transformers resolves them for this family."""
    if family.sliding == "none":
        return None, None
    window = d.get("sliding_window", family.default_sliding_window)
    if family.sliding == "all":
        return (int(window) if window else None), None
    if family.sliding == "flag":  # Qwen3-MoE: every layer, only with use_sliding_window
        return (int(window) if d.get("use_sliding_window", False) and window else None), None
    # Qwen: the window applies only with use_sliding_window, to the layers layer_types (or max_window_layers) name.
    if not d.get("use_sliding_window", False) or not window:
        return None, None
    types = d.get("layer_types")
    if not types:
        first = int(d.get("max_window_layers", layers))
        if family.window_rule == "odd_below_max":  # Qwen2-MoE: 1st, 3rd, ... layer below max_window_layers
            types = [SLIDING if (i + 1) % 2 and i < first else FULL for i in range(layers)]
        else:
            types = [SLIDING if i >= first else FULL for i in range(layers)]
    return int(window), list(types)


def run_dir_hint(path: str | Path) -> str:
    """For a folder that is a ``polyrl train`` run directory rather than a model, the model folders inside it to
    give instead (``final``, ``best``) as one clause; '' for any other path. Reads names on disk only."""
    p = Path(path)
    if not p.is_dir() or not any((p / m).exists() for m in RUN_MARKERS):
        return ""
    models = [
        str(p / name)
        for name in ("final", "best")
        if (p / name / "config.json").is_file() or (p / name / "adapter_config.json").is_file()
    ]
    if models:
        best = " (best: the --keep-best step's)" if len(models) > 1 else ""
        return f"it is a polyrl run directory; give its model folder {' or '.join(models)}{best}"
    return (
        "it is a polyrl run directory without a final model (the run did not finish); continue it with "
        f"`polyrl train ... --out {p} --resume`"
    )


def _sparse_step(value: Any) -> Any:
    """config.json's ``decoder_sparse_step``: absent or null means 1; anything else is kept for the check in
    ``ModelConfig`` (a 0 must not read as 1: transformers divides by it)."""
    if value is None:
        return 1
    return (
        int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value) else value
    )
