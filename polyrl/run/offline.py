"""The offline training loop (SFT, DPO, and any spec with ``build_data`` + ``make_loss``): ``run_offline(cfg)``.

``OfflineRun`` goes in named steps: ``setup`` checks the run directory and the resume point, loads the tokenizer and
builds the data (data errors come before the model is loaded) with the run's packing budget
(``engine.micro_batch_tokens``), runs the algorithm's ``prepare`` hook (DPO's reference log-probs) and saves the
resolved config; ``load_model`` loads (and under torchrun distributes) the model and builds the ``TrainEngine``;
``resume`` restores a checkpoint and the data position; ``train`` loops ``TrainEngine.step`` over packed
micro-batches (``engine.accumulation_steps`` per optimizer step) with metrics, an optional held-out evaluation
(``evaluate_held_out``: ``eval_loss`` and ``eval_<metric>`` for each metric of the loss, DPO's reward margin and
preference accuracy among them; every ``train.eval_every`` steps, and as step 0 before training with
``train.eval_before_train``) and atomic checkpoints that carry the data position and data stats, so ``resume``
continues exactly; ``train.keep_best`` keeps the best evaluated step's model as ``<out>/best`` (``polyrl.run.best``;
its best value rides in the checkpoints). At the end it writes a last checkpoint, the final HF folder ``<out>/final``,
``summary.json`` and ``metrics.png``. A LoRA run (``cfg.lora``) trains adapters on a frozen base (``load_policy``); its
checkpoints and ``final`` are PEFT adapter folders. Under torchrun the model is FSDP2-sharded, or for LoRA replicated
with all-reduced adapter gradients (``parallel.distribute_model``).

The helpers every run shares (``load_policy``, ``resume_point``, ``open_checkpoints``, ``export_final``,
``keep_best``, ``run_steps``, ``report_stream``) live here too. Not here: the step itself (``polyrl.train.engine``),
checkpoint files (``polyrl.train.checkpoint``), argument parsing (``polyrl.cli.train``), online (rollout) runs
(``online``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from polyrl import algorithms
from polyrl.algorithms.online_config import LossFn
from polyrl.algorithms.spec import AlgorithmSpec, PrepareContext
from polyrl.data.config import DataConfig
from polyrl.data.dataset import DataStats, TokenizedData
from polyrl.data.sampler import PackedBatchIterator
from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.checkpoint import load_model, load_tokenizer, save_model
from polyrl.models.lora import base_model_path, is_adapter_dir, load_lora_model
from polyrl.platform import device
from polyrl.run.best import BestKeeper, BestMetric
from polyrl.run.config import RunConfig, differences, save_resolved
from polyrl.run.stop_signal import RunStopped, StopSignal
from polyrl.train import parallel as par
from polyrl.train.checkpoint import (
    CheckpointManager,
    LoadedCheckpoint,
    checkpoint_problem,
    list_checkpoints,
    load_checkpoint,
    restore_moved_aside,
    step_dir_name,
)
from polyrl.train.engine import TrainEngine
from polyrl.train.metrics import MetricsLogger
from polyrl.train.precision import resolve_compute_dtype

FINAL_DIR = "final"


# ---- shared by every run --------------------------------------------------------------------------
def report_stream(stream: TextIO | None, world: par.World) -> TextIO:
    """Where a run reports: ``stream`` (default stdout) on rank 0, nowhere on the other ranks."""
    if not world.is_main:
        return open(os.devnull, "w")  # noqa: SIM115 - one report, from rank 0
    return stream or sys.stdout


def load_policy(cfg: RunConfig, dev: torch.device) -> nn.Module:
    """The model a run trains: the full model in fp32 (the engine takes fp32 masters and casts), or for a LoRA
    run (``cfg.lora``) the frozen base in the compute dtype with adapters (fresh, or ``cfg.model``'s adapter): the
    same on every rank of a data-parallel run (``distribute_model`` replicates it). Its ``DecoderOptions`` are the
    run's ``[decoder]`` table."""
    loader = getattr(cfg.spec, "model_loader", None)
    if loader is not None:  # the algorithm trains another kind of model (rm: a reward model)
        if cfg.lora is not None:
            raise ConfigError(f"{cfg.algo} trains the whole model; remove --lora / [lora]")
        model = loader(cfg.model, torch.float32, dev, seed=cfg.seed)
    elif cfg.lora is None:
        model = load_model(cfg.model, dtype=torch.float32, device=dev)
    else:
        dtype = resolve_compute_dtype(cfg.precision, dev.type)
        model = load_lora_model(cfg.model, cfg.lora, dtype, dev, seed=cfg.seed)
    model.options = cfg.decoder  # the [decoder] table, before any engine captures a graph
    return model


def place_policy(cfg: RunConfig, world: par.World) -> tuple[nn.Module, torch.device]:
    """``load_policy`` on this rank's device; under torchrun FSDP2-sharded (LoRA: replicated)."""
    dev = world.device if world.distributed else device.torch_device()
    model = load_policy(cfg, dev)
    if world.distributed:
        par.distribute_model(model, world, resolve_compute_dtype(cfg.precision, dev.type))
    return model, dev


def tokenizer_path(cfg: RunConfig) -> str:
    """Where the run's tokenizer is: ``cfg.model``, or for an adapter folder without one, its base model."""
    model = Path(cfg.model)
    if is_adapter_dir(model) and not (model / "tokenizer_config.json").is_file():
        return base_model_path(model, cfg.lora.base if cfg.lora is not None else None)
    return cfg.model


def resume_point(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run. A run directory that already holds
    checkpoints needs ``resume`` (so a finished run is never overwritten by accident). ``latest`` is the newest
    complete checkpoint: a truncated or corrupted newer one (``checkpoint_problem``) is skipped with a warning
    that names it, and left in place."""
    out = Path(cfg.out)
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    restore_moved_aside(root)  # a checkpoint an interrupted overwrite moved aside is still the newest
    found = list_checkpoints(root)
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
            return None
        skipped: list[tuple[Path, str]] = []
        for path in reversed(found):
            problem = checkpoint_problem(path)
            if problem is None:
                for bad, why in skipped:
                    print(f"warning: resume: skipping {bad}: {why}; resuming from {path.name} instead", file=sys.stderr)
                return _same_algo(path, cfg)
            skipped.append((path, problem))
        whys = "; ".join(f"{bad.name}: {why}" for bad, why in skipped)
        raise CheckpointError(
            f"no complete checkpoint in {root} ({whys}); move them away to start from step 0, or give --resume PATH"
        )
    path = Path(cfg.resume)
    if not path.exists():
        raise CheckpointError(
            f"--resume {cfg.resume!r} does not exist; give a checkpoints/step-* folder or --resume latest"
        )
    if not (path / "manifest.json").is_file():
        # a run directory, or its checkpoints folder, given for its checkpoint
        inside = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
        hint = f"; its newest is --resume {inside[-1]}" if inside else ""
        raise CheckpointError(
            f"--resume {cfg.resume!r} is not a complete checkpoint folder (no manifest.json); give a "
            f"checkpoints/step-* folder or --resume latest{hint}"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"--resume {cfg.resume!r}: {path.name} is corrupted: {problem}; give another step-*")
    return _same_algo(path, cfg)


def _same_algo(path: Path, cfg: RunConfig) -> Path:
    """``path``, unless its saved run config (``config.json``) is of another algorithm that cannot continue as
    ``cfg.algo``: a ``CheckpointError`` then, before any data or model loads (an SFT checkpoint as a DPO run failed on
    the data position only after DPO's reference pass). Refused: an offline algorithm for another, or offline for
    online and back; online algorithms for each other (grpo -> gspo) are left to the run."""
    try:
        saved = json.loads((path / "config.json").read_text()).get("algo")
    except (OSError, ValueError, AttributeError):
        return path
    if not isinstance(saved, str) or saved == cfg.algo or saved not in algorithms.names():
        return path
    if algorithms.get(saved).loop != "offline" and cfg.spec.loop != "offline":
        return path
    raise CheckpointError(
        f"checkpoint {path} was written by an --algo {saved} run, and this run is {cfg.algo}; resume it with "
        f"--algo {saved}, or start the {cfg.algo} run from a trained model (the run's final/ folder) with another --out"
    )


def resume_note(loaded: LoadedCheckpoint, cfg: RunConfig) -> str:
    """`` (changed since: a, b)`` for the settings that differ from the checkpoint's saved config, else ''."""
    changed = differences(loaded.config, cfg.to_dict()) if loaded.config else []
    return f" (changed since: {', '.join(changed)})" if changed else ""


def open_checkpoints(out: Path, cfg: RunConfig, world: par.World) -> CheckpointManager:
    """The run's ``CheckpointManager``; rank 0 makes it first (it cleans stale folders), then the others."""
    ckpts = CheckpointManager(out, cfg.checkpoint) if world.is_main else None
    world.barrier()
    return ckpts or CheckpointManager(out, cfg.checkpoint)


def export_model(model: nn.Module, world: par.World, out: Path, tokenizer: Any) -> Path | None:
    """``model`` as an HF folder ``out`` (LoRA: a PEFT adapter folder), gathered from the shards under torchrun
    (a collective; the folder on rank 0, None elsewhere)."""
    if world.distributed:
        return par.export_hf(model, world, out, tokenizer=tokenizer)
    return save_model(model, out, tokenizer=tokenizer)


def export_final(cfg: RunConfig, model: nn.Module, world: par.World, tokenizer: Any) -> Path | None:
    """The final HF folder ``<out>/final`` (``train.save_final_model``), gathered from the shards under torchrun."""
    if not cfg.train.save_final_model:
        return None
    return export_model(model, world, Path(cfg.out) / FINAL_DIR, tokenizer)


def keep_best(
    cfg: RunConfig, world: par.World, export: Callable[[Path], Path | None], stream: TextIO
) -> BestKeeper | None:
    """The run's ``BestKeeper`` (``train.keep_best``; ``polyrl.run.best``), or None."""
    if not cfg.train.keep_best:
        return None
    return BestKeeper(BestMetric.parse(cfg.train.keep_best), Path(cfg.out), export, world, stream)


def open_metrics(
    cfg: RunConfig, out: Path, world: par.World, steps: int, start: int, series: tuple[str, ...], stream: TextIO
) -> MetricsLogger | None:
    """Rank 0's ``MetricsLogger`` for a run (None on the other ranks): ``series`` drawn in ``metrics.png``."""
    if not world.is_main:
        return None
    return MetricsLogger(
        out, steps, log_every=cfg.train.log_every, start_step=start, plot_series=series, stream=stream,
        report_to=cfg.train.report_to, config=cfg.to_dict(),
    )  # fmt: skip


def run_steps(
    start: int,
    steps: int,
    step: Callable[[int], dict[str, Any]],
    log: MetricsLogger | None,
    ckpts: CheckpointManager,
    save: Callable[[int], None],
    before: Callable[[], dict[str, Any]] | None = None,
    best: BestKeeper | None = None,
    agree: Callable[[bool], bool] | None = None,
    stop: StopSignal | None = None,
) -> None:
    """The loop every run shares: ``step(i)`` for i in [start, steps), each record logged, a checkpoint whenever
    ``ckpts`` asks for one, and the final one. ``before``: the evaluation of the initial model
    (``train.eval_before_train``), logged as step 0 when the run starts at step 0 (a resumed run has it already);
    ``best``: offered every record before the checkpoint of its step (``train.keep_best``). A SIGTERM
    (``stop_signal``) ends the loop after the step in progress, with a checkpoint of it, by raising ``RunStopped``;
    ``agree(flag)``: whether any rank got one (data-parallel runs: one all-reduce a step), else this process's.
    ``stop``: the trainer's ``StopSignal``, held across this loop and the run's finish (the final model and the
    summary), marked ``finish()`` here as the last step starts (no stop decision follows it); None: one of the
    loop's own."""
    if before is not None and start == 0:
        rec = {"step": 0, **before()}
        if log is not None:
            log.log(rec)
        if best is not None:
            best.update(0, rec)
    with StopSignal() if stop is None else contextlib.nullcontext(stop) as stop:
        for i in range(start, steps):
            if i + 1 == steps:  # the last step stops nothing (no decision follows it): a signal lets the run finish
                stop.finish()
            rec = step(i)
            if log is not None:
                log.log(rec)
            if best is not None:
                best.update(i + 1, rec)
            saved = ckpts.should_save(i + 1) and i + 1 < steps
            if saved:
                save(i + 1)
            signalled = stop.received is not None
            if i + 1 < steps and (agree(signalled) if agree is not None else signalled):
                if not saved:
                    save(i + 1)
                where = ckpts.root / step_dir_name(i + 1)
                name = stop.name() or "a stop signal on another rank"
                raise RunStopped(
                    f"stopped by {name} after step {i + 1} of {steps}; checkpoint {where}: continue with the same "
                    f"command and --resume",
                    128 + (stop.received or signal.SIGTERM),
                )
        stop.finish()  # a run resumed at its last step has none to take
        if ckpts.should_save(steps, final=True):
            save(steps)


def any_rank(world: par.World) -> Callable[[bool], bool] | None:
    """``run_steps``' ``agree`` of a data-parallel run (whether any rank's flag is set: one all-reduce), None in one
    process."""
    return (lambda flag: world.sum_float(float(flag)) > 0) if world.distributed else None


def end_status(exc: BaseException) -> str:
    """The summary's ``status`` of a run that ended with ``exc``: ``stopped`` after a stop signal (its checkpoint
    saved), else ``failed: <exception>``."""
    return "stopped" if isinstance(exc, RunStopped) else f"failed: {type(exc).__name__}"


def total_steps(cfg: RunConfig, batches_per_epoch: int, accumulation: int | None = None) -> int:
    """Optimizer steps of the run: ``train.max_steps``, else ``train.epochs`` (default 1) of the data.
    ``accumulation``: micro-batches per step of this rank (default ``engine.accumulation_steps``)."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    epochs = cfg.train.epochs if cfg.train.epochs is not None else 1.0
    return max(1, math.ceil(epochs * batches_per_epoch / (accumulation or cfg.engine.accumulation_steps)))


def eval_data_config(cfg: RunConfig) -> DataConfig:
    """The ``[data]`` settings that read ``train.eval_data``, whole: the training data's pipeline settings (template,
    lengths, format) without what picks rows of the training data (``limit``, ``split``, ``holdout``)."""
    return dataclasses.replace(cfg.data, path=cfg.train.eval_data, limit=None, split=None, holdout=0.0)


def eval_source(cfg: RunConfig, spec: AlgorithmSpec, tokenizer: Any) -> TokenizedData | None:
    """Held-out data for ``train.eval_every``: ``train.eval_data``, else the data's test part."""
    if cfg.train.eval_every <= 0:
        return None
    budget = cfg.engine.micro_batch_tokens
    if cfg.train.eval_data:
        return spec.build_data(eval_data_config(cfg), tokenizer, "train", budget)
    if cfg.data.holdout > 0:
        return spec.build_data(cfg.data, tokenizer, "test", budget)
    if cfg.data.path.startswith("builtin:"):
        path = cfg.data.path.split("@", 1)[0] + "@test"
        return spec.build_data(dataclasses.replace(cfg.data, path=path, split=None), tokenizer, "train", budget)
    raise ConfigError("train.eval_every is set but there is no eval data; pass --eval-data SPEC or set data.holdout")


# ---- the offline loop -------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_held_out(
    model: nn.Module,
    data: TokenizedData,
    loss_fn: LossFn,
    spec: AlgorithmSpec,
    algo_cfg: Any,
    dev: torch.device,
    prefix: str = "eval_",
) -> dict[str, float]:
    """One pass of ``data``: ``eval_loss`` and ``eval_<metric>`` for every metric the loss returns (DPO:
    ``eval_rewards/margins``, ``eval_rewards/accuracies``, ...), each its sum over the whole pass divided by the
    normaliser summed over the pass (the training normalisation: DPO's pair count, SFT's target tokens), so a
    metric is a mean over pairs / tokens however the batches are sized, never a mean of batch means."""
    was_training = model.training
    model.eval()
    total, norm = 0.0, 0.0
    sums: dict[str, float] = {}
    for batch in data.iterator(max_epochs=1):
        batch = batch.to(dev)
        loss_sum, metrics = loss_fn(model, batch)
        n = spec.normalizer(algo_cfg, [batch]) if spec.normalizer else None
        total += float(loss_sum)
        norm += float(batch.num_target_tokens if n is None else n)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    model.train(was_training)
    denom = max(norm, 1.0)
    return {f"{prefix}loss": total / denom, **{f"{prefix}{k}": v / denom for k, v in sums.items()}}


def evaluate_loss(
    model: nn.Module,
    data: TokenizedData,
    loss_fn: LossFn,
    spec: AlgorithmSpec,
    algo_cfg: Any,
    dev: torch.device,
) -> float:
    """Mean loss over one pass of ``data`` (the same normalisation as training); ``evaluate_held_out`` also gives
    the loss's metrics."""
    return evaluate_held_out(model, data, loss_fn, spec, algo_cfg, dev)["eval_loss"]


def _data_summary(stats: DataStats) -> dict[str, Any]:
    """The data counts a user checks after a run (skipped rows first), flat for the summary table."""
    d = stats.as_dict()
    out = {f"data_{k}": d[k] for k in ("sequences", "target_tokens", "bad_rows", "truncated")}
    out["data_dropped"] = d["dropped_too_long"] + d["dropped_no_target"]
    if d["bad_examples"]:
        out["data_bad_examples"] = d["bad_examples"]
    return out


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


def _restore_position(
    it: PackedBatchIterator, data: TokenizedData, data_state: dict[str, Any], world_size: int
) -> None:
    """Put the iterator where the checkpoint stopped, converting a position saved at another world size."""
    saved_ws = int(data_state.get("world_size", 1))
    if saved_ws == world_size:
        it.load_state_dict(data_state["iterator"])
        return
    probe = data.iterator(0, saved_ws)
    probe.load_state_dict(data_state["iterator"])  # checks it is the same data, seed and packing
    epoch, position = par.convert_position(probe.epoch, probe.position, saved_ws, world_size)
    it.load_state_dict({**it.state_dict(), "epoch": epoch, "position": position})


class OfflineRun:
    """One offline run in named steps (see the module docstring); ``train()`` returns the summary."""

    best: BestKeeper | None = None  # train.keep_best (set in __init__)

    def __init__(self, cfg: RunConfig, stream: TextIO | None, world: par.World) -> None:
        self.cfg, self.spec, self.world = cfg, cfg.spec, world
        self.out = Path(cfg.out)
        self.stream = report_stream(stream, world)
        self.t_start = time.perf_counter()
        self.setup()
        self.best = keep_best(cfg, world, self.export_best, self.stream)
        self.load_model()
        self.check_best_metric()
        self.start = self.resume() if self.start_point is not None else 0

    @torch.no_grad()
    def check_best_metric(self) -> None:
        """``train.keep_best`` naming a metric other than ``eval_loss``: the loss's metric names from one held-out
        micro-batch (eval mode, no gradient), checked before step 1; without it a name the loss does not return failed
        only at the first evaluation, ``eval_every`` steps in. A single process only (a forward is collective under
        FSDP; there the first evaluation checks, as ``eval_before_train`` does anywhere)."""
        if self.best is None or self.eval_data is None or self.world.distributed or self.cfg.train.eval_before_train:
            return
        if self.best.metric.name == "eval_loss":
            return
        batch = next(iter(self.eval_data.iterator(max_epochs=1)), None)
        if batch is None:
            return
        was_training = self.model.training
        self.model.eval()
        _, metrics = self.loss_fn(self.model, batch.to(self.device))
        self.model.train(was_training)
        self.best.check({"eval_loss", *(f"eval_{k}" for k in metrics)})

    def setup(self) -> None:
        """Run directory, tokenizer, data (and eval data), the algorithm's prepare hook, the resolved config."""
        cfg, spec, world = self.cfg, self.spec, self.world
        self.start_point = resume_point(cfg)
        self.tokenizer = load_tokenizer(tokenizer_path(cfg))
        self.data = spec.build_data(cfg.data, self.tokenizer, "train", cfg.engine.micro_batch_tokens)
        self.it = self.data.iterator(world.rank, world.world_size)
        self.eval_data = eval_source(cfg, spec, self.tokenizer)
        self.make_loss = spec.make_loss
        if spec.prepare is not None:  # before the model loads: what the loss needs (DPO: reference log-probs)
            self.make_loss = spec.prepare(self._prepare_context())
        self.accum = rank_accumulation(cfg, world.world_size)
        self.steps = total_steps(cfg, self.it.batches_per_epoch, self.accum)
        s, ranks = self.data.stats, f" x {world.world_size} ranks" if world.distributed else ""
        print(
            f"{cfg.algo}: {s.sequences} sequences, {s.tokens} tokens ({s.target_tokens} trained), "
            f"{self.it.batches_per_epoch} micro-batches per epoch{' per rank' if world.distributed else ''}, "
            f"{self.steps} steps of {self.accum} micro-batch(es){ranks}; "
            f"bad rows skipped: {s.bad_rows}, truncated: {s.truncated}",
            file=self.stream,
        )
        if world.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            save_resolved(cfg, self.out)

    def _prepare_context(self) -> PrepareContext:
        cfg = self.cfg
        datasets = [self.data] + ([self.eval_data] if self.eval_data is not None else [])
        return PrepareContext(
            algo_config=cfg.algo_config,
            model=cfg.model,
            out=self.out,
            precision=cfg.precision,
            micro_batch_tokens=cfg.engine.micro_batch_tokens,
            datasets=datasets,
            world=self.world,
            stream=self.stream,
            base=cfg.lora.base if cfg.lora is not None else None,
        )

    def load_model(self) -> None:
        """The policy on this rank's device (fp32 masters; LoRA: a frozen base), its engine and loss."""
        cfg = self.cfg
        self.model, self.device = place_policy(cfg, self.world)
        self.engine = TrainEngine(
            self.model, cfg.optim, cfg.schedule, cfg.precision, cfg.engine, total_steps=self.steps, world=self.world
        )
        self.loss_fn = self.make_loss(cfg.algo_config)

    def resume(self) -> int:
        """Restore weights, optimizer, RNG and the data position of ``start_point``; the step it is at."""
        path, world = self.start_point, self.world
        if world.distributed or par.is_sharded_checkpoint(path):
            loaded = par.load_any_checkpoint(path, self.model, self.engine, world)
        else:
            loaded = load_checkpoint(path, self.model, self.engine)
        if "iterator" not in loaded.data_state:
            raise CheckpointError(f"{path} has no data position; it was not written by `polyrl train`")
        _restore_position(self.it, self.data, loaded.data_state, world.world_size)
        if self.best is not None:
            self.best.load_state_dict(loaded.data_state.get("best"))
        print(f"resumed from {path} at step {loaded.step}{resume_note(loaded, self.cfg)}", file=self.stream)
        if loaded.step > self.steps:
            raise ConfigError(
                f"the checkpoint is at step {loaded.step}, past this run's {self.steps} steps; raise --max-steps"
            )
        return loaded.step

    def save(self, ckpts: CheckpointManager, step: int) -> None:
        """An atomic checkpoint with the data position (a collective under torchrun)."""
        state = {"iterator": self.it.state_dict(), "stats": self.data.stats.as_dict(), "world_size": self.it.world_size}
        if self.best is not None:
            state["best"] = self.best.state_dict()
        config = self.cfg.to_dict()
        if not self.world.distributed:
            ckpts.save(step, self.model, self.engine, data_state=state, config=config, tokenizer=self.tokenizer)
            return
        par.save_distributed_checkpoint(
            ckpts.root, step, self.model, self.engine, self.world, data_state=state, config=config,
            tokenizer=self.tokenizer,
        )  # fmt: skip
        if self.world.is_main:
            ckpts.prune()
        self.world.barrier()

    def export_best(self, folder: Path) -> Path | None:
        """The model now as ``folder`` for ``train.keep_best``: the same folder as the final export."""
        path = export_model(self.model, self.world, folder, self.tokenizer)
        if path is not None and self.spec.finalize is not None:
            path = self.spec.finalize(path, self.tokenizer)
        return path

    def evaluate(self) -> dict[str, Any]:
        """The eval record of the model as it is now (``train.eval_every`` / ``eval_before_train``): ``eval_loss`` and
        ``eval_<metric>`` for each metric of the loss (``evaluate_held_out``)."""
        return evaluate_held_out(self.model, self.eval_data, self.loss_fn, self.spec, self.cfg.algo_config, self.device)

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches; the metrics record."""
        cfg, spec = self.cfg, self.spec
        micro = [next(self.it) for _ in range(self.accum)]
        norm = spec.normalizer(cfg.algo_config, micro) if spec.normalizer else None
        if norm is not None and self.world.distributed:
            norm = self.world.sum_float(norm)  # the spec counts this rank's share; the step divides by the global
        rec = self.engine.step(micro, self.loss_fn, norm).to_dict()
        rec["epoch"] = self.it.epoch + self.it.position / max(1, self.it.batches_per_epoch)
        if self.eval_data is not None and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == self.steps):
            rec.update(self.evaluate())
        return rec

    def train(self) -> dict[str, Any]:
        """The loop from ``start`` to the last step, the final checkpoint and model; the summary."""
        cfg, world = self.cfg, self.world
        ckpts = open_checkpoints(self.out, cfg, world)
        series = ("loss", "lr", "grad_norm", *(("eval_loss",) if self.eval_data is not None else ()))
        log = open_metrics(cfg, self.out, world, self.steps, self.start, (*series, *self.spec.plot_series), self.stream)
        with StopSignal() as stop:  # held across the loop and the finish: a signal lets a finishing run end
            try:
                before = self.evaluate if cfg.train.eval_before_train else None
                save = lambda step: self.save(ckpts, step)  # noqa: E731
                run_steps(self.start, self.steps, self.step, log, ckpts, save, before=before, best=self.best,
                          agree=any_rank(world), stop=stop)  # fmt: skip
                final = export_final(cfg, self.model, world, self.tokenizer)
                if final is not None and self.spec.finalize is not None and world.is_main:
                    final = self.spec.finalize(final, self.tokenizer)  # rm: a sequence-classification folder
            except BaseException as exc:
                if log is not None:
                    log.close(extra={"status": end_status(exc)}, print_table=False)
                raise
            if log is None:
                return {"status": "finished", "rank": world.rank}
            extra = {
                "algo": cfg.algo,
                "status": "finished",
                "resumed_from_step": self.start,
                "world_size": world.world_size,
                "wall_time_s": time.perf_counter() - self.t_start,
                **_data_summary(self.data.stats),
                "final_model": str(final) if final is not None else None,
                **(self.best.summary() if self.best is not None else {}),
            }
            summary = log.close(extra=extra)
            out = self.out
            plot = f"  plot: {log.plot}" if log.plot is not None else ""
            print(f"final model: {final}  metrics: {out / 'metrics.jsonl'}{plot}", file=self.stream)
            return summary


def run_offline(cfg: RunConfig, stream: TextIO | None = None) -> dict[str, Any]:
    """The offline training run described in the module docstring; returns the summary dict (rank 0's
    under torchrun; the other ranks print nothing and return ``{"status": ...}``)."""
    world = par.init_world()
    try:
        return OfflineRun(cfg, stream, world).train()
    finally:
        par.destroy_world(world)
