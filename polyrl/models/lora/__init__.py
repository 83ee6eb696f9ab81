"""LoRA and QLoRA for ``DecoderLM``: ``LoraConfig`` (+ the ``--lora`` string parser), ``LoraLinear``,
``LoraExperts`` (routed experts of MoE layers), ``NF4Experts`` (QLoRA's 4-bit routed experts without adapters),
``apply_lora`` and the merge / disable switches, PEFT adapter folders in and out, and loading a model for a LoRA
run. See ``docs/dev/contracts.md`` (Models) for the interface;
the NF4 base of QLoRA is ``polyrl.kernels.nf4``.
"""

from polyrl.models.lora.apply import (
    AdapterDisabled,
    adapter_parameters,
    adapters_disabled,
    apply_lora,
    has_lora,
    lora_layers,
    merge_lora,
    merged,
    merged_state_dict,
    unmerge_lora,
    unwrap_lora,
)
from polyrl.models.lora.config import LoraConfig, make_lora_config, parse_lora_spec
from polyrl.models.lora.experts import LoraExperts
from polyrl.models.lora.layer import LoraLinear
from polyrl.models.lora.load import base_model_path, load_lora_model
from polyrl.models.lora.nf4_experts import NF4Experts
from polyrl.models.lora.peft_io import is_adapter_dir, load_adapter, read_adapter_config, save_adapter

__all__ = [
    "AdapterDisabled",
    "LoraConfig",
    "LoraExperts",
    "LoraLinear",
    "NF4Experts",
    "adapter_parameters",
    "adapters_disabled",
    "apply_lora",
    "base_model_path",
    "has_lora",
    "is_adapter_dir",
    "load_adapter",
    "load_lora_model",
    "lora_layers",
    "make_lora_config",
    "merge_lora",
    "merged",
    "merged_state_dict",
    "parse_lora_spec",
    "read_adapter_config",
    "save_adapter",
    "unmerge_lora",
    "unwrap_lora",
]
