"""Model families: HF ``model_type`` -> the few facts that make one decoder cover all of them.

A family is data (bias placement, q/k norm, how the sliding window is configured, HF class name), so
adding a Llama-like architecture is adding a row to ``FAMILIES``. This module does not build modules or
read checkpoints; ``decoder.py`` and ``checkpoint.py`` do, from what is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.errors import UserError


@dataclass(frozen=True)
class FamilySpec:
    """How one HF architecture maps onto ``DecoderLM``.

    ``qkv_bias`` / ``o_bias``: ``"config"`` reads ``attention_bias`` from config.json, otherwise a fixed bool.
    ``sliding``: ``"none"`` (never), ``"all"`` (every layer when ``sliding_window`` is set, Mistral) or
    ``"layer_types"`` (Qwen: ``use_sliding_window`` + ``max_window_layers`` or an explicit ``layer_types``).
    """

    model_type: str
    architecture: str  # HF class written to config.json "architectures"
    qkv_bias: bool | str = "config"
    o_bias: bool | str = "config"
    qk_norm: bool = False
    sliding: str = "none"
    default_sliding_window: int | None = None  # HF's default when config.json has no sliding_window key


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", "LlamaForCausalLM"),
    "mistral": FamilySpec(
        "mistral", "MistralForCausalLM", qkv_bias=False, o_bias=False, sliding="all", default_sliding_window=4096
    ),
    # Qwen2 and Qwen2.5 share model_type "qwen2": bias on q/k/v only, never on o_proj.
    "qwen2": FamilySpec(
        "qwen2", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False, sliding="layer_types", default_sliding_window=4096
    ),
    "qwen3": FamilySpec("qwen3", "Qwen3ForCausalLM", qk_norm=True, sliding="layer_types", default_sliding_window=4096),
}


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def get_family(model_type: str) -> FamilySpec:
    """The family for an HF ``model_type``; a clear ``UserError`` listing the supported ones otherwise."""
    spec = FAMILIES.get(model_type)
    if spec is None:
        raise UserError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())} "
            "(Qwen2.5 checkpoints use 'qwen2'). Use a checkpoint of one of these families."
        )
    return spec
