"""MoE expert tensors between the hub's per-expert checkpoint layout and the model's fused parameters.

The model holds transformers 5's in-memory layout (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows then up rows;
``mlp.experts.down_proj [E, H, I]``; ``mlp.gate.weight``). Checkpoints on the hub hold one matrix per expert:
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (Qwen2/3-MoE, OLMoE) or Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` with its router at ``block_sparse_moe.gate.weight``.

``read_plan`` maps a checkpoint's tensor names onto the model's: a fused name present in the file is read as is, a
per-expert group becomes one ``Stack`` recipe (its shape known before any data is read, so ``checkpoint.py`` reports
every mismatch up front); ``fill`` copies one expert at a time into the destination tensor (no second full copy).
``hub_state`` splits a state dict into the per-expert layout for saving (views, no copies): what transformers 4.x and
5.x (``save_pretrained`` of 5.24 writes the same) and vLLM all read.

Not here: opening files or the other tensors (``checkpoint.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.models.config import ModelConfig

_GATE_UP, _DOWN, _ROUTER = "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"
_PER_EXPERT = re.compile(
    r"^(?P<layer>.*layers\.\d+)\.(?P<prefix>mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<m>\w+)\.weight$"
)


@dataclass(frozen=True)
class Stack:
    """A fused expert tensor assembled from per-expert keys: ``keys[e]`` are expert e's parts, concatenated along
    dim 0 (gate then up for ``gate_up_proj``; one part for ``down_proj``), then stacked along a new dim 0."""

    keys: tuple[tuple[str, ...], ...]
    shape: tuple[int, ...]


def _names(cfg: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    moe = cfg.family.moe
    return moe.checkpoint_prefix, moe.expert_names


def read_plan(found: dict[str, tuple[int, ...]], cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict]:
    """``found`` (checkpoint name -> shape) -> (model name -> shape, model name -> source), where a source is a
    checkpoint key or a ``Stack``. Per-expert keys the model cannot use (an expert index >= num_experts, an unknown
    matrix) stay under their own names, so the caller reports them as unexpected; an incomplete group is
    reported as missing under the model's name with the absent keys named by ``missing_parts``."""
    if cfg.family.moe is None:
        return dict(found), {k: k for k in found}
    prefix, (g, u, d) = _names(cfg)
    groups: dict[str, dict[tuple[int, str], str]] = {}
    virtual: dict[str, tuple[int, ...]] = {}
    sources: dict[str, object] = {}
    for key, shape in found.items():
        m = _PER_EXPERT.match(key)
        if m and m["prefix"] == prefix and m["m"] in (g, u, d) and int(m["e"]) < cfg.num_experts:
            groups.setdefault(m["layer"], {})[(int(m["e"]), m["m"])] = key
            continue
        name = key
        if prefix != "mlp" and key.endswith(f".{prefix}.gate.weight"):  # Mixtral's router
            name = key[: -len(f"{prefix}.gate.weight")] + _ROUTER
        virtual[name], sources[name] = tuple(shape), key
    for layer, parts in groups.items():
        for fused, mats in ((_GATE_UP, (g, u)), (_DOWN, (d,))):
            keys = [tuple(parts.get((e, mat)) for mat in mats) for e in range(cfg.num_experts)]
            if any(k is None for row in keys for k in row):
                continue  # incomplete: the fused name stays absent, reported as missing (missing_parts says what)
            first = [found[k] for k in keys[0]]
            shape = (cfg.num_experts, sum(s[0] for s in first), *first[0][1:])
            bad = [k for row in keys for k, s in zip(row, first) if tuple(found[k]) != tuple(s)]
            name = f"{layer}.{fused}"
            virtual[name] = (-1,) if bad else shape  # uneven expert shapes: a wrong-shape report
            sources[name] = Stack(tuple(keys), shape)
    return virtual, sources


def missing_parts(name: str, found: dict[str, tuple[int, ...]], cfg: ModelConfig) -> list[str]:
    """The per-expert checkpoint keys a missing fused ``name`` would be built from and that the file lacks."""
    if cfg.family.moe is None or not name.endswith((_GATE_UP, _DOWN)):
        return []
    prefix, (g, u, d) = _names(cfg)
    layer = name[: -len(_GATE_UP) - 1] if name.endswith(_GATE_UP) else name[: -len(_DOWN) - 1]
    mats = (g, u) if name.endswith(_GATE_UP) else (d,)
    want = [f"{layer}.{prefix}.experts.{e}.{m}.weight" for e in range(cfg.num_experts) for m in mats]
    present = [k for k in want if k in found]
    return [k for k in want if k not in found] if present else []


def fill(dest: torch.Tensor, stack: Stack, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Copy the per-expert parts into ``dest`` (``stack.shape``), one expert matrix at a time."""
    for e, keys in enumerate(stack.keys):
        row = 0
        for key in keys:
            part = read(key)
            dest[e, row : row + part.shape[0]].copy_(part)
            row += part.shape[0]
            del part
    return dest


def hub_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A state dict in the hub's per-expert layout. Each expert matrix is a view into the fused tensor (a contiguous,
    non-overlapping slice, which safetensors writes as is): splitting costs no memory."""
    if cfg.family.moe is None:
        return state
    prefix, (g, u, d) = _names(cfg)
    inter = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(_GATE_UP):
            layer = name[: -len(_GATE_UP) - 1]
            for e in range(t.shape[0]):
                out[f"{layer}.{prefix}.experts.{e}.{g}.weight"] = t[e, :inter]
                out[f"{layer}.{prefix}.experts.{e}.{u}.weight"] = t[e, inter:]
        elif name.endswith(_DOWN):
            layer = name[: -len(_DOWN) - 1]
            for e in range(t.shape[0]):
                out[f"{layer}.{prefix}.experts.{e}.{d}.weight"] = t[e]
        elif name.endswith(_ROUTER) and prefix != "mlp":
            out[name[: -len(_ROUTER)] + f"{prefix}.gate.weight"] = t
        else:
            out[name] = t
    return out
