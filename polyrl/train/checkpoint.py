"""Training checkpoints: atomic save, keep-last-K, find the latest, load for an exact resume.

A checkpoint is a directory ``<root>/step-00000042/`` holding

- ``model/``: the weights, an HF folder via ``polyrl.models.checkpoint.save_model`` for models that
  have an HF config (a PEFT adapter folder for a LoRA model: the frozen base is not saved), else
  ``model.safetensors`` of the state dict (tied aliases stored once);
- ``optimizer.safetensors``: fp32 masters and AdamW moments by parameter name (``MasterAdamW``);
- ``rng.pt``: python / numpy / torch / device RNG states (tensors, ints and tuples only: loaded with
  ``weights_only=True``);
- ``trainer_state.json``: step, engine counters (skips, loss scale), the caller's opaque data position;
- ``config.json``: the resolved run config the caller passes;
- ``manifest.json``: written last; lists every file and its size. No manifest means not a checkpoint;
  ``checkpoint_problem`` checks a checkpoint against it (sizes, safetensors headers, ``.pt`` CRCs) without
  loading it, so a resume can skip a truncated or corrupted one.

Writes go to ``<root>/.tmp-step-...`` in the same parent, every file and directory is fsynced, then one
``os.rename`` publishes it, so a crash at any point leaves the previous checkpoints loadable; stale
temp directories are removed when a ``CheckpointManager`` starts. A write that fails (a full disk: ``OSError``)
removes its temp directory at once and raises a ``CheckpointError`` naming the step, the OS error and the newest
complete checkpoint, which it leaves as it was. This module does not decide when to
save beyond ``every_n_steps`` nor what the data position means.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from polyrl.errors import CheckpointError
from polyrl.models.checkpoint import save_model
from polyrl.models.config import ModelConfig
from polyrl.models.lora import has_lora, load_adapter
from polyrl.models.moe_layout import Stack, fill, read_plan
from polyrl.platform import device
from polyrl.train.config import CheckpointConfig

try:
    import numpy as np
except ImportError:  # numpy is optional under torch (see polyrl.platform.device); its RNG state is saved only with it
    np = None

FORMAT = "polyrl-checkpoint"
VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` read: ``data_state`` is the caller's opaque data position."""

    path: Path
    step: int
    data_state: dict[str, Any]
    config: dict[str, Any]
    engine_state: dict[str, Any]
    manifest: dict[str, Any]


# ---- writing ------------------------------------------------------------------------------------
def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    engine: Any | None = None,
    *,
    data_state: dict[str, Any] | None = None,
    config: Any = None,
    tokenizer: Any = None,
) -> Path:
    """Atomically write the checkpoint of ``step`` under ``root`` and return its path. ``engine`` is a
    ``TrainEngine`` (optimizer + counters) or None for weights only."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write_checkpoint_files(tmp, step, model, engine, data_state=data_state, config=config, tokenizer=tokenizer)
        _commit(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not keep the half-written copy
        os_error = exc if isinstance(exc, OSError) else exc.__cause__  # save_model's CheckpointError wraps its own
        if isinstance(os_error, OSError):
            raise CheckpointError(_write_failed(final, os_error)) from os_error
        raise
    return final


def _write_failed(final: Path, exc: OSError) -> str:
    """The message of a checkpoint that could not be written (a full disk, a quota, a read-only folder)."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    why = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    kept = [p.name for p in list_checkpoints(final.parent)]
    have = f"the newest complete one, {kept[-1]}, is intact" if kept else "there is no earlier checkpoint"
    fix = "free disk space (or lower --keep-last, or set checkpoint.dir on another disk)" if full else "fix that"
    return (
        f"could not write checkpoint {final.name} in {final.parent}: {why}; its partial copy was removed and {have}; "
        f"{fix}, then continue the run with --resume"
    )


def write_checkpoint_files(
    tmp: Path,
    step: int,
    model: nn.Module,
    engine: Any | None = None,
    *,
    data_state: dict[str, Any] | None = None,
    config: Any = None,
    tokenizer: Any = None,
    manifest_extra: dict[str, Any] | None = None,
) -> None:
    """Write a checkpoint's files into the existing folder ``tmp`` (files already there are kept and listed in
    the manifest, written last) and fsync them; the caller publishes it with ``_commit``."""
    _write_model(tmp / "model", model, tokenizer)
    if engine is not None:
        save_file(_contiguous(engine.optimizer.state_dict()), str(tmp / "optimizer.safetensors"))
    torch.save(_rng_to_saveable(device.get_rng_state()), tmp / "rng.pt")
    state = {"step": step, "engine": engine.state_dict() if engine is not None else None, "data": data_state or {}}
    _write_json(tmp / "trainer_state.json", state)
    _write_json(tmp / "config.json", _plain(config) if config is not None else {})
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "created": time.time(), "files": files}
    _write_json(tmp / "manifest.json", {**manifest, **(manifest_extra or {})})
    _fsync_tree(tmp)


def _commit(tmp: Path, final: Path) -> None:
    """Publish ``tmp`` as ``final`` with one rename (an existing ``final`` is moved aside first)."""
    trash = final.parent / f"{_TRASH_PREFIX}{final.name}"
    if final.exists():
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(final, trash)
    try:
        os.rename(tmp, final)
    except OSError:
        if trash.exists() and not final.exists():
            os.rename(trash, final)  # the checkpoint this one was to replace stays
        raise
    _fsync_dir(final.parent)
    if trash.exists():
        shutil.rmtree(trash)


def _write_model(out: Path, model: nn.Module, tokenizer: Any) -> None:
    if hasattr(getattr(model, "config", None), "to_hf_dict"):
        save_model(model, str(out), tokenizer=tokenizer)
        return
    out.mkdir(parents=True)
    save_file(_contiguous(_dedup_aliases(model.state_dict())), str(out / "model.safetensors"))


def _dedup_aliases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that share storage with an earlier entry (tied weights); safetensors refuses them."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            fd = os.open(os.path.join(dirpath, fn), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rng_to_saveable(state: dict[str, Any]) -> dict[str, Any]:
    out = dict(state)
    if "numpy" in out:
        kind, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return out


def _rng_from_saved(state: dict[str, Any]) -> dict[str, Any]:
    out = dict(state)
    if "numpy" in out:
        kind, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    return out


# ---- finding and cleaning -----------------------------------------------------------------------
def cleanup_stale(root: str | Path) -> list[Path]:
    """Remove temp dirs left by interrupted writes/deletions under ``root``; restore a checkpoint that
    was moved aside by an interrupted overwrite. Returns what was removed."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    restore_moved_aside(root)
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(_TMP_PREFIX) or entry.name.startswith(_TRASH_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)  # a trash folder left here has its checkpoint beside it
            removed.append(entry)
    return removed


def restore_moved_aside(root: str | Path) -> list[Path]:
    """Put back each checkpoint that an interrupted overwrite moved aside (``.trash-step-N`` without ``step-N``: the
    process died between ``_commit``'s two renames), so choosing the checkpoint to resume from sees it. Safe when
    every rank calls it at once: a rename another rank did first is skipped. Returns the restored paths."""
    root = Path(root)
    restored = []
    if not root.is_dir():
        return restored
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(_TRASH_PREFIX):
            continue
        original = root / entry.name[len(_TRASH_PREFIX) :]
        if original.exists():
            continue
        try:
            os.rename(entry, original)
        except FileNotFoundError:  # another rank restored it first
            continue
        restored.append(original)
    return restored


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints (with a manifest) directly under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and (entry / "manifest.json").is_file():
            found.append((int(m.group(1)), entry))
    return [p for _, p in sorted(found)]


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed, or None when it looks complete. Cheap checks, no
    tensor is read: the manifest parses, every file it lists is there with its size, every ``*.safetensors``
    header is whole and matches its file's length, and every ``*.pt`` archive passes its CRC check."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable manifest.json ({exc})"
    files = manifest.get("files", {}) if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "manifest.json lists no files"
    missing = [n for n in files if not (path / n).is_file()]
    if missing:
        return f"missing files: {', '.join(missing[:5])}"
    truncated = [f"{n} ({(path / n).stat().st_size} of {size} bytes)" for n, size in files.items()
                 if (path / n).stat().st_size != size]  # fmt: skip
    if truncated:
        return f"truncated files: {', '.join(truncated[:5])}"
    for name in files:
        problem = _file_problem(path / name)
        if problem:
            return f"corrupted file {name} ({problem})"
    return None


def _file_problem(file: Path) -> str | None:
    """A safetensors header that is not whole JSON or does not end where the file does; a zip (``torch.save``)
    whose CRC fails."""
    if file.suffix == ".safetensors":
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "no safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > file.stat().st_size - 8:
                return "safetensors header longer than the file"
            try:
                header = json.loads(f.read(n))
                end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
                return f"unreadable safetensors header: {exc}"
        if 8 + n + end != file.stat().st_size:
            return "safetensors data does not match its header"
    elif file.suffix == ".pt":
        try:
            with zipfile.ZipFile(file) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError) as exc:
            return str(exc)
        if bad is not None:
            return f"CRC error in {bad}"
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in ``run_dir/checkpoints`` or ``run_dir`` itself, or None."""
    run_dir = Path(run_dir)
    for root in (run_dir / "checkpoints", run_dir):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    return None


class CheckpointManager:
    """Saves every ``cfg.every_n_steps`` and at the end into ``cfg.dir`` (default ``run_dir/checkpoints``),
    keeps the newest ``cfg.keep_last_k``, and cleans stale temp dirs when created."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig | None = None) -> None:
        self.cfg = cfg or CheckpointConfig()
        self.root = Path(self.cfg.dir) if self.cfg.dir else Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.cleaned = cleanup_stale(self.root)

    def should_save(self, step: int, final: bool = False) -> bool:
        if final:
            return self.cfg.save_final
        n = self.cfg.every_n_steps
        return n > 0 and step > 0 and step % n == 0

    def save(self, step: int, model: nn.Module, engine: Any | None = None, **kwargs: Any) -> Path:
        """``save_checkpoint`` into the root, then delete all but the newest ``keep_last_k``."""
        path = save_checkpoint(self.root, step, model, engine, **kwargs)
        self.prune()
        return path

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep_last_k`` complete checkpoints; a broken one (``checkpoint_problem``,
        e.g. after a resume fell back past it) is left alone and never counts, so it cannot crowd out a good one."""
        k = self.cfg.keep_last_k
        found = [p for p in list_checkpoints(self.root) if checkpoint_problem(p) is None]
        doomed = found[:-k] if k > 0 else []
        for path in doomed:
            # Rename first so a crash mid-delete never leaves a half-deleted dir that looks complete.
            tmp = path.parent / f"{_TMP_PREFIX}delete-{path.name}"
            os.rename(path, tmp)
            shutil.rmtree(tmp)
        return doomed

    def latest(self) -> Path | None:
        found = list_checkpoints(self.root)
        return found[-1] if found else None


# ---- loading ------------------------------------------------------------------------------------
def load_checkpoint(
    path: str | Path,
    model: nn.Module | None = None,
    engine: Any | None = None,
    *,
    restore_rng: bool = True,
) -> LoadedCheckpoint:
    """Read the checkpoint at ``path``; load weights into ``model`` and optimizer + counters into
    ``engine`` when given (in place: parameter identity is kept), and restore the RNG states.
    Raises ``CheckpointError`` naming what is missing or mismatched."""
    path = Path(path)
    manifest = _read_manifest(path)
    state = json.loads((path / "trainer_state.json").read_text())
    config = json.loads((path / "config.json").read_text())
    if model is not None:
        try:
            load_model_weights(path / "model", model)
        except CheckpointError as exc:
            saved = config.get("model") if isinstance(config, dict) else None
            if not isinstance(saved, str):
                raise
            raise CheckpointError(f"{exc}; this checkpoint was written by a run of --model {saved}") from None
    if engine is not None:
        if state.get("engine") is None or not (path / "optimizer.safetensors").is_file():
            raise CheckpointError(f"{path} holds weights only (no optimizer state); it cannot resume training")
        try:
            engine.optimizer.load_state_dict(load_file(str(path / "optimizer.safetensors")))
        except KeyError as exc:
            raise CheckpointError(f"{path}/optimizer.safetensors does not match this model: {exc.args[0]}") from exc
        engine.load_state_dict(state["engine"])
    if restore_rng:
        rng = torch.load(path / "rng.pt", weights_only=True)
        device.set_rng_state(_rng_from_saved(rng))
    return LoadedCheckpoint(
        path, int(state["step"]), state.get("data", {}), config, state.get("engine") or {}, manifest
    )


def _read_manifest(path: Path) -> dict[str, Any]:
    mf = path / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(
            f"{path} is not a complete polyrl checkpoint (no manifest.json; the write was interrupted?); "
            f"resume from latest_checkpoint(run_dir) or another step-* directory"
        )
    manifest = json.loads(mf.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mf} is not a polyrl checkpoint manifest (format {manifest.get('format')!r})")
    bad = [
        name
        for name, size in manifest.get("files", {}).items()
        if not (path / name).is_file() or (path / name).stat().st_size != size
    ]
    if bad:
        raise CheckpointError(f"{path} is corrupted: missing or truncated files: {', '.join(bad[:5])}")
    return manifest


def load_model_weights(model_dir: str | Path, model: nn.Module) -> None:
    """Copy every ``*.safetensors`` tensor in ``model_dir`` into ``model``'s parameters/buffers of the same
    name (dtype cast, in place). Names missing from the files are allowed only for tied aliases. An MoE model's
    per-expert tensors (the layout ``save_model`` writes) are assembled into its fused expert parameters."""
    model_dir = Path(model_dir)
    if (model_dir / "adapter_config.json").is_file():  # a LoRA run: the checkpoint holds the adapter only
        if not has_lora(model):
            raise CheckpointError(
                f"{model_dir} holds a LoRA adapter but the model has none; resume with the [lora] table"
            )
        load_adapter(model, model_dir)
        return
    if has_lora(model):
        raise CheckpointError(
            f"{model_dir} holds a whole model's weights (a full fine-tune's checkpoint), but this run trains a LoRA "
            "adapter; resume it without --lora / --qlora / [lora], or start a LoRA run from the fine-tuned model (its "
            "final/ folder) with another --out"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    own = model.state_dict(keep_vars=True)
    # an MoE model's folder holds the hub's per-expert layout (what save_model writes): map it onto the fused names
    cfg = getattr(model, "config", None)
    found = {k: tuple(t.shape) for k, t in tensors.items()}
    shapes, sources = read_plan(found, cfg) if isinstance(cfg, ModelConfig) else (found, {k: k for k in found})
    unexpected = sorted(set(shapes) - set(own))
    loaded_ptrs = {own[n].data_ptr() for n in shapes if n in own}
    missing = sorted(n for n in set(own) - set(shapes) if own[n].data_ptr() not in loaded_ptrs)
    if unexpected or missing:
        raise CheckpointError(
            f"weights in {model_dir} do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, src in sources.items():
            target = own[name]
            if target.shape != shapes[name]:
                raise CheckpointError(f"{name}: checkpoint shape {shapes[name]} != model shape {tuple(target.shape)}")
            if isinstance(src, Stack):
                fill(target, src, tensors.__getitem__)
            else:
                target.copy_(tensors[src])
