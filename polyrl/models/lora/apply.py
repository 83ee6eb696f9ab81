"""Putting LoRA adapters into a ``DecoderLM`` in place, and the model-wide switches over them.

``apply_lora(model, cfg, seed)`` replaces every targeted ``nn.Linear`` of the decoder layers by a ``LoraLinear``
that keeps the same base ``Parameter`` (so HF names, identity and any holder of the tensor stay valid), and with
``cfg.target_parameters`` every MoE layer's routed ``Experts`` by a ``LoraExperts`` (per-expert adapters on
``gate_up_proj`` / ``down_proj``, same base Parameters), freezes everything else, and records
``model.lora_config``. QLoRA (``quantize_base="nf4"``) also puts every MoE layer's routed experts on an NF4 base:
adapted ones in their ``LoraExperts``, the others as an ``NF4Experts`` (``nf4_experts.py``). Adapter parameters
are created in fp32; the training engine casts them to the compute dtype with fp32 masters like any trainable
parameter, while the frozen base keeps the dtype it was loaded in (bf16 on accelerators) and gets no optimizer
state.

Switches: ``merge_lora`` / ``unmerge_lora`` (in place), ``merged(model)`` and ``adapters_disabled(model)``
(context managers), ``AdapterDisabled(model)`` (the base model as a module, for a KL or DPO reference without a
second copy of the weights), ``merged_state_dict`` (the plain HF state dict of base + adapter).
Not here: file formats (``peft_io.py``), the layer arithmetic (``layer.py``, ``experts.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from polyrl.errors import ConfigError
from polyrl.models.lora.config import LoraConfig
from polyrl.models.lora.experts import LoraExperts
from polyrl.models.lora.layer import LoraLinear
from polyrl.models.lora.nf4_experts import NF4Experts
from polyrl.models.moe import Experts


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoraLinear | LoraExperts]]:
    """(module name, layer) of every adapted module in ``model`` (``LoraLinear`` and ``LoraExperts``), in module
    order. Both have ``merge(exact)`` / ``unmerge()`` / ``merged`` / ``disabled`` / ``dropout`` / ``quant_shape``."""
    for name, module in model.named_modules():
        if isinstance(module, (LoraLinear, LoraExperts)):
            yield name, module


def adapted_parents(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in the layer, module) of the modules whose ``*_proj`` linears LoRA targets: attention, the MLP, and an
    MoE layer's shared expert (Qwen2-MoE; PEFT matches ``mlp.shared_expert.gate_proj`` by its name too). An MoE
    layer's router (``mlp.gate``) is never a target; its routed experts (3-D tensors) are ``target_parameters``."""
    parents = [("self_attn", layer.self_attn), ("mlp", layer.mlp)]
    shared = getattr(layer.mlp, "shared_expert", None)
    if shared is not None:
        parents.append(("mlp.shared_expert", shared))
    return parents


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "lora_config", None) is not None


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int | None = 0, warn_unmatched: bool = True) -> nn.Module:
    """Add adapters to the layers named in ``cfg.targets`` and the routed-expert tensors in
    ``cfg.target_parameters`` (see the module docstring); with ``cfg.quantize_base == "nf4"`` the frozen base weights
    of the targeted linear layers and every MoE layer's routed experts (adapted or not) are quantized (QLoRA).
    ``warn_unmatched``: the config is the user's, for fresh adapters (off when loading a saved adapter): warn when MLP
    targets match nothing on an MoE model, and refuse a rank that no targeted layer can use (``_check_rank``)."""
    if has_lora(model):
        raise ConfigError("this model already has LoRA adapters; apply LoRA once")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"LoRA needs a DecoderLM-like model with model.layers, got {type(model).__name__}")
    if warn_unmatched:
        _check_rank(layers, cfg)
    gen = None
    first = next(model.parameters())
    if seed is not None:
        gen = torch.Generator(device=first.device)
        gen.manual_seed(seed)
    model.requires_grad_(False)
    count = 0
    matched: set[str] = set()
    for layer in layers:
        for _, parent in adapted_parents(layer):
            for target in cfg.targets:
                base = getattr(parent, target, None)
                if not isinstance(base, nn.Linear):
                    continue
                matched.add(target)
                lora = LoraLinear(base, cfg.r, cfg.scaling, cfg.dropout)
                lora.reset_adapter(gen)
                if cfg.quantize_base == "nf4":
                    lora.quantize_nf4()
                setattr(parent, target, lora)
                count += 1
    experts = [t.rpartition(".")[2] for t in cfg.target_parameters]
    n_experts = 0
    if experts:
        for layer in layers:
            base = getattr(getattr(layer, "mlp", None), "experts", None)
            if isinstance(base, Experts):
                lora = LoraExperts(base, experts, cfg.r, cfg.scaling)
                lora.reset_adapter(gen)
                if cfg.quantize_base == "nf4":
                    lora.quantize_nf4()
                layer.mlp.experts = lora
                n_experts += 1
        if n_experts == 0:
            raise ConfigError(
                f"lora.target_parameters {cfg.target_parameters} name routed experts, but this model has no MoE layer; "
                "drop experts from the LoRA targets"
            )
    if count + n_experts == 0:
        raise ConfigError(f"lora.targets {cfg.targets} matched no linear layer of this model")
    if warn_unmatched:
        _warn_unmatched_mlp(layers, cfg, matched)
    if cfg.quantize_base == "nf4":  # QLoRA: the routed experts without adapters get an NF4 base too
        for layer in layers:
            base = getattr(getattr(layer, "mlp", None), "experts", None)
            if isinstance(base, Experts):
                layer.mlp.experts = NF4Experts(base)
    model.lora_config = cfg
    return model


def _check_rank(layers: nn.ModuleList, cfg: LoraConfig) -> None:
    """A ``ConfigError`` when ``cfg.r`` exceeds the rank of every targeted weight: ``B @ A`` on an ``[out, in]`` weight
    has rank at most ``min(out, in)``, so a larger r adds no capacity, only memory (an ``[tokens, r]`` activation per
    adapter: r=100000 on the tiny model was killed by the OOM killer with no message). Checked before any adapter is
    built; a rank above some layers' but not all (r=256 with 128-wide k_proj) is taken, as PEFT does."""
    sizes = {}
    for layer in layers:
        for _, parent in adapted_parents(layer):
            for target in cfg.targets:
                base = getattr(parent, target, None)
                if isinstance(base, nn.Linear):
                    sizes[target] = (base.out_features, base.in_features)
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if isinstance(experts, Experts):
            for full in cfg.target_parameters:
                name = full.rpartition(".")[2]
                sizes[full] = tuple(getattr(experts, name).shape[1:])
    if not sizes:
        return  # nothing matched: apply_lora says so
    name, (out_f, in_f) = max(sizes.items(), key=lambda kv: min(kv[1]))
    if cfg.r > min(out_f, in_f):
        raise ConfigError(
            f"lora.r={cfg.r} is larger than any targeted layer can use: an adapter on an [out, in] weight has rank at "
            f"most min(out, in), here at most {min(out_f, in_f)} ({name} [{out_f}, {in_f}]), so a larger r only costs "
            f"memory; choose r <= {min(out_f, in_f)} (typical: 8 to 64)"
        )


def _warn_unmatched_mlp(layers: nn.ModuleList, cfg: LoraConfig, matched: set[str]) -> None:
    """On an MoE model, MLP targets (``gate_proj`` ...) that matched no module while no routed experts are targeted:
    the user meant to adapt the MLPs, which are experts there. A warning, not an error: it is also what the default
    targets and PEFT adapters written for all linear layers ask for, and PEFT itself takes it silently."""
    mlp = [t for t in cfg.targets if t in ("gate_proj", "up_proj", "down_proj") and t not in matched]
    moe = any(isinstance(getattr(getattr(layer, "mlp", None), "experts", None), Experts) for layer in layers)
    if mlp and moe and not cfg.target_parameters:
        warnings.warn(
            f"lora.targets {', '.join(mlp)} match no layer of this MoE model (its MLPs are routed experts): only "
            f"{', '.join(sorted(matched)) or 'nothing'} is adapted; add experts to the targets to adapt the routed "
            "experts (e.g. targets=q,k,v,o,experts), or drop the MLP names",
            RuntimeWarning,
            stacklevel=3,
        )


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """PEFT's saved names without the ``base_model.model.`` prefix -> adapter parameters:
    ``model.layers.0.self_attn.q_proj.lora_A.weight``; routed experts as PEFT nests its ``ParamWrapper``s,
    ``model.layers.0.mlp.experts.base_layer.lora_A.weight`` (``gate_up_proj``, when ``down_proj`` is targeted too)
    and ``model.layers.0.mlp.experts.lora_A.weight`` (the last targeted tensor)."""
    out = {}
    for name, layer in lora_layers(model):
        if isinstance(layer, LoraExperts):
            for tensor, prefix in layer.peft_names().items():
                out[f"{name}.{prefix}lora_A.weight"] = layer.lora_A[tensor]
                out[f"{name}.{prefix}lora_B.weight"] = layer.lora_B[tensor]
            continue
        out[f"{name}.lora_A.weight"] = layer.lora_A.weight
        out[f"{name}.lora_B.weight"] = layer.lora_B.weight
    return out


@torch.no_grad()
def merge_lora(model: nn.Module, exact: bool = False) -> None:
    """Merge every adapter into its base weight in place (``exact``: keep backups for a bit-exact unmerge)."""
    for _, layer in lora_layers(model):
        layer.merge(exact)


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> None:
    for _, layer in lora_layers(model):
        layer.unmerge()


@contextmanager
def merged(model: nn.Module, exact: bool = True):
    """Adapters merged into the base weights in place for the block, unmerged after (even on error); ``exact``
    restores the base bit for bit from backups (one copy of the targeted weights while merged)."""
    merge_lora(model, exact)
    try:
        yield model
    finally:
        unmerge_lora(model)


@contextmanager
def adapters_disabled(model: nn.Module):
    """The base model alone for the block (adapter branches skipped; merged adapters are not allowed)."""
    layers = [layer for _, layer in lora_layers(model)]
    if any(layer.merged for layer in layers):
        raise ConfigError("cannot disable merged adapters; unmerge them first")
    for layer in layers:
        layer.disabled = True
    try:
        yield model
    finally:
        for layer in layers:
            layer.disabled = False


class AdapterDisabled(nn.Module):
    """A view of a LoRA model with its adapters off: the frozen base, without copying it. ``forward`` and
    ``lm_head_weight`` are the wrapped model's; ``train``/``eval`` switch the wrapped model. It holds the model
    outside the module tree, so ``requires_grad_``/``to`` on this view never reach the adapters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._inner = (model,)

    @property
    def inner(self) -> nn.Module:
        return self._inner[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.inner.lm_head_weight

    @property
    def config(self):
        return self.inner.config

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.inner.compute_logits(hidden, upcast)

    def train(self, mode: bool = True) -> AdapterDisabled:
        self.training = mode
        self.inner.train(mode)
        return self

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.inner):
            return self.inner(*args, **kwargs)


@torch.no_grad()
def unwrap_lora(model: nn.Module, merge: bool = True) -> nn.Module:
    """Turn ``model`` back into a plain model in place: every ``LoraLinear`` becomes an ``nn.Linear`` holding its
    base weight (with the adapter merged in when ``merge``; NF4 bases are dequantized to bf16), every
    ``LoraExperts`` and ``NF4Experts`` an ``Experts``."""
    for name, module in list(model.named_modules()):
        if isinstance(module, NF4Experts):
            model.get_submodule(name.rpartition(".")[0]).experts = module.to_experts()
    for name, layer in list(lora_layers(model)):
        parent = model.get_submodule(name.rpartition(".")[0])
        if isinstance(layer, LoraExperts):
            setattr(parent, name.rpartition(".")[2], layer.to_experts(merge))
            continue
        if merge and layer.quant_shape is None:
            layer.merge()
        w = layer.base_weight(torch.bfloat16) if layer.quant_shape is not None else layer.weight.detach()
        if merge and layer.quant_shape is not None:
            w = (w.float() + layer.delta()).to(torch.bfloat16)
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight = nn.Parameter(w, requires_grad=False)
        if layer.bias is not None:
            plain.bias = layer.bias
        setattr(parent, name.rpartition(".")[2], plain)
    model.lora_config = None
    return model


@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The HF state dict of base + adapter (``W + s * B @ A`` in fp32, per expert for routed experts, cast to
    ``dtype`` or the base dtype): adapter tensors dropped, NF4 bases dequantized. The model is not changed."""
    state = {}
    lora = dict(lora_layers(model))
    lora.update((n, m) for n, m in model.named_modules() if isinstance(m, NF4Experts))
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        owner = lora.get(module)
        if isinstance(owner, (LoraExperts, NF4Experts)):
            if leaf.endswith("_absmax"):
                continue
            tensor = leaf.removesuffix("_nf4")
            if isinstance(owner, NF4Experts):
                state[f"{module}.{tensor}"] = owner.dequantized(tensor, torch.float32).to(dtype or torch.bfloat16)
            else:
                state[f"{module}.{tensor}"] = owner.merged_weight(
                    tensor, dtype or (t.dtype if tensor == leaf else None)
                )
            continue
        if owner is None:
            if ".lora_A." not in name and ".lora_B." not in name:
                state[name] = t if dtype is None else t.to(dtype)
            continue
        if leaf in ("weight_nf4", "weight_absmax", "weight"):
            if leaf == "weight_absmax":
                continue
            target = dtype or (t.dtype if leaf == "weight" else torch.bfloat16)
            w = owner.base_weight(torch.float32)
            if not owner.merged:
                w = w + owner.delta()
            state[f"{module}.weight"] = w.to(target)
        elif leaf == "bias":
            state[name] = t if dtype is None else t.to(dtype)
    return state
