"""polyrl.train.parallel: training past one device with torch.distributed (torchrun + FSDP2, or replicas for LoRA).

A data-parallel run, on every rank (``torchrun --nproc-per-node N ...``, see docs/distributed.md)::

    from polyrl.train.parallel import init_world, shard_model, save_sharded_checkpoint, export_hf
    world = init_world()                                   # RANK/WORLD_SIZE/LOCAL_RANK, platform backend
    model = load_model(path, dtype=torch.float32, device=world.device)
    shard_model(model, world, compute_dtype)               # fully_shard layers + root, bf16 compute, fp32 reduce
    engine = TrainEngine(model, ..., world=world)          # global normaliser, all-reduced loss, sharded clip
    it = data.iterator(world.rank, world.world_size)       # rank-strided micro-batches
    stats = engine.step([next(it) for _ in range(accum)])  # identical on every rank
    save_sharded_checkpoint(root, step, model, engine, world, data_state=..., config=...)
    export_hf(model, world, out / "final", tokenizer)      # one HF folder, written by rank 0

A LoRA / QLoRA model is not sharded but replicated (``replicate_model(model, world)``: every rank holds the whole
frozen base and the adapters, the engine all-reduces the adapters' gradients); ``distribute_model`` picks the
layout for a run's model, ``save_distributed_checkpoint`` the matching checkpoint kind, and ``export_hf`` writes a
replicated LoRA model as its PEFT adapter folder.

Pieces: ``world`` (process group from torchrun's variables; ``collectives_on``: a thread's collectives on a group of
its own), ``fsdp`` (``shard_model``, sharded grad norm,
full-tensor gathering), ``replicate`` (DDP-style replicas: broadcast, gradient all-reduce), ``checkpoint`` (DCP and
replicated checkpoints that resume at any world size, HF / PEFT export), ``rollout`` (data-parallel generation with
gathered full weights). Not here: the run loop
(``polyrl.run``), the launcher (torchrun; ``polyrl train --nproc-per-node`` re-launches
through it), a home-made cluster layer.
"""

from polyrl.train.parallel.checkpoint import (
    convert_position,
    export_hf,
    is_sharded_checkpoint,
    load_any_checkpoint,
    load_full_checkpoint,
    load_sharded_checkpoint,
    save_distributed_checkpoint,
    save_replicated_checkpoint,
    save_sharded_checkpoint,
    saved_world_size,
)
from polyrl.train.parallel.fsdp import is_sharded, shard_model, sharded_grad_norm
from polyrl.train.parallel.replicate import all_reduce_grads_, distribute_model, is_replicated, replicate_model
from polyrl.train.parallel.rollout import (
    generate_data_parallel,
    generate_on_root,
    rollout_model,
    shard_indices,
    sync_rollout_weights,
)
from polyrl.train.parallel.world import World, collectives_on, destroy_world, init_world, launched

__all__ = [
    "World",
    "all_reduce_grads_",
    "collectives_on",
    "convert_position",
    "destroy_world",
    "distribute_model",
    "export_hf",
    "generate_data_parallel",
    "generate_on_root",
    "init_world",
    "is_replicated",
    "is_sharded",
    "is_sharded_checkpoint",
    "launched",
    "load_any_checkpoint",
    "load_full_checkpoint",
    "load_sharded_checkpoint",
    "replicate_model",
    "rollout_model",
    "save_distributed_checkpoint",
    "save_replicated_checkpoint",
    "save_sharded_checkpoint",
    "saved_world_size",
    "shard_indices",
    "shard_model",
    "sharded_grad_norm",
    "sync_rollout_weights",
]
