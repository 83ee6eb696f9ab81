"""polyrl.models: one decoder for Llama / Mistral / Qwen2 / Qwen2.5 / Qwen3 and the mixture-of-experts families
Qwen3-MoE / Qwen2-MoE / OLMoE / Mixtral (``moe.py``) on ``polyrl.kernels``, HF checkpoints in and out, and the
project's own random-initialised presets.

Importing this package imports torch and ``polyrl.kernels`` but never transformers (only tokenizer
loading and building import it, lazily).
"""

from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.checkpoint import load_config, load_model, load_tokenizer, save_model
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import DecoderLM, DecoderOptions, build_model, init_weights
from polyrl.models.moe import Routing, load_balancing_loss, router_z_loss
from polyrl.models.presets import PRESETS, create_model_from_preset, preset_config
from polyrl.models.registry import FAMILIES, get_family, supported_model_types

__all__ = [
    "FAMILIES",
    "PRESETS",
    "Routing",
    "AttnMetadata",
    "DecoderLM",
    "DecoderOptions",
    "ModelConfig",
    "build_model",
    "create_model_from_preset",
    "get_family",
    "init_weights",
    "load_balancing_loss",
    "load_config",
    "load_model",
    "load_tokenizer",
    "preset_config",
    "router_z_loss",
    "save_model",
    "supported_model_types",
]
