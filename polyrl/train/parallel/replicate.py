"""Data parallelism by replication (DDP-style), the path of LoRA / QLoRA runs: every rank holds the WHOLE model
(the frozen base in the compute dtype or NF4, plus the adapters), takes its rank-strided share of the micro-batches,
and after backward the gradients of the trainable parameters are summed over ranks, so every rank applies the same
update to identical weights. FSDP2 is not applied: the frozen base gets no gradients and no optimizer state, so
sharding it would only save its memory (future work), while replication keeps the rollout colocated (the rollout
engine runs the very tensors the optimizer updates, no weight sync) and the adapters' all-reduce small.

``replicate_model(model, world)`` broadcasts the trainable parameters from rank 0 (so an init that differs by
device or RNG cannot split the replicas) and marks the model; ``TrainEngine(..., world=world)`` then calls
``all_reduce_grads_(masters, world)`` once per optimizer step on the fp32 master gradients (one flat all-reduce,
with a presence count so a parameter that got no gradient on any rank stays without one, as in one process). The
gradient is the global-batch sum divided by the global normaliser, exactly the one-process step's (up to fp32
summation order). ``distribute_model`` is the choice of a run: replicate LoRA models, FSDP2-shard the others.

Not here: sharding (``fsdp.py``), checkpoints (``checkpoint.py``), the step (``polyrl.train.engine``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from polyrl.train.parallel.fsdp import is_sharded, shard_model
from polyrl.train.parallel.world import World

_MARK = "_polyrl_replicated"


def is_replicated(model: nn.Module) -> bool:
    """True after ``replicate_model`` (every rank holds the whole model; gradients are all-reduced)."""
    return bool(getattr(model, _MARK, False))


@torch.no_grad()
def replicate_model(model: nn.Module, world: World) -> nn.Module:
    """Make ``model`` (the whole model, on ``world.device``, on every rank) a data-parallel replica in place:
    rank 0's trainable parameters are broadcast to every rank, and the engine will all-reduce their gradients.
    Collective: every rank calls it. Returns ``model``."""
    if not world.distributed:
        raise ValueError("replicate_model needs a process group; call parallel.init_world() under torchrun")
    if is_sharded(model):
        raise ValueError("this model is already FSDP2-sharded; replicate a plain model instead")
    for p in model.parameters():
        if p.requires_grad:
            dist.broadcast(p.data, src=0)
    setattr(model, _MARK, True)
    return model


def all_reduce_grads_(masters: Sequence[torch.Tensor], world: World) -> None:
    """Sum the ``.grad`` of ``masters`` over ranks in place (one flat all-reduce per gradient dtype). A tensor whose
    gradient is None on some ranks counts as zeros there; one that has none on every rank keeps None."""
    if not world.distributed or not masters:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for m in masters:
        by_dtype.setdefault(m.dtype, []).append(m)
    for group in by_dtype.values():
        _all_reduce_group(group, world)


def _all_reduce_group(masters: list[torch.Tensor], world: World) -> None:
    # [sum of numels | one presence flag per tensor]: the flags tell which tensors got a gradient anywhere
    parts = [m.grad.reshape(-1) if m.grad is not None else torch.zeros_like(m).reshape(-1) for m in masters]
    flags = torch.tensor([float(m.grad is not None) for m in masters], dtype=masters[0].dtype, device=parts[0].device)
    flat = world.all_reduce_sum(torch.cat([*parts, flags]))
    offset = 0
    present = flat[-len(masters) :].tolist()
    for m, seen in zip(masters, present):
        n = m.numel()
        if seen > 0:
            g = flat[offset : offset + n].view_as(m)
            if m.grad is None:
                m.grad = g.clone()
            else:
                m.grad.copy_(g)
        offset += n


def distribute_model(model: nn.Module, world: World, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The data-parallel layout of a run's model: a LoRA model (``model.lora_config``) is replicated (its adapters
    all-reduced), any other model FSDP2-sharded (``shard_model``, fp32 masters, ``compute_dtype`` for compute)."""
    if getattr(model, "lora_config", None) is not None:
        return replicate_model(model, world)
    return shard_model(model, world, compute_dtype)
