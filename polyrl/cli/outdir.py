"""The ``--out`` of commands that replace their output folder whole (``init-model``, ``export``): refused when it holds
something other than a model, such as a run directory (``--out runs/sft`` for ``runs/sft/final``), which the
replacement would delete, and when it cannot be made (a file on its path), before any model loads."""

from __future__ import annotations

from pathlib import Path

from polyrl.errors import UserError
from polyrl.run.config import nearest_existing


def check_replaceable(out: str | Path, command: str) -> None:
    """A UserError unless ``out`` is new, an empty folder, or a model folder (config.json or adapter_config.json)."""
    out = Path(out)
    existing, _ = nearest_existing(out.absolute())
    if not existing.is_dir():  # a file there: the write would fail only after the model loaded (and merged)
        where = "is a file" if existing == out.absolute() else f"cannot be made: {existing} is a file, not a folder"
        raise UserError(f"--out {str(out)!r} {where}; give a folder")
    if not out.is_dir() or any((out / f).is_file() for f in ("config.json", "adapter_config.json")):
        return
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    raise UserError(
        f"--out {str(out)!r} already holds files that are not a model ({', '.join(names[:5])}); {command} replaces "
        "its --out folder, so give a new or empty folder (or remove this one yourself)"
    )
