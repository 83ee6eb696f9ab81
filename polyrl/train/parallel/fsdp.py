"""FSDP2 for polyrl models: ``fully_shard`` each decoder layer and the root, and the tensor helpers that
sharded (DTensor) parameters need: the global gradient norm and gathering full weights.

``shard_model(model, world, compute_dtype)`` shards parameters over a 1-D device mesh of all ranks. The
sharded parameters stay fp32 (they are the optimizer's masters); with a lower ``compute_dtype`` the
``MixedPrecisionPolicy`` all-gathers them as that dtype for compute (param bf16) and reduce-scatters the
gradients in fp32. On the CPU (gloo) everything is fp32. Parameter names are unchanged (HF names), so
full state dicts are HF state dicts.

FSDP2 reduce-scatter *averages* gradients over ranks; the engine multiplies its backward scale by
``world_size`` (see ``grad_sum_factor``) so sharded gradients are sums over the global batch divided by
the global normaliser, exactly as in one process. This module does not run steps or write files.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from polyrl.errors import ConfigError
from polyrl.train.parallel.world import World


def fsdp_api() -> tuple[Any, Any]:
    """``(fully_shard, MixedPrecisionPolicy)``: public since torch 2.6, the composable path before."""
    try:
        # lazy: torch.distributed.fsdp takes ~1 s to import and only sharded runs need it
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        # lazy: the pre-2.6 location of the same API
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _dtensor_cls() -> type | None:
    try:
        # lazy: torch.distributed.tensor takes ~1 s to import; it is needed only once DTensors may exist
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            # lazy: the pre-2.5 location of DTensor
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    """The blocks to shard one by one (``model.model.layers`` of a DecoderLM); [] when there are none."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def shard_model(
    model: nn.Module,
    world: World,
    compute_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply FSDP2 in place (each decoder layer, then the root: embeddings, final norm, lm head) and
    return ``model``. Parameters must be fp32 and on ``world.device`` (the full model on every rank).
    ``reshard_after_forward=False`` keeps gathered layers until backward (more memory, fewer all-gathers)."""
    if not world.distributed:
        raise ValueError("shard_model needs a process group; call polyrl.train.parallel.init_world() under torchrun")
    if getattr(model, "lora_config", None) is not None:
        raise ConfigError(
            "sharding a LoRA model (its frozen base) with FSDP2 is not supported yet; replicate it instead "
            "(polyrl.train.parallel.replicate_model, what `polyrl train --lora --nproc-per-node N` does)"
        )
    fully_shard, policy_cls = fsdp_api()

    mesh = init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("dp",))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = policy_cls(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def grad_sum_factor(world: World) -> float:
    """Factor on the backward scale that turns FSDP's rank-average of gradients into a sum."""
    return float(world.world_size) if world.distributed else 1.0


def sharded_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm (fp32 scalar) of DTensor gradients: each rank sums the squares of its local shards,
    one all-reduce adds them. Placements must be ``Shard`` (FSDP's); replicated ones go through
    ``full_tensor`` so no element is counted twice."""
    # lazy: torch.distributed.tensor takes ~1 s to import; only sharded (DTensor) gradients get here
    from torch.distributed.tensor import Shard

    local_sq = torch.zeros((), dtype=torch.float32, device=grads[0].to_local().device)
    replicated: list[torch.Tensor] = []
    mesh = grads[0].device_mesh
    for g in grads:
        if all(isinstance(p, Shard) for p in g.placements):
            local = g.to_local()
            if local.numel():
                local_sq += torch.linalg.vector_norm(local, dtype=torch.float32).square()
        else:
            replicated.append(g.full_tensor())
    dist.all_reduce(local_sq, op=dist.ReduceOp.SUM, group=mesh.get_group())
    for full in replicated:
        local_sq += torch.linalg.vector_norm(full, dtype=torch.float32).square()
    return local_sq.sqrt()


def scale_sharded_(grads: Sequence[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply DTensor gradients in place through their local shards (no communication)."""
    locals_ = [g.to_local() for g in grads]
    torch._foreach_mul_(locals_, factor)


def full_tensors(model: nn.Module, to_cpu: bool = True, keep: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every entry of ``model.state_dict()``, all-gathering sharded ones.
    Every rank must iterate to the end (each DTensor is one collective, in the same order everywhere).
    ``keep=False`` yields None instead of the tensor (ranks that only take part in the gathers)."""
    state = model.state_dict(keep_vars=True)
    seen: dict[int, torch.Tensor] = {}
    for name, t in state.items():
        if id(t) in seen:  # tied weights: one gather, one tensor
            yield name, seen[id(t)]
            continue
        full = t.full_tensor() if is_dtensor(t) else t
        full = full.detach()
        if to_cpu and keep:
            full = full.cpu()
        out = full if keep else None
        seen[id(t)] = out
        yield name, out
