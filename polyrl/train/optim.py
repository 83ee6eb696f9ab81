"""AdamW over fp32 master weights for bf16/fp16 compute weights (``MasterAdamW``).

Each trainable parameter whose dtype is lower than fp32 gets an fp32 master copy; torch's own AdamW
(fused on accelerators, foreach on the CPU) updates the masters with fp32 moments, and the result is
copied back into the compute parameter *in place*: a parameter tensor's identity never changes,
because the rollout engine holds the same tensors. fp32 parameters are their own masters (no copy).

Gradients flow into the masters during backward: a post-accumulate-grad hook adds each compute
gradient, cast to fp32, into ``master.grad`` and frees the low-precision one, so accumulation over
micro-batches happens in fp32 and the bf16 gradients never all exist at once. After backward read
gradients through ``grads()``, not ``param.grad`` (which is None for mastered parameters).

This module does not clip, schedule or guard against NaN; the engine does, through ``grad_norm``,
``scale_grads_`` and ``step(lr)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from polyrl.train.config import OptimConfig
from polyrl.train.parallel.fsdp import scale_sharded_, sharded_grad_norm


class MasterAdamW:
    """AdamW with fp32 masters. ``named_params``: (name, parameter) pairs (frozen ones are skipped).
    With ``compute_dtype`` set, parameters of another dtype are cast to it in place (``param.data``
    is replaced, the ``Parameter`` object is kept) after their masters were taken from the original
    values, so a model loaded in fp32 loses no precision in its masters."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        cfg: OptimConfig,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.cfg = cfg
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        self._hooks = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            self.names.append(name)
            self.params.append(p)
            self.masters.append(self._make_master(p, compute_dtype))
        if not self.params:
            raise ValueError("MasterAdamW got no trainable parameters")
        self.inner = self._make_inner()

    # ---- construction -------------------------------------------------------------------------
    def _make_master(self, p: nn.Parameter, compute_dtype: torch.dtype | None) -> torch.Tensor:
        target = compute_dtype or p.dtype
        if self.cfg.master_dtype == "none" or target == torch.float32:
            if p.dtype != target:
                with torch.no_grad():
                    p.data = p.data.to(target)
            return p
        master = p.detach().to(torch.float32, copy=True)
        if p.dtype != target:
            with torch.no_grad():
                p.data = p.data.to(target)
        self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_into(master)))
        return master

    def _groups(self) -> list[dict[str, Any]]:
        decay, no_decay = [], []
        for m in self.masters:
            wants = self.cfg.decay_params == "all" or m.ndim >= 2
            (decay if wants and self.cfg.weight_decay > 0 else no_decay).append(m)
        groups = []
        if decay:
            groups.append({"params": decay, "weight_decay": self.cfg.weight_decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups

    def _make_inner(self) -> torch.optim.AdamW:
        kind = self.cfg.impl
        if kind == "auto":
            kind = "foreach" if self.masters[0].device.type == "cpu" else "fused"
        kwargs = {"lr": self.cfg.lr, "betas": tuple(self.cfg.betas), "eps": self.cfg.eps}
        flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
        try:
            return torch.optim.AdamW(self._groups(), **kwargs, **flags[kind])
        except (RuntimeError, ValueError, TypeError) as exc:
            if self.cfg.impl != "auto":
                raise
            warnings.warn(f"fused AdamW unavailable here ({exc}); using foreach AdamW", RuntimeWarning, stacklevel=3)
            return torch.optim.AdamW(self._groups(), **kwargs, foreach=True)

    # ---- gradients ----------------------------------------------------------------------------
    @property
    def has_masters(self) -> bool:
        return any(m is not p for m, p in zip(self.masters, self.params))

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the next ``step`` applies (masters' ``.grad``), skipping parameters
        that received none."""
        return [m.grad for m in self.masters if m.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients, an fp32 scalar tensor on the parameters' device (no sync)."""
        grads = self.grads()
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=_local(self.masters[0]).device)
        if _sharded(grads):
            return sharded_grad_norm(grads)  # FSDP2 DTensor grads: local squares + one all-reduce
        norms = torch._foreach_norm(grads)
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))

    def scale_grads_(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by ``factor`` in place (clipping, loss-scale removal)."""
        grads = self.grads()
        if grads and _sharded(grads):
            scale_sharded_(grads, factor)
        elif grads:
            torch._foreach_mul_(grads, factor)

    def zero_grad(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = None
            p.grad = None

    # ---- update -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One AdamW update of the masters at learning rate ``lr``, then masters -> compute weights."""
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        self.sync_params()

    @torch.no_grad()
    def sync_params(self) -> None:
        """Copy the masters into the compute parameters in place (a no-op for self-mastered ones)."""
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p is not m]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict (safetensors-ready): ``master/<name>`` for separate masters,
        ``exp_avg/<name>``, ``exp_avg_sq/<name>``, ``step/<name>`` for parameters with AdamW state."""
        out: dict[str, torch.Tensor] = {}
        for name, p, m in zip(self.names, self.params, self.masters):
            if m is not p:
                out[f"master/{name}"] = m.detach()
            st = self.inner.state.get(m)
            if st:
                for key in ("exp_avg", "exp_avg_sq"):
                    out[f"{key}/{name}"] = st[key].detach()
                out[f"step/{name}"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().reshape(())
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore masters and moments saved by ``state_dict`` (by parameter name), then copy the
        masters into the compute weights. Raises KeyError naming what is missing."""
        missing = [
            n for n, p, m in zip(self.names, self.params, self.masters) if m is not p and f"master/{n}" not in state
        ]
        if missing:
            raise KeyError(f"optimizer state lacks master weights for: {', '.join(missing[:5])}")
        with torch.no_grad():
            for name, p, m in zip(self.names, self.params, self.masters):
                if m is not p:
                    m.copy_(state[f"master/{name}"])
        index = {id(m): i for i, m in enumerate(m for g in self.inner.param_groups for m in g["params"])}
        packed: dict[int, dict[str, torch.Tensor]] = {}
        for name, m in zip(self.names, self.masters):
            if f"exp_avg/{name}" in state:
                packed[index[id(m)]] = {
                    "step": state[f"step/{name}"].clone(),
                    "exp_avg": state[f"exp_avg/{name}"],
                    "exp_avg_sq": state[f"exp_avg_sq/{name}"],
                }
        groups = self.inner.state_dict()["param_groups"]
        self.inner.load_state_dict({"state": packed, "param_groups": groups})
        self.sync_params()


def _sharded(tensors: list[torch.Tensor]) -> bool:
    """True for FSDP2 (DTensor) gradients; checked by type name so torch.distributed.tensor is never imported here."""
    return type(tensors[0]).__name__ == "DTensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _accumulate_into(master: torch.Tensor):
    """Hook body: add the parameter's fresh gradient (fp32) into ``master.grad`` and free it."""

    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.to(torch.float32, copy=True)
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return hook
