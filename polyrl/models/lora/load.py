"""Loading a model for a LoRA run: a base HF folder plus a fresh adapter, or a PEFT adapter folder (its base from
``base_model_name_or_path``) to start or continue from.

The base is loaded in the compute dtype (bf16 on accelerators), never fp32: it is frozen and gets no fp32 master,
so the only fp32 tensors of a LoRA run are the adapters' masters and moments. Not here: the run loop, checkpoints.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from polyrl.errors import CheckpointError
from polyrl.models.checkpoint import load_model
from polyrl.models.lora.apply import apply_lora, lora_layers
from polyrl.models.lora.config import LoraConfig
from polyrl.models.lora.peft_io import is_adapter_dir, load_adapter, read_adapter_config


def base_model_path(path: str | Path) -> str:
    """The base model folder of ``path``: itself for an HF folder, ``base_model_name_or_path`` for an adapter
    (relative paths are tried against the adapter folder too)."""
    if not is_adapter_dir(path):
        return str(path)
    _, base = read_adapter_config(path)
    if not base:
        raise CheckpointError(f"adapter {path} has no base_model_name_or_path; pass the base with --model")
    for candidate in (Path(base), Path(path) / base):
        if (candidate / "config.json").is_file():
            return str(candidate)
    raise CheckpointError(
        f"the base model of adapter {path} ({base!r}) is not a local folder with config.json; download it and set "
        f"base_model_name_or_path in {path}/adapter_config.json to its path"
    )


def load_lora_model(
    path: str | Path,
    lora: LoraConfig | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int | None = 0,
) -> nn.Module:
    """A ``DecoderLM`` with adapters. ``path``: an HF folder (fresh adapters from ``lora``) or a PEFT adapter
    folder (its adapters; ``lora``'s dropout, quantize_base and merge_for_rollout apply, r/alpha/targets come from
    the adapter). ``model.lora_base`` records the base folder for the saved adapter_config.json."""
    base = base_model_path(path)
    model = load_model(base, dtype=dtype, device=device)
    if is_adapter_dir(path):
        saved, _ = read_adapter_config(path)
        quantize = lora.quantize_base if lora is not None else None
        load_adapter(model, path, quantize_base=quantize)
        if lora is not None:
            model.lora_config = dataclasses.replace(
                saved, dropout=lora.dropout, quantize_base=lora.quantize_base, merge_for_rollout=lora.merge_for_rollout
            )
            for _, layer in lora_layers(model):
                layer.dropout = lora.dropout
    else:
        if lora is None:
            raise CheckpointError(f"{path} is a full model, not an adapter; give a LoRA config to add adapters")
        apply_lora(model, lora, seed=seed)
    model.lora_base = str(Path(base).resolve())
    return model
