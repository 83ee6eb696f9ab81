"""Run metrics: ``metrics.jsonl`` (one flushed, strict JSON object per step: NaN / inf as ``"nan"`` / ``"inf"``,
arrays and tensors as lists, other objects as their ``str``; a resume drops torn and non-record lines), the
trackers ``report_to`` names (TensorBoard, W&B, MLflow: ``polyrl.train.tracking``; by default TensorBoard when
installed; one that fails mid-run is dropped with a warning), a rich progress bar with ETA (a plain line every N
steps when stdout is not a terminal), and at the end a ``summary.json`` + printed table and a ``metrics.png`` plot
of loss, lr and any other named series (a name with ``*``, such as ``eval_pass@*``, is one panel with a line per
matching metric).

It only records what it is handed (``StepStats`` or plain dicts); it computes no training numbers.
matplotlib and the trackers' libraries (optional) are imported lazily, so importing this module stays cheap; without
matplotlib (the ``plot`` extra) the run ends with a one-line notice instead of the plot. The progress line (bar
or plain) fits the console width (80 columns off a terminal): the step numbers first, then as many of loss,
SKIPPED, lr, grad norm, tokens/s and MFU as fit.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from polyrl.errors import UserError
from polyrl.train.tracking import TRACKERS, error_line, numeric, open_trackers, parse_report_to

DEFAULT_PLOT_SERIES = ("loss", "lr", "grad_norm")
LINE_WIDTH = 80  # the plain progress line's width (a log file or a pipe has no terminal width)
BAR_WIDTH = 12  # the rich bar's own columns
_PLOT_EXTRA = "pip install -e '.[plot]' in the polyrl clone"
NO_PLOT_NOTICE = f"metrics.png not drawn: matplotlib is not installed ({_PLOT_EXTRA}); the numbers are in metrics.jsonl"


class MetricsLogger:
    """Write per-step metrics into ``run_dir``. ``start_step``: resuming after this step, so records of
    later steps (written by the interrupted run) are dropped from ``metrics.jsonl`` first (at 0, every record:
    a run that starts over logs its step-0 evaluation again).
    ``progress``: None = a rich bar when stdout is a terminal, else a plain line every ``log_every``.
    ``report_to``: the trackers (``train.report_to``: a comma list, ``none`` or ``auto``), checked here before
    anything is written (a ConfigError for an unknown name or a missing library); ``config``: the run config they
    record (``RunConfig.to_dict()``). ``tensorboard=False`` leaves TensorBoard out whatever ``report_to`` says."""

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int | None = None,
        *,
        log_every: int = 10,
        start_step: int = 0,
        progress: bool | None = None,
        report_to: str | Sequence[str] = "auto",
        config: dict[str, Any] | None = None,
        tensorboard: bool = True,
        plot_series: Sequence[str] = DEFAULT_PLOT_SERIES,
        stream: Any = None,
    ) -> None:
        trackers = [n for n in parse_report_to(report_to) if tensorboard or n != "tensorboard"]
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"cannot make the run directory {self.run_dir}: {exc.strerror or exc}; choose a folder you can write"
            ) from None
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.plot_series = tuple(plot_series)
        self.stream = stream or sys.stdout
        self.history: list[dict[str, Any]] = self._load_history(start_step)
        self._file = self.path.open("a")
        self._t0 = time.perf_counter()
        self._start_step = start_step
        self._trackers = open_trackers(self.run_dir, trackers, config, start_step)
        use_bar = progress if progress is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = self._open_bar(start_step) if use_bar else None

    # ---- setup --------------------------------------------------------------------------------
    def _load_history(self, start_step: int) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        kept = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
            if not isinstance(rec, dict) or not _finite(rec.get("step", 0)):
                continue  # not a step record (an edited or damaged line)
            if start_step > 0 and int(rec.get("step", 0)) <= start_step:  # step 0: an evaluation before training
                kept.append(rec)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def _open_bar(self, start_step: int) -> Any:
        console = Console(file=self.stream)
        steps = len(str(self.total_steps or 0))
        # "train" BAR M/N "eta" H:MM:SS, a space between columns, one spare column: the rest is the info's
        self._info_width = max(0, console.width - (5 + BAR_WIDTH + 2 * steps + 1 + 3 + 7 + 5 + 1))
        bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=BAR_WIDTH),
            MofNCompleteColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
        )
        bar.start()
        self._task = bar.add_task("train", total=self.total_steps, completed=start_step, info="")
        return bar

    # ---- per step -----------------------------------------------------------------------------
    def log(self, record: Any) -> dict[str, Any]:
        """Append one step's record (``StepStats`` or a dict with ``step``); returns the dict written."""
        raw = record.to_dict() if hasattr(record, "to_dict") else dict(record)
        rec = {str(k): _jsonable(v) for k, v in raw.items()}
        self._file.write(json.dumps(rec, allow_nan=False) + "\n")
        self._file.flush()
        self.history.append(rec)
        step = int(rec["step"]) if _finite(rec.get("step")) else len(self.history)
        if self._trackers:
            values = numeric(raw)  # before _jsonable: a NaN stays a number here
            for tracker in list(self._trackers):
                try:
                    tracker.log(values, step)
                except Exception as exc:  # noqa: BLE001 - a tracker's failure (server gone, disk full) ends only it
                    self._drop(tracker, f"failed at step {step}: {error_line(exc)}")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=_short(rec, self._info_width))
        elif step % self.log_every == 0 or step == self.total_steps:
            print(self._plain_line(step, rec), file=self.stream, flush=True)
        return rec

    def _drop(self, tracker: Any, what: str) -> None:
        """Stop reporting to ``tracker`` (it failed), saying so once; the run and metrics.jsonl go on."""
        self._trackers.remove(tracker)
        name = next((n for n, cls in TRACKERS.items() if isinstance(tracker, cls)), type(tracker).__name__)
        print(
            f"warning: tracker {name} {what}; no more steps go to {name} in this run (metrics.jsonl keeps them all)",
            file=self.stream,
            flush=True,
        )

    def _plain_line(self, step: int, rec: dict[str, Any]) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        head, tail = f"step {step}{total}", ""
        done = step - self._start_step
        if self.total_steps and done > 0:
            eta = (time.perf_counter() - self._t0) / done * (self.total_steps - step)
            tail = f" eta {_duration(eta)}"
        info = _short(rec, LINE_WIDTH - len(head) - len(tail) - 1)
        return f"{head} {info}{tail}" if info else head + tail

    # ---- end of run ---------------------------------------------------------------------------
    def summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """End-of-run numbers over the whole history (resumed runs included)."""
        h = self.history
        losses = [r["loss"] for r in h if _finite(r.get("loss")) and not r.get("skipped")]
        tps = [r["tokens_per_s"] for r in h if _finite(r.get("tokens_per_s"))]
        mfu = [r["mfu"] for r in h if _finite(r.get("mfu"))]
        out: dict[str, Any] = {
            "steps": int(h[-1]["step"]) if h else 0,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "min_loss": min(losses) if losses else None,
            "tokens": int(sum(r.get("tokens", 0) or 0 for r in h)),
            "mean_tokens_per_s": sum(tps) / len(tps) if tps else None,
            "mean_mfu": sum(mfu) / len(mfu) if mfu else None,
            "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0 for r in h), default=0),
            "skipped_steps": int(h[-1].get("skipped_total", 0)) if h else 0,
            "time_s": sum(r.get("time_s", 0.0) or 0.0 for r in h),
        }
        # the last evaluation's numbers (every eval_* key of the last record that has one): final_eval_loss, ...
        last_eval = next((r for r in reversed(h) if any(k.startswith("eval_") for k in r)), None)
        if last_eval is not None:
            out["final_eval_step"] = int(last_eval["step"])
            out.update({f"final_{k}": v for k, v in last_eval.items() if k.startswith("eval_")})
        out.update(extra or {})
        return out

    def close(self, extra: dict[str, Any] | None = None, print_table: bool = True) -> dict[str, Any]:
        """Stop the bar, write ``summary.json`` and ``metrics.png``, hand the summary to the trackers and end their
        runs (failed when ``extra``'s status says so), print the summary table."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self._file.close()
        summary = self.summary(extra)
        clean = {str(k): _jsonable(v) for k, v in summary.items()}  # strict JSON: NaN as "nan"
        (self.run_dir / "summary.json").write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
        ok = not str(summary.get("status", "finished")).startswith("failed")
        for tracker in list(self._trackers):
            try:
                tracker.finish(summary, ok)
            except Exception as exc:  # noqa: BLE001 - the summary is in summary.json whatever a tracker does
                self._drop(tracker, f"failed to record the summary: {error_line(exc)}")
        self._trackers = []
        self.plot = None  # the drawn metrics.png, if any
        try:
            self.plot = plot_metrics(self.history, self.run_dir / "metrics.png", self.plot_series)
        except ImportError:  # the optional plot extra: the run itself is done
            print(NO_PLOT_NOTICE, file=self.stream)
        if print_table:
            _print_table(summary, self.stream)
        return summary


def series_keys(name: str, keys: Sequence[str]) -> list[str]:
    """The metric keys a series name selects among ``keys``: the name itself, or for a pattern with ``*``
    (``eval_pass@*``) every key it matches, in natural order (``eval_pass@2`` before ``eval_pass@16``)."""
    if "*" not in name:
        return [name] if name in keys else []
    head, _, tail = name.partition("*")
    hits = [k for k in keys if k.startswith(head) and k.endswith(tail) and len(k) >= len(head) + len(tail)]
    return sorted(set(hits), key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])


def plot_panels(history: list[dict[str, Any]], series: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The panels ``plot_metrics`` draws: ``(label, keys)`` per series name with a finite value in ``history``; a
    pattern (``eval_pass@*``) is one panel with a line per matching key, labelled with ``k`` for the ``*``."""
    present = list(dict.fromkeys(k for r in history for k, v in r.items() if _finite(v)))
    panels = []
    for name in series:
        keys = series_keys(name, present)
        if keys:
            panels.append((name.replace("*", "k"), keys))
    return panels


def plot_metrics(
    history: list[dict[str, Any]], out: str | Path, series: Sequence[str] = DEFAULT_PLOT_SERIES
) -> Path | None:
    """A PNG with one panel per named series present in ``history`` (x = step; ``plot_panels``). None if nothing
    to plot; ImportError without matplotlib."""
    panels = plot_panels(history, series)
    if not panels:
        return None
    # lazy: matplotlib is the optional [plot] extra, loaded only to draw
    import matplotlib

    matplotlib.use("Agg", force=False)
    # lazy: pyplot only after the Agg backend is chosen
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (label, keys) in zip(axes[:, 0], panels):
        for key in keys:
            pts = [(r["step"], r[key]) for r in history if _finite(r.get(key))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=1.2, label=key)
        if len(keys) > 1:
            ax.legend(fontsize="small")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _print_table(summary: dict[str, Any], stream: Any) -> None:
    table = Table(title="training summary", show_header=False)
    for key, value in summary.items():
        table.add_row(key, _fmt(value))
    Console(file=stream).print(table)


def _short(rec: dict[str, Any], width: int | None = None) -> str:
    """The step's numbers in one line of at most ``width`` characters, most important first (later ones are left
    out when they do not fit)."""
    parts = []
    if _finite(rec.get("loss")):
        parts.append(f"loss {rec['loss']:.4f}")
    if rec.get("skipped"):
        parts.append("SKIPPED")
    if _finite(rec.get("lr")):
        parts.append(f"lr {rec['lr']:.2e}")
    if _finite(rec.get("grad_norm")):
        parts.append(f"gnorm {rec['grad_norm']:.3g}")
    if _finite(rec.get("tokens_per_s")):
        parts.append(f"tok/s {_count(rec['tokens_per_s'])}")
    if _finite(rec.get("mfu")):
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    line = ""
    for part in parts:
        candidate = f"{line} {part}" if line else part
        if width is not None and len(candidate) > width:
            break
        line = candidate
    return line


def _count(value: float) -> str:
    """``1234567`` -> ``1.23M``; below ten thousand as is."""
    if abs(value) < 1e4:
        return f"{value:.0f}"
    scale, suffix = next((s, x) for s, x in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if abs(value) >= s)
    return f"{value / scale:.3g}{suffix}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON can hold it: 0-d tensors and numpy scalars as their number, arrays and tensors as
    lists, non-finite floats as ``"nan"`` / ``"inf"`` / ``"-inf"`` (strict JSON has no NaN; also inside lists and
    dicts), anything else that is not JSON as its ``str``."""
    if callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0:
        value = value.item()
    elif callable(getattr(value, "tolist", None)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)
