"""The "adamw" updater of ``MasterAdamW``: torch's AdamW (fused on accelerators, foreach on the CPU) over the masters.

Its state is torch's (``inner``); ``state_dict`` flattens it by parameter name (``master/<name>``, ``exp_avg/<name>``,
``exp_avg_sq/<name>``, ``step/<name>``). ``make_torch_adamw`` is also what the offloaded updater runs on the host.
This module does not own parameters or gradients (``optim.MasterAdamW`` does).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from polyrl.train.config import OptimConfig


class TorchAdamW:
    """The "adamw" updater of ``opt`` (a ``MasterAdamW``)."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.inner = self._make_inner()

    def _groups(self) -> list[dict[str, Any]]:
        decay = [m for m, wd in zip(self.opt.masters, self.opt.decays()) if wd > 0]
        no_decay = [m for m, wd in zip(self.opt.masters, self.opt.decays()) if wd == 0]
        groups = []
        if decay:
            groups.append({"params": decay, "weight_decay": self.opt.cfg.weight_decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups

    def _make_inner(self) -> torch.optim.AdamW:
        return make_torch_adamw(self._groups(), self.opt.cfg, self.opt.masters[0].device.type)

    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        self.opt.sync_params()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        opt = self.opt
        for name, p, m in zip(opt.names, opt.params, opt.masters):
            if m is not p:
                out[f"master/{name}"] = m.detach()
            st = self.inner.state.get(m)
            if st:
                for key in ("exp_avg", "exp_avg_sq"):
                    out[f"{key}/{name}"] = st[key].detach()
                out[f"step/{name}"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().reshape(())
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        opt = self.opt
        if any(f"exp_avg_q/{n}" in state for n in opt.names):
            raise KeyError("the checkpoint holds 8-bit moments (optim.name = adamw8bit), this run uses adamw")
        opt.load_masters(state)
        index = {id(m): i for i, m in enumerate(m for g in self.inner.param_groups for m in g["params"])}
        packed: dict[int, dict[str, torch.Tensor]] = {}
        for name, m in zip(opt.names, opt.masters):
            if f"exp_avg/{name}" in state:
                packed[index[id(m)]] = {
                    "step": state[f"step/{name}"].clone(),
                    "exp_avg": state[f"exp_avg/{name}"],
                    "exp_avg_sq": state[f"exp_avg_sq/{name}"],
                }
        groups = self.inner.state_dict()["param_groups"]
        self.inner.load_state_dict({"state": packed, "param_groups": groups})
        opt.sync_params()


def make_torch_adamw(
    groups: list[dict[str, Any]], cfg: OptimConfig, device_type: str, cpu_auto: str = "foreach"
) -> torch.optim.AdamW:
    """torch AdamW over ``groups`` with ``cfg.impl`` (auto: fused on accelerators, ``cpu_auto`` on the CPU; the
    offloaded host update asks for fused, one pass over its memory)."""
    kind = cfg.impl
    if kind == "auto":
        kind = cpu_auto if device_type == "cpu" else "fused"
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    try:
        return torch.optim.AdamW(groups, **kwargs, **flags[kind])
    except (RuntimeError, ValueError, TypeError) as exc:
        if cfg.impl != "auto":
            raise
        warnings.warn(f"fused AdamW unavailable here ({exc}); using foreach AdamW", RuntimeWarning, stacklevel=4)
        return torch.optim.AdamW(groups, **kwargs, foreach=True)
