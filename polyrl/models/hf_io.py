"""File-level I/O of Hugging Face folders, shared by full checkpoints (``checkpoint.py``) and PEFT adapter folders
(``lora/peft_io.py``, ``lora/multi.py``).

``open_safetensors`` opens a safetensors file for lazy reads, with every failure turned into a ``CheckpointError``
naming the file; ``read_safetensors_folder`` reads every ``*.safetensors`` file of a small folder at once (a value or
reward model); ``write_safetensors`` writes one (metadata ``format = pt``, as transformers and PEFT write);
``write_json`` writes an indented JSON file; ``save_tokenizer`` puts a tokenizer into a folder (an object with
``save_pretrained``, or a folder whose ``TOKENIZER_FILES`` are copied); ``make_temp_dir`` creates the hidden
temporary folder next to a target that an atomic write fills before renaming it into place; ``replace_dir`` does that
rename (an existing target moved aside first); ``folder_write_error`` words a write that failed (a full disk).

Not here: what goes into a folder (tensor names, config.json fields: the callers), pickled weights (never read).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from polyrl.errors import CheckpointError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
)


class SafetensorsFile:
    """A safetensors file opened for lazy reads, with every failure turned into a CheckpointError naming it."""

    def __init__(self, file: Path, device: str = "cpu") -> None:
        self.file = file
        try:
            self._f = safe_open(str(file), framework="pt", device=device)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types and OSError
            raise CheckpointError(
                f"cannot read {file}: {exc}; the file is corrupted or truncated, re-download or re-save it"
            ) from None

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read tensor {name!r} from {self.file}: {exc}") from None


def open_safetensors(file: Path, device: str = "cpu") -> SafetensorsFile:
    return SafetensorsFile(file, device)


def read_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``folder``, on the CPU; a ``CheckpointError`` when there is
    none."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder}; give a model folder saved by polyrl or HF")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    save_file(tensors, str(file), metadata={"format": "pt"})


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, or copy the tokenizer files of the folder ``tokenizer`` names."""
    if isinstance(tokenizer, (str, Path)):
        src = Path(tokenizer)
        copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        if not copied:
            raise CheckpointError(f"no tokenizer files in {src} to copy (expected tokenizer.json or similar)")
        for f in copied:
            shutil.copyfile(src / f, folder / f)
        return
    tokenizer.save_pretrained(str(folder))


def make_temp_dir(out: Path) -> Path:
    """A new hidden folder next to ``out`` (same file system, so the final rename is atomic)."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an existing ``out`` is renamed aside first and removed only after."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Write a model folder atomically: yields a temporary folder beside ``out`` (its parents made first: making the
    folders is a write too, where a full disk or a file on the path fails), which replaces ``out`` when the block
    ends. On any failure the temporary folder is removed and ``out`` is left as it was; an OSError becomes
    ``folder_write_error``'s CheckpointError."""
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(out)
        yield tmp
        replace_dir(tmp, out)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise folder_write_error(out, exc) from exc
        raise


def folder_write_error(out: Path, exc: OSError) -> CheckpointError:
    """The error of a model folder that could not be written (a full disk, a read-only folder): what failed, and that
    nothing was left half-written (the write went to a temp folder, removed)."""
    why = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    file = next((p for p in out.parents if _probe(p.is_file)), None)
    if file is not None:  # --out under a file: mkdir says only "File exists" / "Not a directory"
        why = f"{file} is a file, not a folder"
    was = "its previous contents are intact" if _probe(out.exists) else "nothing was written there"
    return CheckpointError(
        f"could not write the model folder {out}: {why}; {was}; free disk space or choose another folder"
    )


def _probe(check: Any) -> bool:
    """``check()`` (``Path.exists`` / ``is_file``), False where the probe itself fails (a folder that cannot be
    entered raises PermissionError)."""
    try:
        return bool(check())
    except OSError:
        return False
