"""Where rows come from: a data spec string -> raw row dicts, each with its file and row number.

Specs: a local ``.jsonl`` / ``.json`` (a list, or ``{"data": [...]}``) / ``.parquet`` file; a glob of such
files (``data/*.jsonl``, read in sorted order); a local directory (saved with ``datasets``' ``save_to_disk``, or
holding such files); a Hugging Face ``load_dataset`` name with optional ``name:config`` (``hf:`` prefix optional);
``builtin:<name>?k=v``. A folder, a datasets name or a builtin may end in ``@split`` (a single file or a glob has
none: ``@train`` is accepted, another split is an error). A spec that can only be a local path (``./``, ``/``, a
trailing ``/``, a data-file suffix such as ``.csv``) and is not on disk is an error, never a hub lookup.
Rows are loaded into memory (no streaming). This module does not interpret row keys (see ``formats.py``);
unreadable rows (invalid JSON, a JSONL line that is not UTF-8) are yielded with an ``error`` so the caller can
raise or skip them in one place. Text files are UTF-8; a leading byte-order mark is accepted.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.data import builtin
from polyrl.errors import DataError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# suffixes of data files polyrl does not read (named in the error), which also mark a spec as a local path
_OTHER_SUFFIXES = (".csv", ".tsv", ".txt", ".arrow", ".gz", ".zst", ".bz2", ".xz", ".zip", ".xlsx", ".ndjson")
_LOCAL_SUFFIXES = FILE_SUFFIXES + _OTHER_SUFFIXES
_SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


@dataclass
class RawRow:
    """One row: ``data`` (None when unreadable, then ``error`` says why), ``source`` and 1-based ``row``."""

    data: dict[str, Any] | None
    source: str
    row: int
    unit: str = "row"  # "line" for JSONL, "item" for JSON lists
    error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.source}: {self.unit} {self.row}"


def split_spec(spec: str) -> tuple[str, str | None]:
    """Separate a trailing ``@split`` unless the whole spec is an existing path."""
    if os.path.exists(spec) or "@" not in spec:
        return spec, None
    body, split = spec.rsplit("@", 1)
    return body, split or None


def iter_rows(spec: str, split: str | None = None) -> Iterator[RawRow]:
    """Rows of ``spec``. ``split`` overrides a ``@split`` in the spec."""
    if spec.startswith("builtin:"):
        label = spec.split("@", 1)[0]
        for i, row in enumerate(builtin.generate(spec, split=split), start=1):
            yield RawRow(row, label, i)
        return
    body, spec_split = split_spec(spec)
    split = split or spec_split
    path = Path(body).expanduser()
    if path.is_file():
        _no_split(body, split)
        yield from _iter_file(path)
    elif path.is_dir():
        yield from _iter_dir(path, split)
    elif is_glob(body):
        _no_split(body, split)
        for f in glob_files(body):
            yield from _iter_file(f)
    elif looks_local(body):
        raise DataError(f"data file {body!r} does not exist; check the path (relative paths are from {os.getcwd()})")
    else:
        yield from _iter_hub(body.removeprefix("hf:"), split)


def looks_local(body: str) -> bool:
    """A spec that can only mean a local path (never a hub name): absolute, relative with ./ or ~, a trailing
    slash, or a data file suffix (``.jsonl``, ``.csv``, ``.txt``, ...)."""
    return body.startswith(("/", "./", "../", "~")) or body.endswith("/") or body.lower().endswith(_LOCAL_SUFFIXES)


def is_glob(body: str) -> bool:
    return any(c in body for c in "*?[")


def glob_files(pattern: str) -> list[Path]:
    """The data files a glob matches, sorted (so rows come in the same order on every run)."""
    found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    files = [p for p in found if p.is_file() and p.suffix.lower() in FILE_SUFFIXES]
    if not files:
        others = f" (it matches {len(found)} other path(s))" if found else ""
        raise DataError(
            f"data pattern {pattern!r} matches no {', '.join(FILE_SUFFIXES)} file{others}; check the pattern "
            f"(relative paths are from {os.getcwd()})"
        )
    return files


def _no_split(body: str, split: str | None) -> None:
    if split not in (None, "train"):
        raise DataError(
            f"{body} has no splits, so @{split} cannot pick one; remove it, hold rows out with data.holdout, or give a "
            "folder of files named after their split (train.jsonl, test.jsonl)"
        )


def _iter_file(path: Path) -> Iterator[RawRow]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif suffix == ".json":
        yield from _iter_json(path)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise DataError(
            f"{path}: unsupported file type {suffix!r}; use one of {', '.join(FILE_SUFFIXES)} (convert it, e.g. "
            "pandas.read_csv(...).to_json('data.jsonl', orient='records', lines=True), or save it with datasets' "
            "save_to_disk)"
        )


def _not_utf8(raw: bytes, exc: UnicodeDecodeError, offset: int) -> str:
    """The problem of undecodable ``raw`` (starting at byte ``offset`` of its file)."""
    return (
        f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte offset {offset + exc.start}); re-save the file as UTF-8"
    )


def _iter_jsonl(path: Path) -> Iterator[RawRow]:
    """Lines read as bytes and decoded one by one, so a line that is not UTF-8 is a bad row like any other."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8) :], start + len(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRow(None, str(path), lineno, "line", _not_utf8(raw, exc, start))
                continue
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                yield RawRow(None, str(path), lineno, "line", f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            yield _checked(data, str(path), lineno, "line")


def _iter_json(path: Path) -> Iterator[RawRow]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark is dropped
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: {_not_utf8(raw, exc, 0)}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f'{path}: a .json dataset must be a list of objects or {{"data": [...]}}')
    for i, item in enumerate(data, start=1):
        yield _checked(item, str(path), i, "item")


def _checked(data: Any, source: str, row: int, unit: str) -> RawRow:
    if not isinstance(data, dict):
        return RawRow(None, source, row, unit, f"expected a JSON object, got {type(data).__name__}")
    return RawRow(data, source, row, unit)


def _iter_parquet(path: Path) -> Iterator[RawRow]:
    try:
        # lazy: pyarrow is optional (the data extra), needed only for Parquet files
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow; install it with `pip install -e '.[data]'` in the polyrl clone"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read Parquet file ({exc})") from None
    for i, data in enumerate(table.to_pylist(), start=1):
        yield RawRow(data, str(path), i)


def _iter_dir(path: Path, split: str | None) -> Iterator[RawRow]:
    if any((path / m).exists() for m in _SAVED_MARKERS):
        yield from _iter_saved(path, split)
        return
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
    if split is not None:
        files = [
            p for p in files if p.stem == split or p.stem.startswith(f"{split}-") or p.stem.startswith(f"{split}_")
        ]
    if not files:
        raise DataError(
            f"{path}: no dataset found (expected a `save_to_disk` folder or {', '.join(FILE_SUFFIXES)} files"
            + (f" named after split {split!r})" if split else ")")
        )
    for f in files:
        yield from _iter_file(f)


def _import_datasets(what: str):
    try:
        # lazy: datasets is optional (the data extra) and slow to import
        import datasets
    except ImportError:
        raise DataError(
            f"{what} needs the Hugging Face `datasets` package; install it with `pip install -e '.[data]'` in the "
            "polyrl clone"
        ) from None
    return datasets


def _iter_dataset(ds: Any, source: str) -> Iterator[RawRow]:
    for i, data in enumerate(ds, start=1):
        yield RawRow(dict(data), source, i)


def _pick_split(dd: Any, split: str | None, source: str) -> Any:
    available = list(dd.keys())
    chosen = split or ("train" if "train" in available else available[0] if len(available) == 1 else None)
    if chosen not in available:
        raise DataError(f"{source}: split {chosen!r} not found; available splits: {', '.join(available)} (add @SPLIT)")
    return dd[chosen]


def _iter_saved(path: Path, split: str | None) -> Iterator[RawRow]:
    datasets = _import_datasets(f"loading the saved dataset {path}")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(f"{path}: cannot load the saved dataset ({exc})") from None
    if hasattr(ds, "keys"):  # DatasetDict
        ds = _pick_split(ds, split, str(path))
    elif split is not None and split != "train":
        raise DataError(f"{path}: this saved dataset has a single split; remove @{split}")
    yield from _iter_dataset(ds, str(path))


def _iter_hub(name: str, split: str | None) -> Iterator[RawRow]:
    datasets = _import_datasets(f"loading {name!r} from the Hugging Face hub")
    repo, _, config = name.partition(":")
    try:
        loaded = datasets.load_dataset(repo, config or None, split=split)
    except Exception as exc:
        raise DataError(
            f"cannot load dataset {name!r} ({type(exc).__name__}: {exc}); check the name (use NAME:CONFIG for a "
            "config), your network, or pass a local file / save_to_disk folder"
        ) from None
    ds = _pick_split(loaded, split, name) if hasattr(loaded, "keys") else loaded
    yield from _iter_dataset(ds, name)
