"""The ``--out`` of commands that replace their output folder whole (``init-model``, ``export``): refused when it holds
something other than a model, such as a run directory (``--out runs/sft`` for ``runs/sft/final``), which the
replacement would delete."""

from __future__ import annotations

from pathlib import Path

from polyrl.errors import UserError


def check_replaceable(out: str | Path, command: str) -> None:
    """A UserError unless ``out`` is new, an empty folder, or a model folder (config.json or adapter_config.json)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; give a folder")
    if not out.is_dir() or any((out / f).is_file() for f in ("config.json", "adapter_config.json")):
        return
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    raise UserError(
        f"--out {str(out)!r} already holds files that are not a model ({', '.join(names[:5])}); {command} replaces "
        "its --out folder, so give a new or empty folder (or remove this one yourself)"
    )
