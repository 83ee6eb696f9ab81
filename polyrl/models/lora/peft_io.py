"""PEFT adapter folders in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

Written so that ``peft.PeftModel.from_pretrained(hf_model, folder)`` loads it: tensor names
``base_model.model.<our name>`` (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), config fields
``peft_type = "LORA"``, ``task_type = "CAUSAL_LM"``, ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``use_rslora``, ``bias = "none"``, ``base_model_name_or_path``, and for routed experts ``target_parameters``
(``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``, tensors named as PEFT's nested ``ParamWrapper``s save
them: ``mlp.experts.base_layer.lora_A.weight [E * r, H]`` / ``lora_B.weight [2I, E * r]`` for ``gate_up_proj`` and
``mlp.experts.lora_A.weight [E * r, I]`` / ``lora_B.weight [H, E * r]`` for ``down_proj``; see
``experts.py``). Read: the same, from PEFT or from us (names with an adapter name such as
``.lora_A.default.weight`` are accepted too). Writes are atomic (temp folder + rename).

Refused with a ``CheckpointError`` that says why: DoRA, per-layer rank/alpha patterns, trained biases, extra saved
modules, regex targets, targets other than the seven decoder projections, target parameters other than the routed
experts' two tensors, dropout with target parameters (PEFT refuses it too). Not here: quantized bases (an adapter
never holds base weights), merging (``apply.py``), the training checkpoint around it (``polyrl.train``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.hf_io import (
    atomic_folder,
    open_safetensors,
    save_tokenizer,
    write_json,
    write_safetensors,
)
from polyrl.models.lora.apply import adapter_parameters, apply_lora, has_lora
from polyrl.models.lora.config import ALL_LINEAR, ALL_TARGETS, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config_dict(cfg: LoraConfig, base_model: str | None) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.targets),
        "target_parameters": list(cfg.target_parameters) or None,
        "use_rslora": cfg.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(
    model: nn.Module,
    out_dir: str | Path,
    base_model: str | None = None,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model``'s adapter as a PEFT folder (atomically). ``base_model`` goes to
    ``base_model_name_or_path`` as given (default: ``model.lora_base``, the base as the run was given it): a hub id or
    a path, never made absolute, so the folder does not carry this machine's layout (``base_model_path`` says how it
    is found again); ``tokenizer`` an object with ``save_pretrained`` or a folder to copy the tokenizer files from;
    ``dtype`` casts (default fp32)."""
    if not has_lora(model):
        raise ConfigError("this model has no LoRA adapters to save")
    base_model = base_model or getattr(model, "lora_base", None)
    base_model = str(base_model) if base_model is not None else None
    out = Path(out_dir)
    with atomic_folder(out) as tmp:
        tensors = {
            PREFIX + name: p.detach().to(dtype or torch.float32).cpu().contiguous()
            for name, p in adapter_parameters(model).items()
        }
        write_safetensors(tensors, tmp / ADAPTER_WEIGHTS)
        write_json(tmp / ADAPTER_CONFIG, adapter_config_dict(model.lora_config, base_model))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
    return out


def read_adapter_config(path: str | Path) -> tuple[LoraConfig, str | None]:
    """(``LoraConfig``, ``base_model_name_or_path``) of a PEFT adapter folder; unsupported options raise."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise CheckpointError(f"{path} is not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    try:
        d = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); re-save the adapter") from None
    if d.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{file}: peft_type {d.get('peft_type')!r} is not supported; only LORA adapters load")
    refused = {
        "use_dora": bool(d.get("use_dora")),
        "rank_pattern": bool(d.get("rank_pattern")),
        "alpha_pattern": bool(d.get("alpha_pattern")),
        "modules_to_save": bool(d.get("modules_to_save")),
        "bias": d.get("bias", "none") != "none",
        "fan_in_fan_out": bool(d.get("fan_in_fan_out")),
        "layers_to_transform": d.get("layers_to_transform") is not None,
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise CheckpointError(f"{file} uses {', '.join(bad)}, which polyrl's LoRA does not support; retrain without")
    targets = d.get("target_modules")
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            targets = list(ALL_TARGETS)
        else:
            raise CheckpointError(f"{file}: regex target_modules {targets!r} are not supported; list the module names")
    try:
        cfg = LoraConfig(
            r=d.get("r", 8),
            alpha=d.get("lora_alpha", 8),
            dropout=d.get("lora_dropout", 0.0),
            targets=list(targets or []),
            rslora=bool(d.get("use_rslora", False)),
            target_parameters=list(d.get("target_parameters") or []),
        )
    except ConfigError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    return cfg, d.get("base_model_name_or_path")


def _shape_key(cfg: LoraConfig) -> tuple:
    return cfg.r, list(cfg.targets), list(cfg.target_parameters)


def _spec(cfg: LoraConfig) -> str:
    """``cfg``'s adapter-defining settings as a ``--lora`` string (``r=8,alpha=16,targets=q_proj,v_proj``) that
    ``make_lora_config`` reads back to the same adapter."""
    spec = f"r={cfg.r},alpha={cfg.alpha:g}" + (",rslora=true" if cfg.rslora else "")
    return spec + f",targets={','.join([*cfg.targets, *cfg.target_parameters])}"  # experts' names go there too


def our_name(key: str) -> str:
    """A saved adapter tensor's name in our model (no ``base_model.model.`` prefix, no ``.default`` adapter name)."""
    name = key.removeprefix(PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.default.weight", f".{part}.weight")
    return name


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path, quantize_base: str | None = None) -> nn.Module:
    """Load the adapter folder ``path`` into ``model`` (adding adapters first when the model has none). Every
    adapter tensor must be present with its shape; values are cast to the adapter parameters' dtype in place."""
    cfg, base = read_adapter_config(path)
    if not has_lora(model):
        cfg.quantize_base = quantize_base
        try:  # the adapter's own targets, so a mismatch means another base model (and no advice on targets)
            apply_lora(model, cfg, seed=None, warn_unmatched=False)
        except ConfigError as exc:
            raise CheckpointError(
                f"adapter {path} does not fit this model: {str(exc).partition(';')[0]}; is it for another base "
                f"model? (its adapter_config.json names {base!r})"
            ) from None
    else:
        have = model.lora_config
        if _shape_key(have) != _shape_key(cfg) or not math.isclose(have.scaling, cfg.scaling, rel_tol=1e-6):
            raise CheckpointError(
                f"adapter {path} ({_spec(cfg)}; scale {cfg.scaling:g}) does not match this model's adapters "
                f"({_spec(have)}; scale {have.scaling:g}): an adapter keeps its rank, targets and scale (alpha / r) "
                f"once trained; resume with --lora {_spec(cfg)} (or the same [lora] table), or start a new run from "
                f"the adapter folder as --model with another --out"
            )
    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{path} has no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read; re-save them)")
    handle = open_safetensors(file)
    found = {our_name(k): k for k in handle.keys()}
    own = adapter_parameters(model)
    missing = sorted(set(own) - set(found))
    unexpected = sorted(set(found) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"adapter {path} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]} "
            f"({len(missing)} missing, {len(unexpected)} unexpected); is it for another base model?"
        )
    for name, p in own.items():
        t = handle.tensor(found[name])
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(
                f"adapter {path} does not fit this model: {name} has shape {list(t.shape)}, the model's adapter "
                f"{list(p.shape)}; is it for another base model? (its adapter_config.json names {base!r}; --base "
                "repoints it)"
            )
        p.copy_(t)
    return model
