"""Data-parallel rollout next to FSDP2 training: each rank generates for its share of the prompts with the
FULL weights, and the results are gathered so every rank holds the whole step's outputs in prompt order.

Generation must not run collectives: ranks decode different numbers of steps, and an FSDP-sharded model
all-gathers in every forward, so ranks would deadlock. So the rollout engine runs a plain (unsharded)
copy of the model, ``rollout_model(sharded, dtype)``, and after each optimizer step
``sync_rollout_weights(sharded, plain)`` all-gathers the shards layer by layer into it IN PLACE (the
``LLM`` keeps referencing the same tensors; call ``llm.reset_prefix_cache()`` afterwards). The cost is one
full copy of the weights per rank, in the compute dtype: the colocated single-GPU design shares tensors
instead, which sharding makes impossible.

``generate_data_parallel(llm, prompts, params, world)`` gives rank r prompts r, r + W, ... (balanced
whatever the order), runs ``llm.generate`` and ``all_gather_object``s the outputs.
``generate_on_root(generate, prompts, params, world)``: rank 0 alone generates every prompt (async RL's rollout
worker processes, which rank 0 owns) and its outputs are broadcast, so every rank gets the same list; an error on
rank 0 reaches every rank (each raises). This module does not
import ``polyrl.infer`` (``llm`` is any object with ``generate(prompts, params)``) and does not compute
rewards or advantages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polyrl.models.decoder import build_model
from polyrl.train.parallel.fsdp import full_tensors
from polyrl.train.parallel.world import World


def rollout_model(sharded: nn.Module, dtype: torch.dtype | None = None, dev: torch.device | None = None) -> nn.Module:
    """A plain ``DecoderLM`` with the same config, on ``dev`` (default: where the shards live) in ``dtype``
    (default fp32), filled with the full weights of ``sharded``. Collective: every rank calls it."""
    first = next(sharded.parameters())
    local = first.to_local() if hasattr(first, "to_local") else first
    plain = build_model(
        sharded.config, dtype=dtype or torch.float32, device=dev or local.device, init=False, options=sharded.options
    )
    sync_rollout_weights(sharded, plain)
    plain.eval()
    return plain


@torch.no_grad()
def sync_rollout_weights(sharded: nn.Module, plain: nn.Module) -> None:
    """Copy ``sharded``'s full weights into ``plain``'s tensors in place (dtype cast on the way). One
    all-gather per sharded tensor, in state-dict order on every rank."""
    target = plain.state_dict(keep_vars=True)
    for name, full in full_tensors(sharded, to_cpu=False):
        dst = target.get(name)
        if dst is None:
            raise KeyError(f"rollout model has no tensor {name!r}; build it with rollout_model()")
        if dst.data_ptr() != full.data_ptr():
            dst.copy_(full)


def shard_indices(n: int, world: World) -> list[int]:
    """The prompt indices this rank generates for: rank, rank + W, rank + 2W, ..."""
    return list(range(world.rank, n, world.world_size))


def generate_data_parallel(
    llm: Any,
    prompts: list[Any],
    params: Any,
    world: World,
    on_finish: Callable | None = None,
    between_steps: Callable | None = None,
) -> list[Any]:
    """``llm.generate`` over this rank's share of ``prompts`` (``params``: one SamplingParams or one per
    prompt), then every rank's outputs gathered back into prompt order. Returns the outputs of ALL prompts
    on every rank. Ranks with no prompts (fewer prompts than ranks) still take part in the gather.
    ``on_finish(prompt_index, sample_index, output)``: this rank's sequences as they finish (``LLM.generate``).
    ``between_steps``: ``LLM.generate``'s step-boundary hook (async RL's partial rollouts), on this rank's engine
    only; it must not wait for another rank (the gather comes after the generation)."""
    mine = shard_indices(len(prompts), world)
    plist = params if isinstance(params, list) else None
    kw = {"on_finish": lambda k, j, c: on_finish(mine[k], j, c)} if on_finish is not None else {}
    if between_steps is not None:
        kw["between_steps"] = between_steps
    outs = llm.generate([prompts[i] for i in mine], [plist[i] for i in mine] if plist else params, **kw) if mine else []
    gathered = world.all_gather_object(list(zip(mine, outs)))
    result: list[Any] = [None] * len(prompts)
    for part in gathered:
        for i, out in part:
            result[i] = out
    return result


def generate_on_root(
    generate: Callable[..., list[Any]], prompts: list[Any], params: Any, world: World, on_finish: Callable | None = None
) -> list[Any]:
    """Rank 0's ``generate(prompts, params, on_finish=...)`` (every prompt; ``on_finish`` as it hands the outputs
    over), broadcast with ``world.broadcast_object`` (this thread's group, ``collectives_on``): every rank returns
    the outputs of ALL prompts, the other ranks generating nothing. A failure on rank 0 is broadcast in place of the
    outputs, so no rank is left waiting: rank 0 re-raises it, the others raise a RuntimeError naming it."""
    if not world.is_main:
        got = world.broadcast_object(None)
        if isinstance(got, str):
            raise RuntimeError(f"rank 0's rollout failed: {got}")
        return list(got)
    kw = {"on_finish": on_finish} if on_finish is not None else {}
    try:
        outs = generate(prompts, params, **kw)
    except BaseException as exc:
        world.broadcast_object(f"{type(exc).__name__}: {exc}")
        raise
    world.broadcast_object(tuple(outs))
    return outs
