"""The training run for offline algorithms (SFT, and any spec with ``build_data`` + ``make_loss``).

``run(cfg)`` dispatches to the spec's own ``run`` or to ``run_offline``, which: checks the run directory
and the resume point, saves the resolved config, loads the tokenizer and builds the data (data errors come
before the model is loaded), loads the model, then loops ``TrainEngine.step`` over packed micro-batches
(``engine.accumulation_steps`` per optimizer step) with metrics, optional eval loss, and atomic checkpoints
that carry the data position and data stats, so ``resume`` continues exactly. At the end it writes a last
checkpoint, the final HF folder ``<out>/final``, ``summary.json`` and ``metrics.png``. A LoRA run (``cfg.lora``)
trains adapters on a frozen base (``load_policy``); its checkpoints and ``final`` are PEFT adapter folders. Under
torchrun the model is FSDP2-sharded, or for LoRA replicated with all-reduced adapter gradients
(``parallel.distribute_model``).

Not here: the step itself (``polyrl.train.engine``), checkpoint files (``polyrl.train.checkpoint``),
argument parsing (``polyrl.cli.train``), online (rollout) algorithms.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from polyrl.algorithms.config import RunConfig, differences, save_resolved
from polyrl.errors import CheckpointError, ConfigError

FINAL_DIR = "final"


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg``; returns the run summary."""
    fn = cfg.spec.run or run_offline
    return fn(cfg)


# ---- the model ----------------------------------------------------------------------------------
def load_policy(cfg: RunConfig, dev: torch.device, world: Any = None) -> Any:
    """The model a run trains: the full model in fp32 (the engine takes fp32 masters and casts), or for a LoRA
    run (``cfg.lora``) the frozen base in the compute dtype with adapters (fresh, or ``cfg.model``'s adapter): the
    same on every rank of a data-parallel ``world`` (``distribute_model`` replicates it)."""
    from polyrl.models.checkpoint import load_model

    if cfg.lora is None:
        return load_model(cfg.model, dtype=torch.float32, device=dev)
    from polyrl.models.lora import load_lora_model
    from polyrl.train import resolve_compute_dtype

    return load_lora_model(cfg.model, cfg.lora, resolve_compute_dtype(cfg.precision, dev.type), dev, seed=cfg.seed)


def tokenizer_path(cfg: RunConfig) -> str:
    """Where the run's tokenizer is: ``cfg.model``, or for an adapter folder without one, its base model."""
    from polyrl.models.lora import base_model_path, is_adapter_dir

    model = Path(cfg.model)
    if is_adapter_dir(model) and not (model / "tokenizer_config.json").is_file():
        return base_model_path(model)
    return cfg.model


# ---- before the model ---------------------------------------------------------------------------
def resume_point(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run. A run directory that already holds
    checkpoints needs ``resume`` (so a finished run is never overwritten by accident)."""
    from polyrl.train.checkpoint import list_checkpoints

    out = Path(cfg.out)
    found = list_checkpoints(Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints")
    latest = found[-1] if found else None
    if cfg.resume is None:
        if latest is not None:
            raise ConfigError(
                f"{out} already holds a run (checkpoint {latest.name}); pass --resume to continue it, "
                "or choose another --out"
            )
        return None
    if cfg.resume == "latest":
        if latest is None:
            print(f"resume: no checkpoint in {out} yet; starting from step 0")
        return latest
    path = Path(cfg.resume)
    if not (path / "manifest.json").is_file():
        raise CheckpointError(
            f"--resume {cfg.resume!r} is not a complete checkpoint folder (no manifest.json); give a "
            f"checkpoints/step-* folder or --resume latest"
        )
    return path


def total_steps(cfg: RunConfig, batches_per_epoch: int, accumulation: int | None = None) -> int:
    """Optimizer steps of the run: ``train.max_steps``, else ``train.epochs`` (default 1) of the data.
    ``accumulation``: micro-batches per step of this rank (default ``engine.accumulation_steps``)."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    epochs = cfg.train.epochs if cfg.train.epochs is not None else 1.0
    return max(1, math.ceil(epochs * batches_per_epoch / (accumulation or cfg.engine.accumulation_steps)))


def eval_source(cfg: RunConfig, spec: Any, tokenizer: Any) -> Any | None:
    """Held-out data for ``train.eval_every``: ``train.eval_data``, else the data's test part."""
    import dataclasses

    if cfg.train.eval_every <= 0:
        return None
    if cfg.train.eval_data:
        return spec.build_data(dataclasses.replace(cfg.data, path=cfg.train.eval_data, limit=None), tokenizer)
    if cfg.data.holdout > 0:
        return spec.build_data(cfg.data, tokenizer, "test")
    if cfg.data.path.startswith("builtin:"):
        path = cfg.data.path.split("@", 1)[0] + "@test"
        return spec.build_data(dataclasses.replace(cfg.data, path=path, split=None), tokenizer)
    raise ConfigError("train.eval_every is set but there is no eval data; pass --eval-data SPEC or set data.holdout")


# ---- the loop -----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_loss(model: Any, data: Any, loss_fn: Any, spec: Any, algo_cfg: Any, device: torch.device) -> float:
    """Mean loss over one pass of ``data`` (the same normalisation as training)."""
    was_training = model.training
    model.eval()
    total, norm = 0.0, 0.0
    for batch in data.iterator(max_epochs=1):
        batch = batch.to(device)
        loss_sum, _ = loss_fn(model, batch)
        n = spec.normalizer(algo_cfg, [batch]) if spec.normalizer else None
        total += float(loss_sum)
        norm += float(batch.num_target_tokens if n is None else n)
    model.train(was_training)
    return total / max(norm, 1.0)


def _data_summary(stats: Any) -> dict[str, Any]:
    """The data counts a user checks after a run (skipped rows first), flat for the summary table."""
    d = stats.as_dict()
    out = {f"data_{k}": d[k] for k in ("sequences", "target_tokens", "bad_rows", "truncated")}
    out["data_dropped"] = d["dropped_too_long"] + d["dropped_no_target"]
    if d["bad_examples"]:
        out["data_bad_examples"] = d["bad_examples"]
    return out


def _data_state(it: Any, data: Any) -> dict[str, Any]:
    return {"iterator": it.state_dict(), "stats": data.stats.as_dict(), "world_size": it.world_size}


# ---- data-parallel hooks (torchrun; polyrl.train.parallel) --------------------------------------
def rank_accumulation(cfg: RunConfig, world_size: int) -> int:
    """Micro-batches per step on each rank: ``engine.step_tokens`` is the GLOBAL batch, split over ranks
    (at least one micro-batch per rank, so a step is never smaller than ``world_size`` micro-batches)."""
    accum = cfg.engine.accumulation_steps
    if world_size > 1 and accum > world_size and accum % world_size:
        raise ConfigError(
            f"engine.step_tokens makes {accum} micro-batches per step, which {world_size} ranks cannot split "
            f"evenly; set step_tokens to a multiple of {world_size} x micro_batch_tokens"
        )
    return max(1, accum // world_size)


def _restore_position(it: Any, data: Any, data_state: dict[str, Any], world_size: int) -> None:
    """Put the iterator where the checkpoint stopped, converting a position saved at another world size."""
    from polyrl.train.parallel import convert_position

    saved_ws = int(data_state.get("world_size", 1))
    if saved_ws == world_size:
        it.load_state_dict(data_state["iterator"])
        return
    probe = data.iterator(0, saved_ws)
    probe.load_state_dict(data_state["iterator"])  # checks it is the same data, seed and packing
    epoch, position = convert_position(probe.epoch, probe.position, saved_ws, world_size)
    it.load_state_dict({**it.state_dict(), "epoch": epoch, "position": position})


def run_offline(cfg: RunConfig, stream: Any = None) -> dict[str, Any]:
    """The offline training run described in the module docstring; returns the summary dict (rank 0's
    under torchrun; the other ranks print nothing and return ``{"status": ...}``)."""
    from polyrl.train.parallel import destroy_world, init_world

    world = init_world()
    try:
        return _run_offline(cfg, stream, world)
    finally:
        destroy_world(world)


def _run_offline(cfg: RunConfig, stream: Any, world: Any) -> dict[str, Any]:
    import os

    from polyrl.models.checkpoint import load_tokenizer, save_model
    from polyrl.platform import device
    from polyrl.train import CheckpointManager, MetricsLogger, TrainEngine, load_checkpoint
    from polyrl.train import parallel as par

    stream = stream or sys.stdout
    if not world.is_main:
        stream = open(os.devnull, "w")  # noqa: SIM115 - one summary, from rank 0
    spec, out = cfg.spec, Path(cfg.out)
    start_point = resume_point(cfg)
    t_start = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    data = spec.build_data(cfg.data, tokenizer)
    it = data.iterator(world.rank, world.world_size)
    eval_data = eval_source(cfg, spec, tokenizer)
    accum = rank_accumulation(cfg, world.world_size)
    steps = total_steps(cfg, it.batches_per_epoch, accum)
    s = data.stats
    print(
        f"{cfg.algo}: {s.sequences} sequences, {s.tokens} tokens ({s.target_tokens} trained), "
        f"{it.batches_per_epoch} micro-batches per epoch{' per rank' if world.distributed else ''}, {steps} steps "
        f"of {accum} micro-batch(es){f' x {world.world_size} ranks' if world.distributed else ''}; "
        f"bad rows skipped: {s.bad_rows}, truncated: {s.truncated}",
        file=stream,
    )
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, out)

    dev = world.device if world.distributed else device.torch_device()
    model = load_policy(cfg, dev, world)  # fp32 masters (LoRA: a frozen base in the compute dtype)
    if world.distributed:  # FSDP2-sharded; LoRA: replicated, adapter gradients all-reduced
        from polyrl.train import resolve_compute_dtype

        par.distribute_model(model, world, resolve_compute_dtype(cfg.precision, dev.type))
    engine = TrainEngine(model, cfg.optim, cfg.schedule, cfg.precision, cfg.engine, total_steps=steps, world=world)
    loss_fn = spec.make_loss(cfg.algo_config)
    start = 0
    if start_point is not None:
        if world.distributed or par.is_sharded_checkpoint(start_point):
            loaded = par.load_any_checkpoint(start_point, model, engine, world)
        else:
            loaded = load_checkpoint(start_point, model, engine)
        start = loaded.step
        if "iterator" not in loaded.data_state:
            raise CheckpointError(f"{start_point} has no data position; it was not written by `polyrl train`")
        _restore_position(it, data, loaded.data_state, world.world_size)
        changed = differences(loaded.config, cfg.to_dict()) if loaded.config else []
        note = f" (changed since: {', '.join(changed)})" if changed else ""
        print(f"resumed from {start_point} at step {start}{note}", file=stream)
    if start > steps:
        raise ConfigError(f"the checkpoint is at step {start}, past this run's {steps} steps; raise --max-steps")

    ckpts = CheckpointManager(out, cfg.checkpoint) if world.is_main else None  # rank 0 cleans stale dirs first
    world.barrier()
    ckpts = ckpts or CheckpointManager(out, cfg.checkpoint)
    series = ("loss", "lr", "grad_norm", *(("eval_loss",) if eval_data is not None else ()), *spec.plot_series)
    log = None
    if world.is_main:
        log = MetricsLogger(
            out, steps, log_every=cfg.train.log_every, start_step=start, plot_series=series, stream=stream
        )
    config_dict = cfg.to_dict()

    def save(step: int) -> None:
        state = _data_state(it, data)
        if not world.distributed:
            ckpts.save(step, model, engine, data_state=state, config=config_dict, tokenizer=tokenizer)
            return
        par.save_distributed_checkpoint(
            ckpts.root, step, model, engine, world, data_state=state, config=config_dict, tokenizer=tokenizer
        )
        if world.is_main:
            ckpts.prune()
        world.barrier()

    try:
        for step in range(start, steps):
            micro = [next(it) for _ in range(accum)]
            norm = spec.normalizer(cfg.algo_config, micro) if spec.normalizer else None
            if norm is not None and world.distributed:
                norm = world.sum_float(norm)  # the spec counts this rank's share; the step divides by the global
            rec = engine.step(micro, loss_fn, norm).to_dict()
            rec["epoch"] = it.epoch + it.position / max(1, it.batches_per_epoch)
            if eval_data is not None and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == steps):
                rec["eval_loss"] = evaluate_loss(model, eval_data, loss_fn, spec, cfg.algo_config, dev)
            if log is not None:
                log.log(rec)
            if ckpts.should_save(step + 1) and step + 1 < steps:
                save(step + 1)
        if ckpts.should_save(steps, final=True):
            save(steps)
        final = None
        if cfg.train.save_final_model and world.distributed:
            final = par.export_hf(model, world, out / FINAL_DIR, tokenizer=tokenizer)
        elif cfg.train.save_final_model:
            final = save_model(model, out / FINAL_DIR, tokenizer=tokenizer)
    except BaseException as exc:
        if log is not None:
            log.close(extra={"status": f"failed: {type(exc).__name__}"}, print_table=False)
        raise
    if log is None:
        return {"status": "finished", "rank": world.rank}
    extra = {
        "algo": cfg.algo,
        "status": "finished",
        "resumed_from_step": start,
        "world_size": world.world_size,
        "wall_time_s": time.perf_counter() - t_start,
        **_data_summary(data.stats),
        "final_model": str(final) if final is not None else None,
    }
    summary = log.close(extra=extra)
    print(f"final model: {final}  metrics: {out / 'metrics.jsonl'}  plot: {out / 'metrics.png'}", file=stream)
    return summary
