"""``DataConfig``: what data to read and how to turn it into packed batches, validated on construction.

The train CLI composes it into its run config (TOML table ``[data]`` or flags). Validation here is cheap and
happens before any model or tokenizer is loaded: value ranges, known names, builtin parameters, and that a local
file exists. Reading the data is ``dataset.py``'s job.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from polyrl.data import builtin
from polyrl.data.chat import LOSS_POLICIES
from polyrl.data.formats import FORMATS
from polyrl.data.packing import PACKING_METHODS
from polyrl.data.sources import glob_files, is_glob, looks_local, split_spec
from polyrl.errors import ConfigError, DataError, did_you_mean

TRUNCATION_POLICIES = ("right", "drop")


@dataclass
class DataConfig:
    """Dataset spec and pipeline settings. ``path`` is a data spec (see ``polyrl.data.sources``)."""

    path: str = ""
    format: str = "auto"  # auto | one of formats.FORMATS
    split: str | None = None  # overrides a spec's @split
    max_seq_len: int = 2048
    # right: keep the start (a row whose targets all lie past the cut is dropped); drop: skip long rows (both counted)
    truncation: str = "right"
    loss_on: str = "assistant"  # assistant | last_assistant | all
    packing: str = "ffd"  # ffd | greedy (into micro-batches of ``engine.micro_batch_tokens``, the run's budget)
    # pad every micro-batch to micro_batch_tokens tokens and a fixed sequence count, so that shapes repeat and the
    # training step replays as a CUDA graph (engine.cuda_graphs); costs the padding's compute (ffd fills most of it)
    fixed_shapes: bool = False
    shuffle: bool = True
    seed: int = 0
    skip_bad_rows: bool = False
    limit: int | None = None  # use only the first N rows
    holdout: float = 0.0  # fraction of rows held out as the test part (seeded); builtin data uses @test instead
    chat_template: str | None = None  # Jinja template text or a path to a template file
    system_prompt: str | None = None  # added to conversations that have no system message

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        if isinstance(self.path, os.PathLike):
            self.path = os.fspath(self.path)
        self._check_types()
        need(
            self.format == "auto" or self.format in FORMATS,
            f"data.format={self.format!r}: use auto or one of {', '.join(FORMATS)}",
        )
        need(self.truncation in TRUNCATION_POLICIES, f"data.truncation={self.truncation!r}: use 'right' or 'drop'")
        need(self.loss_on in LOSS_POLICIES, f"data.loss_on={self.loss_on!r}: use one of {', '.join(LOSS_POLICIES)}")
        need(self.packing in PACKING_METHODS, f"data.packing={self.packing!r}: use one of {', '.join(PACKING_METHODS)}")
        need(
            isinstance(self.max_seq_len, int) and self.max_seq_len >= 2,
            f"data.max_seq_len={self.max_seq_len!r}: use an integer >= 2",
        )
        need(
            self.limit is None or self.limit >= 1,
            f"data.limit={self.limit}: use a positive row count or leave it unset",
        )
        need(0.0 <= self.holdout < 1.0, f"data.holdout={self.holdout}: use a fraction in [0, 1), e.g. 0.05")
        if self.path:
            self._check_path()

    def _check_types(self) -> None:
        """A value of the wrong type (``limit="5"`` from code, a TOML string) named before any comparison."""
        text, flag, number = ((str,), "a string"), ((bool,), "true or false"), ((int, float), "a number")
        optional_text = ((str, type(None)), "a string or unset")
        kinds = {
            "path": text,
            "split": optional_text,
            "seed": ((int,), "an integer"),
            "limit": ((int, type(None)), "an integer or unset"),
            "holdout": number,
            "chat_template": optional_text,
            "system_prompt": optional_text,
            **{name: flag for name in ("fixed_shapes", "shuffle", "skip_bad_rows")},
        }
        for name, (ok, want) in kinds.items():
            value = getattr(self, name)
            if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
                raise ConfigError(f"data.{name}={value!r}: use {want} (got {type(value).__name__})")

    def _check_path(self) -> None:
        if self.path.startswith("builtin:"):
            name, params, spec_split = builtin.parse_spec(self.path)
            builtin._resolve(name, params)
            return
        body, _ = split_spec(self.path)
        if os.path.exists(os.path.expanduser(body)):
            return
        if is_glob(body):
            try:
                glob_files(body)
            except DataError as exc:
                raise ConfigError(str(exc)) from None
        elif looks_local(body):
            raise ConfigError(f"data file {body!r} does not exist; check data.path / --data")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            hint = did_you_mean(unknown, known)
            raise ConfigError(f"unknown data setting(s) {unknown}{hint}; known: {', '.join(sorted(known))}")
        return cls(**data)


def max_sequence_len(cfg: DataConfig, micro_batch_tokens: int) -> int:
    """Longest single sequence: no more than ``max_seq_len`` and the packing budget."""
    return min(cfg.max_seq_len, micro_batch_tokens)
