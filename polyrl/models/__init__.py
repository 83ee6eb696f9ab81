"""polyrl.models: one decoder for Llama / Mistral / Qwen2 / Qwen2.5 / Qwen3 on ``polyrl.kernels``, HF
checkpoints in and out, and the project's own random-initialised presets.

Importing this package imports torch and ``polyrl.kernels`` but never transformers (only tokenizer
loading and building import it, lazily).
"""

from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.checkpoint import load_config, load_model, load_tokenizer, save_model
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import DecoderLM, DecoderOptions, build_model, init_weights
from polyrl.models.presets import PRESETS, create_model_from_preset, preset_config
from polyrl.models.registry import FAMILIES, get_family, supported_model_types

__all__ = [
    "FAMILIES",
    "PRESETS",
    "AttnMetadata",
    "DecoderLM",
    "DecoderOptions",
    "ModelConfig",
    "build_model",
    "create_model_from_preset",
    "get_family",
    "init_weights",
    "load_config",
    "load_model",
    "load_tokenizer",
    "preset_config",
    "save_model",
    "supported_model_types",
]
