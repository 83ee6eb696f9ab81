"""Checkpoints of data-parallel runs that resume at any world size: sharded ones (torch.distributed.checkpoint)
for FSDP2 models, replicated ones for models every rank holds whole (LoRA), and the one-folder export of both.

A sharded checkpoint is a directory ``<root>/step-00000042/`` in the same place and with the same
bookkeeping files as ``polyrl.train.checkpoint`` (``trainer_state.json``, ``config.json``,
``manifest.json`` written last, atomic rename), but the tensors live in ``sharded/`` (DCP: each rank
writes its own shards, ``.metadata`` maps them to global tensors) and each rank's RNG in
``rng/rank-NNNNN.pt``. Tensors are stored under flat keys: ``model/<HF name>`` (the fp32 masters) and
``optim/exp_avg/<name>``, ``optim/exp_avg_sq/<name>``, ``optim/step/<name>``. DCP reshards on load, so
a checkpoint written by 2 ranks loads into 4, or into one plain (unsharded) process; the other way,
``load_full_checkpoint`` puts a one-process checkpoint into a sharded model. Every rank must call the
save/load functions (collectives inside); the directory must be on a filesystem all ranks share.

A replicated checkpoint (``save_replicated_checkpoint``, a ``replicate_model`` model: every rank holds the same
weights and optimizer state) is the one-process layout of ``polyrl.train.checkpoint`` written by rank 0 (for LoRA:
``model/`` is the PEFT adapter folder, ``optimizer.safetensors`` the adapters' masters and moments, ``rng.pt``
rank 0's RNG), plus what differs by rank, ``rng/rank-NNNNN.pt``, and ``world_size`` / ``replicated`` in the
manifest. It loads in one plain process as it is and on any number of ranks (``load_any_checkpoint``: each rank
restores its own RNG, rank 0's where the writer had fewer ranks). ``save_distributed_checkpoint`` picks the kind.

Not here: when to save (``CheckpointManager.should_save``), what the data position means (the caller
converts it with ``convert_position``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from polyrl.errors import CheckpointError
from polyrl.models.checkpoint import save_model
from polyrl.platform import device
from polyrl.train.checkpoint import (
    _TMP_PREFIX,
    FORMAT,
    VERSION,
    LoadedCheckpoint,
    _commit,
    _fsync_tree,
    _plain,
    _read_manifest,
    _rng_from_saved,
    _rng_to_saveable,
    _write_json,
    load_checkpoint,
    step_dir_name,
    write_checkpoint_files,
)
from polyrl.train.parallel.fsdp import full_tensors, is_dtensor, is_sharded
from polyrl.train.parallel.replicate import is_replicated
from polyrl.train.parallel.world import World

SHARDED_DIR = "sharded"
RNG_DIR = "rng"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / SHARDED_DIR).is_dir()


# ---- the tensors of a checkpoint ----------------------------------------------------------------
def _model_entries(model: nn.Module, engine: Any | None) -> dict[str, torch.Tensor]:
    """``model/<name>`` -> the tensor to save into / load into: the fp32 master where the optimizer keeps
    a separate one, else the parameter or buffer itself. Tied aliases appear once (first name)."""
    masters = dict(zip(engine.optimizer.names, engine.optimizer.masters)) if engine is not None else {}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[f"model/{name}"] = masters.get(name, t).detach()
    return out


def _optim_entries(engine: Any) -> dict[str, torch.Tensor]:
    return {f"optim/{k}": v for k, v in engine.optimizer.state_dict().items() if not k.startswith("master/")}


def _optim_targets(engine: Any, available: set[str]) -> dict[str, torch.Tensor]:
    """Empty tensors shaped (and sharded) like each master, for the moments the checkpoint has."""
    out: dict[str, torch.Tensor] = {}
    for name, m in zip(engine.optimizer.names, engine.optimizer.masters):
        if f"optim/exp_avg/{name}" not in available:
            continue
        out[f"optim/exp_avg/{name}"] = torch.zeros_like(m, dtype=torch.float32)
        out[f"optim/exp_avg_sq/{name}"] = torch.zeros_like(m, dtype=torch.float32)
        out[f"optim/step/{name}"] = torch.zeros((), dtype=torch.float32)
    return out


def _load_optimizer(engine: Any, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Hand the loaded moments (and the masters, already filled in place) to ``MasterAdamW``."""
    flat = {k[len("optim/") :]: v for k, v in tensors.items() if k.startswith("optim/")}
    opt = engine.optimizer
    for name, p, m in zip(opt.names, opt.params, opt.masters):
        if m is not p:
            flat[f"master/{name}"] = m
    try:
        opt.load_state_dict(flat)
    except KeyError as exc:
        raise CheckpointError(f"{path}: optimizer state does not match this model: {exc.args[0]}") from exc


# ---- saving -------------------------------------------------------------------------------------
def save_sharded_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    engine: Any | None,
    world: World,
    *,
    data_state: dict[str, Any] | None = None,
    config: Any = None,
) -> Path:
    """Write the checkpoint of ``step`` under ``root`` from every rank (collective) and return its path.
    ``data_state`` is rank 0's; ``world_size`` is recorded so a resume at another size can convert it."""
    # lazy: torch.distributed.checkpoint takes ~2 s to import; only sharded checkpoints use it
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{final.name}-sharded"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / RNG_DIR).mkdir(parents=True)
    world.barrier()
    tensors = _model_entries(model, engine)
    if engine is not None:
        tensors.update(_optim_entries(engine))
    dcp.save(tensors, checkpoint_id=str(tmp / SHARDED_DIR), no_dist=not world.distributed)
    torch.save(_rng_to_saveable(device.get_rng_state()), tmp / RNG_DIR / f"rank-{world.rank:05d}.pt")
    world.barrier()
    if world.is_main:
        state = {
            "step": step,
            "engine": engine.state_dict() if engine is not None else None,
            "data": data_state or {},
            "world_size": world.world_size,
        }
        _write_json(tmp / "trainer_state.json", state)
        _write_json(tmp / "config.json", _plain(config) if config is not None else {})
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "created": time.time(),
            "sharded": True,
            "world_size": world.world_size,
            "files": files,
        }
        _write_json(tmp / "manifest.json", manifest)
        _fsync_tree(tmp)
        _commit(tmp, final)
    world.barrier()
    return final


def save_replicated_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    engine: Any | None,
    world: World,
    *,
    data_state: dict[str, Any] | None = None,
    config: Any = None,
    tokenizer: Any = None,
) -> Path:
    """Write the checkpoint of ``step`` of a replicated model (see the module docstring) and return its path: every
    rank writes its RNG, rank 0 the rest (the same on every rank), then publishes it with one rename. Collective."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{final.name}-replicated"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / RNG_DIR).mkdir(parents=True)
    world.barrier()
    torch.save(_rng_to_saveable(device.get_rng_state()), tmp / RNG_DIR / f"rank-{world.rank:05d}.pt")
    world.barrier()
    if world.is_main:
        extra = {"world_size": world.world_size, "replicated": True}
        write_checkpoint_files(
            tmp, step, model, engine, data_state=data_state, config=config, tokenizer=tokenizer, manifest_extra=extra
        )
        _commit(tmp, final)
    world.barrier()
    return final


def save_distributed_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    engine: Any | None,
    world: World,
    *,
    data_state: dict[str, Any] | None = None,
    config: Any = None,
    tokenizer: Any = None,
) -> Path:
    """The checkpoint of a data-parallel run: replicated for a ``replicate_model`` model, else sharded."""
    if is_replicated(model):
        return save_replicated_checkpoint(
            root, step, model, engine, world, data_state=data_state, config=config, tokenizer=tokenizer
        )
    return save_sharded_checkpoint(root, step, model, engine, world, data_state=data_state, config=config)


# ---- loading ------------------------------------------------------------------------------------
def load_sharded_checkpoint(
    path: str | Path,
    model: nn.Module,
    engine: Any | None = None,
    world: World | None = None,
    *,
    restore_rng: bool = True,
) -> LoadedCheckpoint:
    """Load a sharded checkpoint into ``model`` (sharded at any world size, or plain in one process) and
    ``engine`` (masters, moments, counters), in place. Every rank calls it."""
    # lazy: torch.distributed.checkpoint takes ~2 s to import; only sharded checkpoints use it
    import torch.distributed.checkpoint as dcp

    world = world or World()
    path = Path(path)
    manifest = _read_manifest(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {SHARDED_DIR}/); use load_full_checkpoint")
    state = json.loads((path / "trainer_state.json").read_text())
    config = json.loads((path / "config.json").read_text())
    available = set(dcp.FileSystemReader(str(path / SHARDED_DIR)).read_metadata().state_dict_metadata)
    targets = _model_entries(model, engine)
    missing = sorted(k[len("model/") :] for k in targets if k not in available)
    if missing:
        raise CheckpointError(f"{path} does not match this model: missing weights {missing[:5]}")
    if engine is not None:
        if state.get("engine") is None:
            raise CheckpointError(f"{path} holds weights only (no optimizer state); it cannot resume training")
        targets.update(_optim_targets(engine, available))
    dcp.load(targets, checkpoint_id=str(path / SHARDED_DIR), no_dist=not world.distributed)
    if engine is not None:
        _load_optimizer(engine, targets, path)
        engine.load_state_dict(state["engine"])
    if restore_rng:
        _restore_rng(path, world)
    return LoadedCheckpoint(
        path, int(state["step"]), state.get("data", {}), config, state.get("engine") or {}, manifest
    )


def _restore_rng(path: Path, world: World) -> None:
    own = path / RNG_DIR / f"rank-{world.rank:05d}.pt"
    src = own if own.is_file() else path / RNG_DIR / "rank-00000.pt"
    if not src.is_file():
        src = path / "rng.pt"  # a one-process checkpoint
    device.set_rng_state(_rng_from_saved(torch.load(src, weights_only=True)))


def _distribute_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` as a tensor laid out like ``like`` (the same DTensor sharding, or plain)."""
    full = full.to(device=_local_device(like), dtype=like.dtype)
    if not is_dtensor(like):
        return full
    # lazy: torch.distributed.tensor takes ~1 s to import; only DTensor targets get here
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, list(like.placements))


def _local_device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if is_dtensor(t) else t.device


def load_full_checkpoint(
    path: str | Path, model: nn.Module, engine: Any | None = None, world: World | None = None
) -> LoadedCheckpoint:
    """Load a one-process (``polyrl.train.checkpoint``) or replicated checkpoint into a sharded ``model`` /
    ``engine`` (every rank reads the full tensors and keeps its shard; fp32 masters win over the maybe bf16 model
    folder) or into a plain / replicated one (every rank loads it whole and restores its own RNG). Every rank
    calls it."""
    world = world or World()
    path = Path(path)
    if not is_dtensor(next(model.parameters())):
        loaded = load_checkpoint(path, model, engine)
        if world.distributed:
            _restore_rng(path, world)
        return loaded
    loaded = load_checkpoint(path, None, None)  # manifest, state, config and the RNG
    weights: dict[str, torch.Tensor] = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    optim = load_file(str(path / "optimizer.safetensors")) if engine is not None else {}
    if engine is not None and not optim:
        raise CheckpointError(f"{path} holds weights only (no optimizer state); it cannot resume training")
    flat: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in _model_entries(model, engine).items():
            name = name[len("model/") :]
            full = optim.get(f"master/{name}", weights.get(name))
            if full is None:
                raise CheckpointError(f"{path} does not match this model: no weight {name}")
            _local(t).copy_(_local(_distribute_like(full, t)))
        if engine is not None:
            for name, m in zip(engine.optimizer.names, engine.optimizer.masters):
                for key in ("exp_avg", "exp_avg_sq"):
                    if f"{key}/{name}" in optim:
                        flat[f"optim/{key}/{name}"] = _distribute_like(optim[f"{key}/{name}"], m)
                if f"step/{name}" in optim:
                    flat[f"optim/step/{name}"] = optim[f"step/{name}"]
    if engine is not None:
        _load_optimizer(engine, flat, path)
        engine.load_state_dict(loaded.engine_state)
    return loaded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def load_any_checkpoint(
    path: str | Path, model: nn.Module, engine: Any | None = None, world: World | None = None
) -> LoadedCheckpoint:
    """Sharded or one-process checkpoint, into a sharded or plain model: the right loader for the pair."""
    if is_sharded_checkpoint(path):
        return load_sharded_checkpoint(path, model, engine, world)
    return load_full_checkpoint(path, model, engine, world)


def saved_world_size(loaded: LoadedCheckpoint) -> int:
    """World size that wrote a checkpoint (1 for one-process checkpoints)."""
    return int(loaded.manifest.get("world_size", 1))


def convert_position(epoch: int, position: int, saved_world: int, world: int) -> tuple[int, int]:
    """A data-iterator position written at ``saved_world`` ranks as the position at ``world`` ranks.
    Rank r at position p has consumed the epoch's global batches [0, p * world) (rank-strided), so the
    global count must divide by the new size."""
    consumed = position * saved_world
    if consumed % world:
        raise CheckpointError(
            f"the checkpoint stopped after {consumed} micro-batches of its epoch, which {world} ranks cannot "
            f"split evenly; resume with a world size that divides {consumed} (e.g. {saved_world})"
        )
    return epoch, consumed // world


# ---- export -------------------------------------------------------------------------------------
class _FullWeights:
    """What ``polyrl.models.save_model`` reads from a model: ``config`` and a full ``state_dict``."""

    def __init__(self, config: Any, state: dict[str, torch.Tensor]) -> None:
        self.config = config
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def export_hf(
    model: nn.Module, world: World, out_dir: str | Path, tokenizer: Any = None, dtype: torch.dtype | None = None
) -> Path | None:
    """Gather the full weights (collective) and write ONE HF folder from rank 0 (``save_model``); returns
    the folder on rank 0, None elsewhere. ``dtype`` casts on the way out (default: as trained, fp32). A model
    that is not sharded (replicated: rank 0 holds it whole) is written as it is: a LoRA model as its PEFT
    adapter folder."""
    out = None
    if not is_sharded(model):
        if world.is_main:
            out = save_model(model, out_dir, tokenizer=tokenizer, dtype=dtype)
        world.barrier()
        return out
    state = dict(full_tensors(model, to_cpu=True, keep=world.is_main))
    if world.is_main:
        out = save_model(_FullWeights(model.config, state), out_dir, tokenizer=tokenizer, dtype=dtype)
    world.barrier()
    return out
