"""Experiment trackers: where ``MetricsLogger`` sends a run's numbers besides ``metrics.jsonl``.

``train.report_to`` (``--report-to``) names them: a comma list of ``TRACKERS`` keys (``tensorboard``, ``wandb``,
``mlflow``), ``none``, or ``auto`` (the default: TensorBoard when its library is installed, else nothing, which
is what runs did before the setting existed). A named tracker whose library is missing is a ``ConfigError``
naming the ``track`` extra, raised by ``parse_report_to`` when the run config is validated (before any model
loads) and again when a ``MetricsLogger`` is built directly.

Every tracker records the same three things:

- the run config (``RunConfig.to_dict()``), once at the start of a new run;
- each step's numbers under the names ``metrics.jsonl`` uses (bools as 0/1; ``step`` is the x axis, not a
  series); MLflow's names allow letters, digits and ``_ - . / : space`` only, any other character becomes ``_``
  (``metric_name``); TensorBoard and W&B take the names as they are;
- the end-of-run summary (``summary.json``), once, under ``summary/<key>``.

A tracker that cannot start (its settings, a login, a server that does not answer) is a ``UserError`` naming it,
the library's message and what to check (``Tracker.fix``), or ``--report-to none``. One that fails later (its server
gone, a deleted run) is dropped with one warning by ``MetricsLogger``; the run and ``metrics.jsonl`` go on.

The run is named after the run directory. ``tracking.json`` in the run directory keeps each tracker's run id, so
a resumed run (``start_step`` > 0) continues the same W&B run (``resume="allow"``) and the same MLflow run;
TensorBoard purges its events after the resumed step. Steps the interrupted run logged after its checkpoint are
logged again by the resumed run: ``metrics.jsonl`` and TensorBoard hold each step once (the resumed run's), MLflow
keeps both values of such a step (its metric history cannot be cut), and W&B ignores a step below the last it has
(so there those steps keep the interrupted run's values). Libraries are imported lazily (``import polyrl.train``
stays cheap and none of them is required).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError, UserError

TRACK_EXTRA = "pip install -e '.[track]' in the polyrl clone"
STATE_NAME = "tracking.json"  # {tracker name: its run id} in the run directory, for resume
DEFAULT_PROJECT = "polyrl"  # W&B project / MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME say


class Tracker:
    """One back end. ``open`` starts (or, given the stored ``run_id`` and ``start_step`` > 0, continues) the run;
    ``run_id`` is what ``tracking.json`` keeps for the next resume."""

    module = ""  # the library that must import
    package = ""  # its pip name
    fix = ""  # what to check when it fails to start

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any] | None, start_step: int, run_id: str | None):
        self.run_id: str | None = None

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self, summary: dict[str, Any], ok: bool) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in ``<run_dir>/tensorboard``: a scalar per name, the config and the summary as text."""

    module = package = "tensorboard"
    fix = "check that <out>/tensorboard can be written"

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any] | None, start_step: int, run_id: str | None):
        super().__init__(run_dir, name, config, start_step, run_id)
        # lazy: TensorBoard is the optional [track] extra (and pulls in torch); loaded only when a run logs to it
        from torch.utils.tensorboard import SummaryWriter

        # resuming after step N: events of later steps (written by the interrupted run) are dropped
        purge = start_step + 1 if start_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        if config is not None and start_step == 0:
            self.writer.add_text("config", _json_block(config), 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, summary: dict[str, Any], ok: bool) -> None:
        step = int(summary.get("steps") or 0)
        self.writer.add_text("summary", _json_block(summary), step)
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run (``WANDB_MODE=offline`` works without network; files under ``<run_dir>/wandb`` unless
    ``WANDB_DIR`` is set): the config as the run config, steps as history, the summary in the run summary."""

    module = package = "wandb"
    fix = (
        "check the WANDB_* variables (WANDB_MODE=offline runs without an account; `wandb login` or WANDB_API_KEY "
        "for online runs)"
    )

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any] | None, start_step: int, run_id: str | None):
        super().__init__(run_dir, name, config, start_step, run_id)
        # lazy: wandb is the optional [track] extra, loaded only when a run reports to it
        import wandb

        resume = run_id if start_step > 0 else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=name,
            id=resume,
            resume="allow" if resume else None,
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            config=config,
            reinit="create_new",
        )
        self.run_id = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict[str, Any], ok: bool) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in summary.items()})
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker(Tracker):
    """An MLflow run in the store ``MLFLOW_TRACKING_URI`` names (MLflow's default without it: ``sqlite:///mlflow.db``
    in the working directory), experiment ``MLFLOW_EXPERIMENT_NAME`` or ``polyrl``: the config flattened to params
    (``optim.lr`` = ``1e-05``; values cut at 500 characters), steps as metric history, numeric summary values as
    ``summary/<key>`` metrics and the others as ``summary/<key>`` tags; the run ends FINISHED or FAILED."""

    module = "mlflow"
    package = "mlflow-skinny"
    fix = "check MLFLOW_TRACKING_URI (e.g. sqlite:///mlflow.db, or http://HOST:5000 of a server that answers)"
    PARAM_CHARS = 500  # the smallest limit MLflow servers have had on a param value
    BATCH = 100  # params per log_batch call (MLflow's limit)

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any] | None, start_step: int, run_id: str | None):
        super().__init__(run_dir, name, config, start_step, run_id)
        # lazy: mlflow is the optional [track] extra, loaded only when a run reports to it
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._tag = Metric, RunTag
        self.client = MlflowClient()
        resumed = self._existing(run_id) if start_step > 0 else None
        if resumed is not None:
            self.run_id = resumed
            self.client.update_run(resumed, status="RUNNING")
            return  # params are logged once: MLflow refuses a changed value for a logged param
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=name, tags={"polyrl.run_dir": str(run_dir)}).info.run_id
        params = [Param(metric_name(k), str(v)[: self.PARAM_CHARS]) for k, v in _flatten(config or {}).items()]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self.BATCH])

    def _existing(self, run_id: str | None) -> str | None:
        if not run_id:
            return None
        try:
            return self.client.get_run(run_id).info.run_id
        except Exception:  # noqa: BLE001 - not in this store (another tracking URI): a new run
            return None

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(metric_name(k), v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict[str, Any], ok: bool) -> None:
        now, step = int(time.time() * 1000), int(summary.get("steps") or 0)
        numbers = numeric(summary)
        metrics = [self._metric(metric_name(f"summary/{k}"), v, now, step) for k, v in numbers.items()]
        tags = [self._tag(metric_name(f"summary/{k}"), str(v)) for k, v in summary.items() if k not in numbers]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def parse_report_to(value: str | Sequence[str]) -> list[str]:
    """``train.report_to`` as tracker names: ``"tensorboard,wandb"`` or a list of names, ``"none"`` (no tracker),
    ``"auto"`` (TensorBoard when installed). A ConfigError for an unknown name or a missing library."""
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",") if n.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        names = [n.strip() for n in value]
    else:
        raise ConfigError(
            f"train.report_to must be a comma list of {', '.join(TRACKERS)}, or none / auto, got {value!r}; "
            "e.g. --report-to tensorboard,wandb"
        )
    if names == ["auto"]:
        return ["tensorboard"] if _installed(TensorBoardTracker.module) else []
    if names in ([], ["none"]):
        return []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(
                f"train.report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)} (comma separated), "
                "or none / auto alone"
            )
        cls = TRACKERS[name]
        if not _installed(cls.module):
            raise ConfigError(
                f"train.report_to names {name}, but its library is not installed; {TRACK_EXTRA} "
                f"(or pip install {cls.package})"
            )
    return list(dict.fromkeys(names))


def open_trackers(run_dir: Path, names: Sequence[str], config: dict[str, Any] | None, start_step: int) -> list[Tracker]:
    """Start each named tracker for ``run_dir`` (continuing the stored runs when ``start_step`` > 0) and record
    their run ids in ``tracking.json``."""
    if not names:
        return []
    state_path = run_dir / STATE_NAME
    state = _read_state(state_path) if start_step > 0 else {}
    name = run_dir.resolve().name
    trackers: list[Tracker] = []
    for n in names:
        try:
            trackers.append(TRACKERS[n](run_dir, name, config, start_step, state.get(n)))
        except Exception as exc:  # noqa: BLE001 - the library's own error (settings, login, server): say which and how
            for opened in trackers:
                _finish_quietly(opened)
            raise UserError(
                f"train.report_to: {n} could not start: {error_line(exc)}; {TRACKERS[n].fix}, or leave it out "
                "(--report-to none; metrics.jsonl always has every step)"
            ) from None
    ids = {n: t.run_id for n, t in zip(names, trackers) if t.run_id is not None}
    if ids:
        state_path.write_text(json.dumps({**state, **ids}, indent=2) + "\n")
    return trackers


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record (0-d tensors' and numpy scalars' ``.item()``, bools as 0/1; NaN and inf kept),
    without ``step``; a value that is not one number (a list, an array, a string) is left out."""
    out = {}
    for key, value in record.items():
        if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
            value = value.item()
        if isinstance(value, (int, float)) and key != "step":
            out[str(key)] = float(value)
    return out


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type and message, whitespace collapsed, at most 400 characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 400 else text[:397] + "..."


def _finish_quietly(tracker: Tracker) -> None:
    try:
        tracker.finish({}, False)
    except Exception:  # noqa: BLE001 - closing after another tracker failed: that error is the one to report
        pass


_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")


def metric_name(name: str) -> str:
    """``name`` as MLflow accepts it: characters other than letters, digits, ``_ - . / : space`` become ``_``
    (the names polyrl writes, e.g. ``loss`` or ``rewards/margins``, are unchanged)."""
    return _MLFLOW_BAD.sub("_", name)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _read_state(path: Path) -> dict[str, str]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _json_block(obj: dict[str, Any]) -> str:
    return "```\n" + json.dumps(obj, indent=2, default=str) + "\n```"
