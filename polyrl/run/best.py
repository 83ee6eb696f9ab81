"""``train.keep_best``: keep the model of the step whose evaluation was best, as ``<out>/best``.

``BestMetric.parse("eval_loss")`` reads the setting: an eval metric name exactly as the run logs it in
metrics.jsonl (``eval_loss``, ``eval_reward``, ``eval_accuracy``, ``eval_pass@1``, ...), with an optional
``min:`` / ``max:`` prefix for the direction; without one, lower is better for a name containing ``loss`` and higher
for every other name. ``BestKeeper.update(step, record)`` runs after every logged step record (the step-0 record of
``train.eval_before_train`` included): a record that carries the metric with a strictly better finite value than the
best so far writes the current weights with ``export`` (the run's final-export writer, so ``<out>/best`` is the same
kind of folder as ``<out>/final``: an HF folder, or a PEFT adapter folder for LoRA) into a hidden folder next to it,
adds ``best.json`` (``metric``, ``mode``, ``value``, ``step``), and publishes it with one rename (a crash leaves the
previous best whole). ``<out>/best`` lives outside ``checkpoints/``, so ``checkpoint.keep_last_k`` never prunes it.
It is the model a user evaluates or serves (PPO: the policy; the critic is not kept).
An evaluation record (any ``eval_*`` key) without the metric is a ``ConfigError`` naming the metrics it has; a run
that knows its eval metrics before training (``check``: the online runner's own evaluation) raises it at start-up.

The best value so far is resumable state: the runs put ``state_dict()`` into every checkpoint's data state and
``load_state_dict`` it back on resume, so a resumed run never replaces a better best by a worse one. Under torchrun
every rank calls ``update`` with its record (the same on every rank: the offline held-out loss is computed over the
whole eval set on every rank, the online evaluation is gathered and scored by rank 0 and broadcast); rank 0's
decision and value are broadcast, so every rank takes the same branch around the export, which is collective (FSDP2
gathers the shards); rank 0 alone writes the folder and ``best.json``. Tested with 2 gloo ranks for SFT and GRPO,
resume included (tests/distributed/test_keep_best_distributed.py).
Not here: running the evaluation (``polyrl.run.offline`` / ``online``), the export itself (``offline.export_model``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.errors import ConfigError, did_you_mean
from polyrl.models.hf_io import replace_dir

if TYPE_CHECKING:
    from polyrl.train import parallel as par

BEST_DIR = "best"
BEST_JSON = "best.json"
_NEXT = ".best-next"  # the folder being written; published as BEST_DIR by one rename


@dataclass(frozen=True)
class BestMetric:
    """An eval metric and its direction (``mode``: ``min`` or ``max``)."""

    name: str
    mode: str

    @classmethod
    def parse(cls, spec: str) -> BestMetric:
        """``[min:|max:]NAME``; NAME must be an eval metric (``eval_...``)."""
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"train.keep_best must be an eval metric name such as eval_loss, got {spec!r}")
        text = spec.strip()
        mode = None
        head, sep, tail = text.partition(":")
        if sep and head in ("min", "max"):
            mode, text = head, tail.strip()
        if text.startswith("eval/"):  # the eval/... naming of docs and other tools: say the logged name
            raise ConfigError(
                f"train.keep_best {spec!r}: metrics.jsonl logs it as {'eval_' + text[5:]!r}; pass --keep-best "
                f"{(mode + ':') if mode else ''}eval_{text[5:]}"
            )
        if not text.startswith("eval_"):
            raise ConfigError(
                f"train.keep_best {spec!r}: name an eval metric as metrics.jsonl logs it (eval_loss, eval_reward, "
                "eval_accuracy, eval_pass@1, ...), optionally with a min: or max: prefix"
            )
        return cls(text, mode or ("min" if "loss" in text else "max"))

    def better(self, value: float, than: float | None) -> bool:
        if than is None:
            return True
        return value < than if self.mode == "min" else value > than

    def __str__(self) -> str:
        return f"{self.mode}:{self.name}"


class BestKeeper:
    """Tracks the best value of ``metric`` and writes ``<out>/best`` when it improves (module docstring).
    ``export(folder)`` writes the current model into ``folder`` (a collective under torchrun; rank 0's return value
    is the written folder)."""

    def __init__(
        self, metric: BestMetric, out: Path, export: Callable[[Path], Path | None], world: par.World, stream: Any
    ) -> None:
        self.metric, self.out, self.export, self.world, self.stream = metric, Path(out), export, world, stream
        self.value: float | None = None
        self.step: int | None = None
        if world.is_main:  # a folder a crash left half-written
            for stale in (*self.out.glob(f"{_NEXT}*"), *self.out.glob(f".{_NEXT}*"), *self.out.glob(".best.old-*")):
                shutil.rmtree(stale, ignore_errors=True)

    @property
    def path(self) -> Path:
        return self.out / BEST_DIR

    # ---- resumable state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric.name, "mode": self.metric.mode, "value": self.value, "step": self.step}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The best so far from a checkpoint's data state; a checkpoint of a run that kept another metric (or none)
        starts the tracking afresh."""
        if not state or state.get("metric") != self.metric.name or state.get("mode") != self.metric.mode:
            return
        self.value = None if state.get("value") is None else float(state["value"])
        self.step = None if state.get("step") is None else int(state["step"])

    def summary(self) -> dict[str, Any]:
        """The run summary's lines about the best (none before any evaluation)."""
        if self.step is None:
            return {}
        return {"best_model": str(self.path), f"best_{self.metric.name}": self.value, "best_step": self.step}

    # ---- per step -----------------------------------------------------------------------------------
    def check(self, names: set[str] | None) -> None:
        """Before training: a ``ConfigError`` when the metric is not among ``names``, the eval metrics the run will
        log (None: not known before the first evaluation, which then checks)."""
        if names is not None and self.metric.name not in names:
            self._unknown(names)

    def _unknown(self, names: set[str]) -> None:
        raise ConfigError(
            f"train.keep_best names {self.metric.name!r}{did_you_mean(self.metric.name, names)}, which this run's "
            "evaluation does not produce; it logs "
            f"{', '.join(sorted(names))}: pass one of them to --keep-best"
        )

    def update(self, step: int, record: dict[str, Any]) -> bool:
        """Write ``<out>/best`` when ``record`` (step ``step``) improves the metric; True when it did."""
        name = self.metric.name
        if name not in record:
            evals = {k for k in record if k.startswith("eval_")}
            if evals:
                self._unknown(evals)
            return False
        value = float(record[name])
        better = math.isfinite(value) and self.metric.better(value, self.value)
        # rank 0 decides, and its value is the one every rank keeps: the ranks' records agree (the evaluation is
        # global), and this keeps them in step even where a rank's float differed in the last bit
        better, value = self.world.broadcast_object((better, value))
        if not better:
            return False
        self.value, self.step = value, step
        self._write()
        return True

    def _write(self) -> None:
        nxt = self.out / _NEXT
        if self.world.is_main:
            shutil.rmtree(nxt, ignore_errors=True)
        self.world.barrier()
        written = self.export(nxt)  # atomic itself: nxt appears whole
        if self.world.is_main:
            folder = Path(written) if written is not None else nxt
            info = {"metric": self.metric.name, "mode": self.metric.mode, "value": self.value, "step": self.step}
            with open(folder / BEST_JSON, "w") as f:
                f.write(json.dumps(info, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            replace_dir(folder, self.path)  # the old best is renamed aside, removed only after
            print(f"best {self.metric.name} {self.value:.6g} at step {self.step}: {self.path}", file=self.stream)
        self.world.barrier()


def read_best(out: str | Path) -> dict[str, Any] | None:
    """``<out>/best/best.json`` of a run, or None when it has no best yet."""
    path = Path(out) / BEST_DIR / BEST_JSON
    return json.loads(path.read_text()) if path.is_file() else None


__all__ = ["BEST_DIR", "BEST_JSON", "BestKeeper", "BestMetric", "read_best"]
