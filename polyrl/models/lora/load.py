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

from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.checkpoint import load_model
from polyrl.models.lora.apply import apply_lora, lora_layers
from polyrl.models.lora.config import LoraConfig
from polyrl.models.lora.peft_io import is_adapter_dir, load_adapter, read_adapter_config


def base_model_path(path: str | Path, base: str | Path | None = None) -> str:
    """The base model folder of ``path``: itself for an HF folder; for a PEFT adapter folder ``base`` when given (the
    user repointing it: ``--base DIR``), else the adapter's ``base_model_name_or_path``.

    That field holds the base as the user passed it when training (a path as given on the command line, relative
    or absolute, or a hub id), never made absolute, so an adapter folder can move between machines. A relative
    value is looked up relative to the current directory first (where the training command ran, when run from
    there), then relative to the adapter folder's parent (an adapter shipped beside its base), then inside the
    adapter folder; the first that holds a ``config.json`` wins and is returned as that path (relative when the
    parts were). A base that is none of these (moved, on another machine, a hub id not downloaded) raises a
    ``CheckpointError`` naming what was looked for and the ``--base`` flag that repoints it."""
    if not is_adapter_dir(path):
        if base is not None:
            raise ConfigError(
                f"--base {base} repoints the base of a PEFT adapter folder, but {path} is a full model folder "
                f"(no adapter_config.json); drop --base, or give the adapter folder as the model"
            )
        return str(path)
    if base is not None:
        if not (Path(base) / "config.json").is_file():
            raise CheckpointError(
                f"--base {base}: no config.json there (looked for {Path(base) / 'config.json'}); give the base model's "
                f"Hugging Face folder for adapter {path}"
            )
        return str(base)
    _, saved = read_adapter_config(path)
    if not saved:
        raise CheckpointError(f"adapter {path} has no base_model_name_or_path; pass the base model folder with --base")
    candidates = [Path(saved)]
    if not Path(saved).is_absolute():
        candidates += [Path(path).parent / saved, Path(path) / saved]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return str(candidate)
    looked = ", ".join(str(c) for c in dict.fromkeys(candidates))
    raise CheckpointError(
        f"the base model of adapter {path} is not here: its adapter_config.json names {saved!r} "
        f"(base_model_name_or_path), and no config.json was found in {looked}; pass the base model folder with "
        f"--base DIR (download it first if it is a hub id)"
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
    the adapter; ``lora.base`` repoints its base, see ``base_model_path``). ``model.lora_base`` records the base as
    given or found (not made absolute) for the adapter_config.json the run saves."""
    base = base_model_path(path, lora.base if lora is not None else None)
    model = load_model(base, dtype=dtype, device=device)
    if is_adapter_dir(path):
        saved, _ = read_adapter_config(path)
        quantize = lora.quantize_base if lora is not None else None
        load_adapter(model, path, quantize_base=quantize)
        if lora is not None:
            model.lora_config = dataclasses.replace(
                saved,
                dropout=lora.dropout,
                quantize_base=lora.quantize_base,
                merge_for_rollout=lora.merge_for_rollout,
                base=lora.base,
            )
            for _, layer in lora_layers(model):
                layer.dropout = lora.dropout
    else:
        if lora is None:
            raise CheckpointError(f"{path} is a full model, not an adapter; give a LoRA config to add adapters")
        apply_lora(model, lora, seed=seed)
    model.lora_base = base
    return model
