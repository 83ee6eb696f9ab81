"""``LoraConfig``: which linear layers (and which routed-expert tensors of an MoE model) get a low-rank adapter and
how it is scaled, plus the parser of the ``--lora r=16,alpha=32,dropout=0,targets=q,k,v,o,gate,up,down`` string.

Targets use short names (``q k v o gate up down``) or the HF module names (``q_proj`` ...); both resolve to the
HF names, which are what PEFT's ``target_modules`` holds. Routed experts are 3-D tensors, not modules: PEFT adapts
them through ``target_parameters`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), and so does
``LoraConfig.target_parameters`` (short names ``gate_up`` / ``down``, or ``experts`` for both). For the command line,
``experts`` (or ``experts.gate_up`` / ``experts.down``) may also be listed among ``targets``:
``--lora r=16,targets=q,k,v,o,experts``. The scale of the adapter's output is ``alpha / r`` (``alpha / sqrt(r)``
with ``rslora``), as in PEFT.

Not here: building or applying adapters (``apply.py``), reading or writing adapter folders (``peft_io.py``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from polyrl.errors import ConfigError, did_you_mean

# short name -> HF module name (the last part of the module path in DecoderLM and in HF Llama/Qwen).
SHORT_TARGETS: dict[str, str] = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
ALL_TARGETS = tuple(SHORT_TARGETS.values())
ALL_LINEAR = "all-linear"  # PEFT's target_modules for every linear layer but the output layer: ALL_TARGETS here
# routed-expert tensors (PEFT's target_parameters), in the order of the ``Experts`` module
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# accepted spellings -> the full names above; "experts" means both
SHORT_PARAMETERS: dict[str, tuple[str, ...]] = {"experts": EXPERT_PARAMETERS}
for _full in EXPERT_PARAMETERS:
    _leaf = _full.rpartition(".")[2]
    for _alias in (_full, _full.removeprefix("mlp."), _leaf, _leaf.removesuffix("_proj")):
        SHORT_PARAMETERS[_alias] = (_full,)
    SHORT_PARAMETERS["experts." + _leaf.removesuffix("_proj")] = (_full,)
# names that, listed among ``targets``, mean routed-expert tensors (``down`` / ``down_proj`` there keep meaning the
# dense MLP's linear layer, so only the spellings that say "experts" or "gate_up" move over)
_EXPERT_IN_TARGETS = {k for k in SHORT_PARAMETERS if "experts" in k or "gate_up" in k}
QUANTIZE_CHOICES = (None, "nf4")


@dataclass
class LoraConfig:
    """The ``[lora]`` table. ``r``: adapter rank; ``alpha``: scale numerator (scale = alpha / r, or alpha /
    sqrt(r) with ``rslora``); ``dropout``: on the adapter's input only; ``targets``: short or HF names (a list or
    a comma-separated string), default all seven projections; ``quantize_base``: ``"nf4"`` for QLoRA (frozen
    base and MoE routed experts in 4-bit NF4); ``merge_for_rollout``: RL rollouts run on weights with
    the adapter merged in place (and unmerged before the update) instead of base + adapter; ``target_parameters``:
    routed-expert tensors of MoE layers (PEFT's field: ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``; short
    ``gate_up``, ``down``, ``experts`` = both), default none."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(ALL_TARGETS))
    rslora: bool = False
    quantize_base: str | None = None
    merge_for_rollout: bool = False
    base: str | None = None
    target_parameters: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"lora.r must be a positive integer (the adapter rank), got {self.r!r}; e.g. r=16")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be a positive number, got {self.alpha!r}; e.g. alpha=32 (2 x r)")
        self.alpha = float(self.alpha)
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {d!r}; e.g. dropout=0.05")
        self.dropout = float(d)
        self.targets, moved = split_targets(self.targets)
        self.target_parameters = normalize_target_parameters([*moved, *_as_list(self.target_parameters)])
        if not self.targets and not self.target_parameters:
            raise ConfigError(
                "lora.targets must name at least one layer, e.g. targets=q,k,v,o,gate,up,down "
                "(or experts on MoE models)"
            )
        if self.target_parameters and self.dropout > 0:
            raise ConfigError(
                f"lora.dropout={self.dropout} cannot apply to routed-expert adapters (target_parameters): the adapter "
                "is folded into the expert weights, where input dropout has no place (PEFT refuses it too); set "
                "dropout=0"
            )
        if self.quantize_base not in QUANTIZE_CHOICES:
            raise ConfigError(f"lora.quantize_base must be unset or 'nf4' (QLoRA), got {self.quantize_base!r}")
        for name in ("rslora", "merge_for_rollout"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"lora.{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.base, os.PathLike):
            self.base = os.fspath(self.base)
        if self.base is not None and (not isinstance(self.base, str) or not self.base):
            raise ConfigError(f"lora.base must be a model folder (a path), got {self.base!r}; e.g. --base runs/tiny")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def _as_list(value: Any) -> Any:
    if isinstance(value, str):
        return [t for t in value.replace(" ", "").split(",") if t]
    if value is None:
        return []
    return value


def split_targets(targets: Any) -> tuple[list[str], list[str]]:
    """``targets`` -> (HF module names, the routed-expert spellings found among them, e.g. ``experts``)."""
    targets = _as_list(targets)
    if not isinstance(targets, (list, tuple)) or not targets:
        raise ConfigError(
            f"lora.targets must be a non-empty list of layer names, got {targets!r}; e.g. targets=q,k,v,o,gate,up,down"
        )
    moved = [t for t in targets if isinstance(t, str) and t in _EXPERT_IN_TARGETS]
    rest = [t for t in targets if not (isinstance(t, str) and t in _EXPERT_IN_TARGETS)]
    return (normalize_targets(rest) if rest else []), moved


def normalize_target_parameters(names: Any) -> list[str]:
    """Routed-expert tensor names (``experts``, ``gate_up``, ``mlp.experts.down_proj`` ...) -> the full names in
    ``EXPERT_PARAMETERS`` order, duplicates dropped."""
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"lora.target_parameters must be a list of names, got {names!r}; e.g. experts")
    resolved: set[str] = set()
    for n in names:
        full = SHORT_PARAMETERS.get(n) if isinstance(n, str) else None
        if full is None:
            raise ConfigError(
                f"unknown lora target parameter {n!r}; polyrl adapts the routed experts' "
                f"{' and '.join(EXPERT_PARAMETERS)} (short: gate_up, down, or experts for both)"
            )
        resolved.update(full)
    return [p for p in EXPERT_PARAMETERS if p in resolved]


def normalize_targets(targets: Any) -> list[str]:
    """Short or HF names (list or comma string) -> HF names in the canonical order, duplicates dropped."""
    if isinstance(targets, str):
        targets = [t for t in targets.replace(" ", "").split(",") if t]
    if not isinstance(targets, (list, tuple)) or not targets:
        raise ConfigError(
            f"lora.targets must be a non-empty list of layer names, got {targets!r}; e.g. targets=q,k,v,o,gate,up,down"
        )
    resolved = set()
    for t in targets:
        if t == ALL_LINEAR:  # PEFT's spelling: every projection of the decoder layers (not the LM head)
            resolved.update(ALL_TARGETS)
            continue
        name = SHORT_TARGETS.get(t, t) if isinstance(t, str) else t
        if t == "":
            raise ConfigError(
                "lora.targets has an empty name (targets= with nothing after it?); list layer "
                "names, e.g. targets=q,k,v,o,gate,up,down"
            )
        if name not in ALL_TARGETS:
            known = [*SHORT_TARGETS, *ALL_TARGETS, *sorted(_EXPERT_IN_TARGETS)]
            hint = did_you_mean(t, known) if isinstance(t, str) else ""
            raise ConfigError(
                f"unknown lora target {t!r}{hint}; use any of {', '.join(SHORT_TARGETS)} "
                f"(or {', '.join(ALL_TARGETS)}, or {ALL_LINEAR} for all of them), and experts for the routed experts "
                f"of an MoE model"
            )
        resolved.add(name)
    return [t for t in ALL_TARGETS if t in resolved]


_SPEC_KEYS = {
    "r",
    "alpha",
    "dropout",
    "targets",
    "rslora",
    "quantize_base",
    "merge_for_rollout",
    "base",
    "target_parameters",
}
_LIST_KEYS = ("targets", "target_parameters")


def parse_lora_spec(text: str) -> dict[str, Any]:
    """``"r=16,alpha=32,dropout=0,targets=q,k,v"`` -> ``{"r": 16, "alpha": 32, "dropout": 0, "targets": [...]}``.

    Items are ``key=value`` separated by commas; a bare item continues the list (``targets`` or
    ``target_parameters``) before it. An empty string means all defaults. Values are TOML literals (numbers,
    true/false), else strings."""
    out: dict[str, Any] = {}
    last = None
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq:
            if last not in _LIST_KEYS:
                raise ConfigError(
                    f"--lora item {item!r} has no '='; write key=value pairs, e.g. --lora r=16,alpha=32,targets=q,v"
                )
            out[last].append(item)
            continue
        key = key.strip()
        if key not in _SPEC_KEYS:
            hint = did_you_mean(key, _SPEC_KEYS)
            raise ConfigError(f"unknown --lora key {key!r}{hint}; known: {', '.join(sorted(_SPEC_KEYS))}")
        last = key
        out[key] = [value.strip()] if key in _LIST_KEYS else _literal(value.strip())
    return out


def _literal(text: str) -> Any:
    """``16`` -> 16, ``0.05`` -> 0.05, ``true`` -> True, ``none`` -> None, anything else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", ""):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def make_lora_config(value: Any) -> LoraConfig:
    """A ``LoraConfig`` from a table (dict), a ``--lora`` string or an existing config."""
    if isinstance(value, LoraConfig):
        return value
    if isinstance(value, str):
        value = parse_lora_spec(value)
    if not isinstance(value, dict):
        raise ConfigError(f"[lora] must be a table of settings, got {value!r}")
    unknown = sorted(set(value) - _SPEC_KEYS)
    if unknown:
        hint = did_you_mean(unknown, _SPEC_KEYS)
        raise ConfigError(f"unknown lora setting(s) {unknown}{hint}; known: {', '.join(sorted(_SPEC_KEYS))}")
    return LoraConfig(**value)
