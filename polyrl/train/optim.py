"""AdamW over fp32 master weights for bf16/fp16 compute weights (``MasterAdamW``).

Each trainable parameter whose dtype is lower than fp32 gets an fp32 master copy; torch's own AdamW
(fused on accelerators, foreach on the CPU) updates the masters with fp32 moments, and the result is
copied back into the compute parameter *in place*: a parameter tensor's identity never changes,
because the rollout engine holds the same tensors. fp32 parameters are their own masters (no copy).

Gradients flow into the masters during backward: a post-accumulate-grad hook adds each compute
gradient, cast to fp32, into ``master.grad`` and frees the low-precision one, so accumulation over
micro-batches happens in fp32 and the bf16 gradients never all exist at once. After backward read
gradients through ``grads()``, not ``param.grad`` (which is None for mastered parameters).

The update itself is an ``Updater`` picked from ``UPDATERS`` by ``optim.name`` (``optim.offload = "cpu"``
picks the host one): "adamw" is torch's AdamW as above; "adamw8bit" keeps both moments blockwise 8-bit on the
device (``optim_8bit.py``); "offload" keeps masters and moments in host memory (``optim_offload.py``). Gradients
for the offloaded optimizer stay in the compute parameters' ``.grad`` (accumulated by autograd in the compute
dtype) until its step copies them out.

This module does not clip, schedule or guard against NaN; the engine does, through ``grad_norm``,
``scale_grads_`` and ``step(lr)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from polyrl.errors import UserError
from polyrl.train.config import OptimConfig
from polyrl.train.optim_8bit import AdamW8bit
from polyrl.train.optim_offload import HostOffload
from polyrl.train.optim_torch import TorchAdamW
from polyrl.train.parallel.fsdp import scale_sharded_, sharded_grad_norm


class Updater(Protocol):
    """The update rule of a ``MasterAdamW``: applies the gradients of ``opt.masters`` and owns the moments."""

    def step(self, lr: float) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


# optim.name (or "offload" for optim.offload = "cpu") -> Updater class, built with the MasterAdamW it serves
UPDATERS: dict[str, Callable[[Any], Updater]] = {"adamw": TorchAdamW, "adamw8bit": AdamW8bit, "offload": HostOffload}


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
        self._host_init: list[torch.Tensor] = []  # offloaded: host copies taken before the cast (HostOffload's)
        offload = cfg.offload == "cpu"
        for name, p in named_params:
            if not p.requires_grad:
                continue
            self.names.append(name)
            self.params.append(p)
            if offload:
                host_dtype = torch.float32 if cfg.master_dtype == "fp32" else (compute_dtype or p.dtype)
                self._host_init.append(p.detach().to("cpu", host_dtype, copy=True))
            # offloaded: the masters live on the host (the updater's); the device holds only compute weights + grads
            self.masters.append(_cast_(p, compute_dtype) if offload else self._make_master(p, compute_dtype))
        if not self.params:
            raise ValueError("MasterAdamW got no trainable parameters")
        if (cfg.name != "adamw" or offload) and _sharded(self.params):
            raise UserError(
                f"optim.name = {cfg.name} with optim.offload = {cfg.offload} runs on whole tensors, not FSDP2 shards; "
                "use optim.name = adamw with optim.offload = none for sharded (multi-GPU full) training"
            )
        self.updater: Updater = UPDATERS["offload" if offload else cfg.name](self)

    @property
    def inner(self) -> torch.optim.AdamW:
        """torch's AdamW of the on-device "adamw" updater (AttributeError for the others)."""
        return self.updater.inner

    def take_host_copies(self) -> list[torch.Tensor]:
        """The offloaded updater's host weights, taken from the parameters' original values (handed over once)."""
        out, self._host_init = self._host_init, []
        return out

    def decays(self) -> list[float]:
        """Per parameter: its weight decay (``decay_params`` picks which parameters decay)."""
        wd = self.cfg.weight_decay
        return [wd if wd > 0 and (self.cfg.decay_params == "all" or m.ndim >= 2) else 0.0 for m in self.masters]

    # ---- construction -------------------------------------------------------------------------
    def _make_master(self, p: nn.Parameter, compute_dtype: torch.dtype | None) -> torch.Tensor:
        if self.cfg.name == "adamw8bit" and not p.is_contiguous():
            raise UserError(f"optim.name = adamw8bit needs contiguous parameters; {tuple(p.shape)} is a strided view")
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

    # ---- gradients ----------------------------------------------------------------------------
    @property
    def has_masters(self) -> bool:
        return any(m is not p for m, p in zip(self.masters, self.params))

    def grads(self) -> list[torch.Tensor]:
        """The gradients the next ``step`` applies (masters' ``.grad``: fp32 with masters; the compute weights' own
        when offloaded), skipping parameters that received none."""
        return [m.grad for m in self.masters if m.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients, an fp32 scalar tensor on the parameters' device (no sync)."""
        grads = self.grads()
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=_local(self.masters[0]).device)
        if _sharded(grads):
            return sharded_grad_norm(grads)  # FSDP2 DTensor grads: local squares + one all-reduce
        pending = getattr(self.updater, "grad_scale", None)
        if pending is not None:  # offloaded: compute-dtype grads, norms in fp32, the pending clip/unscale factor
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            return torch.linalg.vector_norm(torch.stack(norms)) * pending
        norms = torch._foreach_norm(grads)
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))

    def scale_grads_(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by ``factor`` in place (clipping, loss-scale removal)."""
        grads = self.grads()
        if getattr(self.updater, "grad_scale", None) is not None:
            self.updater.grad_scale = self.updater.grad_scale * factor  # applied on the host, in fp32
        elif grads and _sharded(grads):
            scale_sharded_(grads, factor)
        elif grads:
            torch._foreach_mul_(grads, factor)

    def zero_grad(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = None
            p.grad = None
        if getattr(self.updater, "grad_scale", None) is not None:
            self.updater.grad_scale = 1.0  # a skipped step's pending factor must not reach the next one

    # ---- update -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One update at learning rate ``lr``; the compute weights hold the result afterwards (in place)."""
        self.updater.step(lr)

    @torch.no_grad()
    def sync_params(self) -> None:
        """Copy the masters into the compute parameters in place (a no-op for self-mastered ones)."""
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p is not m]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict (safetensors-ready): ``master/<name>`` for separate masters, the moments by
        parameter name (``exp_avg/<name>``, ``exp_avg_sq/<name>``, ``step/<name>`` for "adamw"; the 8-bit
        updaters' keys are in ``optim_8bit.py``)."""
        return self.updater.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore masters and moments saved by ``state_dict`` (by parameter name), then copy the
        masters into the compute weights. Raises KeyError naming what is missing."""
        self.updater.load_state_dict(state)

    def missing_masters(self, state: dict[str, torch.Tensor]) -> None:
        missing = [
            n for n, p, m in zip(self.names, self.params, self.masters) if m is not p and f"master/{n}" not in state
        ]
        if missing:
            raise KeyError(f"optimizer state lacks master weights for: {', '.join(missing[:5])}")

    def load_masters(self, state: dict[str, torch.Tensor]) -> None:
        self.missing_masters(state)
        with torch.no_grad():
            for name, p, m in zip(self.names, self.params, self.masters):
                if m is not p:
                    m.copy_(state[f"master/{name}"])


def _cast_(p: nn.Parameter, compute_dtype: torch.dtype | None) -> nn.Parameter:
    """Cast ``p`` to the compute dtype in place (its ``Parameter`` object kept); returns it."""
    if compute_dtype is not None and p.dtype != compute_dtype:
        with torch.no_grad():
            p.data = p.data.to(compute_dtype)
    return p


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
