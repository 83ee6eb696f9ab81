"""Experiment trackers (``train.report_to``): a tiny run reported to TensorBoard, W&B (offline) and MLflow (a sqlite
store under a temporary folder), read back from each; resume continues the same runs; the errors for an unknown
tracker and a missing library. Nothing reaches the network."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from polyrl.cli import train as train_cli
from polyrl.errors import ConfigError, UserError
from polyrl.run.config import LoopConfig
from polyrl.train import MetricsLogger
from polyrl.train.tracking import STATE_NAME, TRACKERS, WandbTracker, metric_name, parse_report_to
from polyrl.trainer import fit

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

# after the importorskip lines, which turn a missing [track] extra into skips
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

ALL = "tensorboard,wandb,mlflow"


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One sqlite store for the module: creating its tables is the slow part (seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def offline(monkeypatch, mlflow_uri):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    return mlflow_uri


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _tb_scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _wandb_records(out: Path) -> list:
    """The protobuf records of every offline run file under ``out/wandb`` (a LevelDB-style log after a 7-byte
    W&B header: 32 KiB blocks of chunks, each with a 7-byte header: crc, length, type full/first/middle/last)."""
    records = []
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, block, pending = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # the rest of a block too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind == 0:
                continue
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
    return records


def _wandb_history(records: list) -> list[dict]:
    rows = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in row.item} for row in rows]


def test_a_run_reports_config_steps_and_summary_to_each_tracker(tiny_model_dir, tmp_path, offline):
    out = tmp_path / "sft-tracked"
    summary = fit(
        "sft",
        tiny_model_dir,
        "builtin:arithmetic?n=16",
        out,
        optim={"lr": 1e-3},
        train={"max_steps": 2, "log_every": 100, "save_final_model": False, "report_to": ALL},
    )
    recs = _records(out)
    losses = [r["loss"] for r in recs]
    assert summary["status"] == "finished" and len(losses) == 2
    state = json.loads((out / STATE_NAME).read_text())
    assert set(state) == {"wandb", "mlflow"}

    # TensorBoard: the same names as metrics.jsonl, one point per step; config and summary as text
    assert _tb_scalars(out, "loss") == [(1, pytest.approx(losses[0])), (2, pytest.approx(losses[1]))]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert {"grad_norm", "lr", "tokens"} <= set(acc.Tags()["scalars"])
    assert {"config/text_summary", "summary/text_summary"} <= set(acc.Tags()["tensors"])

    # W&B (offline run file): the run named after the run dir, the config, each step's loss, the summary
    records = _wandb_records(out)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_id == state["wandb"] and run.display_name == "sft-tracked"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["optim"]["lr"] == 1e-3 and config["train"]["report_to"] == ALL
    history = _wandb_history(records)
    assert [h["loss"] for h in history] == pytest.approx(losses) and [h["_step"] for h in history] == [1, 2]
    summaries = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary"
                 for i in r.summary.update}  # fmt: skip
    assert summaries["summary/final_loss"] == pytest.approx(summary["final_loss"])

    # MLflow: the run, its params (the flattened config), the loss history per step, the summary, FINISHED
    client = MlflowClient(offline)
    mlrun = client.get_run(state["mlflow"])
    assert mlrun.info.run_name == "sft-tracked" and mlrun.info.status == "FINISHED"
    assert mlrun.data.params["optim.lr"] == "0.001" and mlrun.data.params["algo"] == "sft"
    history = client.get_metric_history(state["mlflow"], "loss")
    assert [(m.step, m.value) for m in history] == [(1, pytest.approx(losses[0])), (2, pytest.approx(losses[1]))]
    assert mlrun.data.metrics["summary/final_loss"] == pytest.approx(summary["final_loss"])
    assert mlrun.data.tags["summary/status"] == "finished"


def _log_steps(out: Path, steps: range, start: int, report_to: str) -> MetricsLogger:
    log = MetricsLogger(out, total_steps=4, start_step=start, stream=io.StringIO(), report_to=report_to,
                        config={"train": {"max_steps": 4}})  # fmt: skip
    for s in steps:
        log.log({"step": s, "loss": 10.0 * start + s, "rewards/mean": 0.5})
    return log


def test_resume_continues_the_same_runs(tmp_path, offline):
    out = tmp_path / "resumed"
    first = _log_steps(out, range(1, 4), 0, ALL)  # interrupted after step 3, checkpoint at 2
    first.close(extra={"status": "failed: KeyboardInterrupt"}, print_table=False)
    ids = json.loads((out / STATE_NAME).read_text())
    assert MlflowClient(offline).get_run(ids["mlflow"]).info.status == "FAILED"

    _log_steps(out, range(3, 5), 2, ALL).close(print_table=False)
    assert json.loads((out / STATE_NAME).read_text()) == ids  # the same W&B and MLflow runs
    # TensorBoard purged the interrupted run's step 3: each step once, step 3 from the resumed run
    assert [(s, v) for s, v in _tb_scalars(out, "loss")] == [(1, 1.0), (2, 2.0), (3, 23.0), (4, 24.0)]
    client = MlflowClient(offline)
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    # MLflow appends: the repeated step 3 has both values (documented)
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (3, 23.0), (4, 24.0)
    ]  # fmt: skip
    assert [m.value for m in client.get_metric_history(ids["mlflow"], "rewards/mean")] == [0.5] * 5
    runs = {r.run.run_id for r in _wandb_records(out) if r.WhichOneof("record_type") == "run"}
    assert runs == {ids["wandb"]}  # two offline run folders, one W&B run id


def test_a_fresh_run_in_the_same_dir_starts_new_runs(tmp_path, offline):
    out = tmp_path / "again"
    _log_steps(out, range(1, 2), 0, "mlflow").close(print_table=False)
    first = json.loads((out / STATE_NAME).read_text())["mlflow"]
    _log_steps(out, range(1, 2), 0, "mlflow").close(print_table=False)
    assert json.loads((out / STATE_NAME).read_text())["mlflow"] != first


def test_report_to_values():
    assert parse_report_to("none") == [] and parse_report_to(" ") == []
    assert parse_report_to("wandb, mlflow,wandb") == ["wandb", "mlflow"]
    assert parse_report_to(["mlflow"]) == ["mlflow"]
    assert parse_report_to("auto") == ["tensorboard"]  # installed here
    assert LoopConfig(report_to=["wandb", "tensorboard"]).report_to == "wandb,tensorboard"
    assert LoopConfig(report_to="none").report_to == "none" and LoopConfig().report_to == "auto"
    with pytest.raises(ConfigError, match=r"unknown tracker 'comet'; choose from tensorboard, wandb, mlflow"):
        LoopConfig(report_to="tensorboard,comet")
    with pytest.raises(ConfigError, match="unknown tracker 'none'"):
        parse_report_to("none,wandb")
    with pytest.raises(ConfigError, match="must be a comma list"):
        LoopConfig(report_to=3)
    assert list(TRACKERS) == ["tensorboard", "wandb", "mlflow"]


def test_metric_names_mlflow_cannot_take_are_mapped():
    assert metric_name("rewards/margins") == "rewards/margins" and metric_name("eval_loss") == "eval_loss"
    assert metric_name("reward[exact]@k") == "reward_exact__k"


def test_a_missing_library_is_a_config_error_before_the_model_loads(monkeypatch, tmp_path):
    monkeypatch.setattr(WandbTracker, "module", "polyrl_test_no_such_library")
    message = r"train.report_to names wandb, but its library is not installed; pip install -e '.\[track\]'"
    with pytest.raises(ConfigError, match=message):
        # the model folder does not exist: the tracker check comes first
        fit("sft", tmp_path / "no-model", "builtin:arithmetic", tmp_path / "o", train={"report_to": "wandb"})
    with pytest.raises(ConfigError, match=message):
        MetricsLogger(tmp_path / "direct", report_to="tensorboard,wandb")
    assert not (tmp_path / "direct").exists()  # checked before anything is written


def test_the_cli_flag_sets_train_report_to():
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(["--report-to", "wandb,mlflow"])
    assert dict(train_cli.overrides_from_args(args))["train.report_to"] == "wandb,mlflow"
    assert train_cli.relaunch_argv(args) == ["--report-to", "wandb,mlflow"]


@pytest.mark.parametrize(
    ("report_to", "env", "message"),
    [
        (
            "tensorboard,wandb",
            {"WANDB_PROJECT": "a/b"},
            "train.report_to: wandb could not start: UsageError: Invalid project name 'a/b': cannot contain",
        ),
        ("mlflow", {"MLFLOW_TRACKING_URI": "notascheme://x"}, "train.report_to: mlflow could not start: Unsupported"),
    ],
)
def test_a_tracker_that_cannot_start_names_itself_and_the_fix(report_to, env, message, tmp_path, offline, monkeypatch):
    """Bad tracker settings (a W&B project name it refuses, an MLflow URI of no known store) were the library's
    traceback, after the model had loaded."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError) as err:
        MetricsLogger(tmp_path / "o", stream=io.StringIO(), report_to=report_to)
    text = str(err.value)
    name = report_to.split(",")[-1]
    assert text.startswith(message) and "\n" not in text
    assert TRACKERS[name].fix in text and text.endswith(
        "or leave it out (--report-to none; metrics.jsonl always has every step)"
    )


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(tmp_path, offline):
    """A tracker whose store refuses a step (here: the MLflow run deleted under it) stopped the training run with
    the library's traceback; now that tracker alone stops, once, and metrics.jsonl and the other trackers go on."""
    stream = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=3, stream=stream, report_to="mlflow,tensorboard", progress=False)
    log.log({"step": 1, "loss": 3.0})
    MlflowClient(offline).delete_run(json.loads((tmp_path / STATE_NAME).read_text())["mlflow"])
    log.log({"step": 2, "loss": 2.0})
    log.log({"step": 3, "loss": 1.0})
    log.close(print_table=False)
    warnings = [line for line in stream.getvalue().splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: tracker mlflow failed at step 2: MlflowException: ")
    assert warnings[0].endswith("no more steps go to mlflow in this run (metrics.jsonl keeps them all)")
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]
    assert [s for s, _ in _tb_scalars(tmp_path, "loss")] == [1, 2, 3]
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == 1.0
