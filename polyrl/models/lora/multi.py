"""Several LoRA adapters on one frozen base, chosen per token: what ``polyrl serve --lora name=path`` runs.

``attach_adapters(model, {name: folder})`` loads each PEFT adapter folder and replaces every targeted
``nn.Linear`` (the union of the adapters' targets) by a ``MultiLoraLinear`` that keeps the base ``weight`` /
``bias`` Parameters and holds, per adapter ``a``, ``A_a [r_a, in]``, ``B_a [out, r_a]`` and its scale (an adapter
that does not target a layer has none there). The returned ``AdapterBank`` is also ``model.lora_bank``; before a
forward the caller sets ``bank.index`` (int64 ``[T]``, the adapter slot of each token, -1 = the base alone), and
each layer adds ``s_a * B_a(A_a(x))`` on the tokens of slot ``a``: every adapter runs on all tokens and a mask
keeps its own (no host sync; the cost is one rank-r pair per adapter and layer, small next to the base matmul).

Adapters on routed experts (``target_parameters``) are refused here: per-token selection would need one pass of the
experts per adapter; merge such an adapter into its base (``polyrl export --adapter DIR --merge``) and serve the
merged model.

Not here: training several adapters (``apply.py`` has the one trainable adapter), unloading adapters, routing
requests to slots (``polyrl.infer.llm``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from polyrl.errors import ConfigError
from polyrl.models.hf_io import open_safetensors
from polyrl.models.lora.apply import adapted_parents
from polyrl.models.lora.peft_io import ADAPTER_WEIGHTS, PREFIX, our_name, read_adapter_config


class AdapterBank:
    """Adapter names in slot order and the per-token slot index the layers read."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = list(names)
        self.index = torch.full((0,), -1, dtype=torch.long, device=device)

    def slot(self, name: str | None) -> int:
        if name is None:
            return -1
        try:
            return self.names.index(name)
        except ValueError:
            raise ConfigError(f"unknown LoRA adapter {name!r}; loaded: {', '.join(self.names)}") from None


class MultiLoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, bank: AdapterBank, n: int) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.bank = bank
        self.lora_A = nn.ParameterList([nn.Parameter(torch.empty(0), requires_grad=False) for _ in range(n)])
        self.lora_B = nn.ParameterList([nn.Parameter(torch.empty(0), requires_grad=False) for _ in range(n)])
        self.scaling = [0.0] * n

    def set_adapter(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        out_f, in_f = self.weight.shape
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
            raise ConfigError(
                f"adapter tensors A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a [{out_f}, {in_f}] layer; "
                "is the adapter for another base model?"
            )
        dt, dev = self.weight.dtype, self.weight.device
        self.lora_A[slot] = nn.Parameter(a.to(device=dev, dtype=dt), requires_grad=False)
        self.lora_B[slot] = nn.Parameter(b.to(device=dev, dtype=dt), requires_grad=False)
        self.scaling[slot] = float(scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        idx = self.bank.index
        if idx.numel() != x.shape[0]:
            return y  # no selection for this forward (e.g. a warm-up pass): the base alone
        for slot, (a, b) in enumerate(zip(self.lora_A, self.lora_B)):
            if a.numel() == 0:
                continue
            keep = (idx == slot).to(y.dtype)[:, None]  # [T, 1]
            y = y + F.linear(F.linear(x, a), b) * (self.scaling[slot] * keep)
        return y


@torch.no_grad()
def attach_adapters(model: nn.Module, adapters: dict[str, str | Path]) -> AdapterBank:
    """Load the PEFT adapter folders ``adapters`` (name -> folder) onto ``model`` for per-token selection."""
    if not adapters:
        raise ConfigError("attach_adapters needs at least one name=folder")
    if getattr(model, "lora_config", None) is not None or getattr(model, "lora_bank", None) is not None:
        raise ConfigError("this model already has LoRA adapters; attach serving adapters to a plain base model")
    names = list(adapters)
    configs = {name: read_adapter_config(path)[0] for name, path in adapters.items()}
    experts = [name for name, cfg in configs.items() if cfg.target_parameters]
    if experts:
        raise ConfigError(
            f"LoRA adapter(s) {', '.join(experts)} adapt routed experts (target_parameters), which multi-adapter "
            "serving does not support; merge it into its base (polyrl export --adapter DIR --merge --out OUT) and "
            "serve the merged folder"
        )
    targets = {t for cfg in configs.values() for t in cfg.targets}
    bank = AdapterBank(names, next(model.parameters()).device)
    layers: dict[str, MultiLoraLinear] = {}
    for li, layer in enumerate(model.model.layers):
        for pname, parent in adapted_parents(layer):
            for target in sorted(targets):
                base = getattr(parent, target, None)
                if isinstance(base, nn.Linear):
                    multi = MultiLoraLinear(base, bank, len(names))
                    setattr(parent, target, multi)
                    layers[f"model.layers.{li}.{pname}.{target}"] = multi
    for slot, name in enumerate(names):
        cfg, file = configs[name], Path(adapters[name]) / ADAPTER_WEIGHTS
        handle = open_safetensors(file)
        found = {our_name(k): k for k in handle.keys() if k.startswith(PREFIX)}
        for module, multi in layers.items():
            key_a, key_b = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
            if module.rpartition(".")[2] not in cfg.targets:
                continue
            if key_a not in found or key_b not in found:
                raise ConfigError(f"adapter {name!r} ({file}) lacks {key_a} / {key_b}; is it for another base model?")
            multi.set_adapter(slot, handle.tensor(found[key_a]), handle.tensor(found[key_b]), cfg.scaling)
    model.lora_bank = bank
    return bank
