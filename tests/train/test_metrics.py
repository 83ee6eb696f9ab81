"""MetricsLogger: metrics.jsonl per step, plain progress lines off a TTY, resume truncation, summary, plot."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
from train_helpers import pack, random_seqs, tiny_lm

from polyrl.train import MetricsLogger, OptimConfig, ScheduleConfig, TrainEngine


def _records(n: int, start: int = 0) -> list[dict]:
    return [
        {"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3 * s, "grad_norm": 1.0, "tokens": 100, "tokens_per_s": 1000.0}
        for s in range(start + 1, start + n + 1)
    ]


def test_jsonl_plain_progress_summary_and_plot(tmp_path):
    out = io.StringIO()  # not a TTY: plain lines every log_every steps
    log = MetricsLogger(
        tmp_path, total_steps=6, log_every=2, stream=out, tensorboard=False, plot_series=("loss", "lr", "extra")
    )
    for rec in _records(6):
        log.log(rec | {"extra": float(rec["step"]) ** 2})
        # flushed as it goes: another reader sees every line so far
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == rec["step"]
    summary = log.close()
    printed = out.getvalue()
    assert [ln.split()[1] for ln in printed.splitlines() if ln.startswith("step ")] == ["2/6", "4/6", "6/6"]
    assert "loss 2.8000" in printed and "eta" in printed and "training summary" in printed
    assert (
        summary["steps"] == 6
        and summary["first_loss"] == pytest.approx(2.9)
        and summary["final_loss"] == pytest.approx(2.4)
    )
    assert summary["tokens"] == 600 and summary["mean_tokens_per_s"] == 1000.0
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == pytest.approx(2.4)
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_summary_carries_the_last_evaluation(tmp_path):
    """``final_eval_*``: every eval key of the last record that has one (DPO's margins and accuracies too)."""
    log = MetricsLogger(tmp_path, total_steps=5, stream=io.StringIO(), tensorboard=False)
    for rec in _records(5):
        if rec["step"] in (2, 4):
            rec |= {"eval_loss": 1.0 / rec["step"], "eval_rewards/accuracies": 0.1 * rec["step"]}
        log.log(rec)
    summary = log.close(print_table=False)
    assert summary["final_eval_step"] == 4 and summary["final_eval_loss"] == pytest.approx(0.25)
    assert summary["final_eval_rewards/accuracies"] == pytest.approx(0.4)
    plain = MetricsLogger(tmp_path / "b", total_steps=2, stream=io.StringIO(), tensorboard=False)
    for rec in _records(2):
        plain.log(rec)
    assert not any(k.startswith("final_eval") for k in plain.close(print_table=False))


def test_resume_drops_records_after_checkpoint_and_handles_nan(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=10, stream=io.StringIO(), tensorboard=False)
    for rec in _records(7):
        log.log(rec)
    log.close(print_table=False)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "loss"')  # a line torn by the crash
    resumed = MetricsLogger(tmp_path, total_steps=10, start_step=5, stream=io.StringIO(), tensorboard=False)
    resumed.log({"step": 6, "loss": float("nan"), "skipped": True, "lr": 0.1})
    summary = resumed.close(print_table=False)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[-1]["loss"] == "nan"  # strict JSON
    assert summary["final_loss"] == pytest.approx(2.5) and summary["steps"] == 6


def test_logs_engine_step_stats_with_rich_bar(tmp_path):
    model = tiny_lm()
    engine = TrainEngine(model, OptimConfig(lr=1e-2), ScheduleConfig(decay="constant"))
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=2, progress=True, stream=out, tensorboard=False)
    batch = [pack(random_seqs(2, 12, 64, 0))]
    for _ in range(2):
        rec = log.log(engine.step(batch))
    log.close()
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_memory_bytes", "skipped_total"} <= set(rec)
    assert "2/2" in out.getvalue()  # the bar's M/N column
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


# ---- issue 33: plotting is optional; the progress line fits 80 columns ---------------------------------
LONG_RECORD = {
    "loss": 12.345678,
    "lr": 1.5e-5,
    "grad_norm": 123.456,
    "tokens_per_s": 1234567.0,
    "mfu": 0.456,
    "skipped": True,
}


def test_missing_matplotlib_is_a_one_line_notice(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=2, progress=False, stream=out, tensorboard=False)
    for step in (1, 2):
        log.log({"step": step, "loss": 1.0 / step})
    summary = log.close(print_table=False)
    assert summary["steps"] == 2 and (tmp_path / "summary.json").is_file()
    assert not (tmp_path / "metrics.png").exists()
    notice = [line for line in out.getvalue().splitlines() if "matplotlib" in line]
    assert notice == ["metrics.png not drawn: matplotlib is not installed (pip install -e '.[plot]' in the polyrl "
                      "clone); the numbers are in metrics.jsonl"]  # fmt: skip
    assert log.plot is None  # the run's last line names no plot


def test_plain_progress_line_fits_80_columns(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=100000, progress=False, stream=out, tensorboard=False, log_every=1)
    log.log({"step": 12345, **LONG_RECORD})
    line = out.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= 80, line
    assert line.startswith("step 12345/100000 loss 12.3457") and "SKIPPED" in line and "eta" in line


def test_rich_progress_bar_fits_80_columns(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=100000, progress=True, stream=out, tensorboard=False)
    log.log({"step": 12345, **LONG_RECORD})
    log.close(print_table=False)
    lines = [x for x in out.getvalue().splitlines() if x.strip()]
    bar = [x for x in lines if "12345/100000" in x]
    assert len(bar) == 1 and "loss 12.3457" in bar[0] and "eta" in bar[0], lines
    assert all(len(x) <= 80 for x in lines), [len(x) for x in lines]


def test_plot_panels_select_eval_series_and_patterns():
    """Series names select the panels drawn: a name present in any record (finite), and a ``*`` pattern one panel of
    every key it matches in natural order; the RL and DPO specs name the eval metrics (pass@k, length, DPO's)."""
    from polyrl import algorithms
    from polyrl.train.metrics import plot_panels, series_keys

    keys = ["eval_pass@16", "eval_pass@2", "eval_pass@1", "eval_pass@4", "eval_passive", "reward"]
    assert series_keys("eval_pass@*", keys) == ["eval_pass@1", "eval_pass@2", "eval_pass@4", "eval_pass@16"]
    assert series_keys("reward", keys) == ["reward"] and series_keys("eval_reward", keys) == []
    history = [
        {"step": 1, "reward": 0.1, "loss": 1.0},
        {"step": 2, "reward": 0.2, "eval_reward": 0.5, "eval_pass@1": 0.25, "eval_pass@2": 0.4, "eval_length": 5.0},
        {"step": 3, "reward": 0.3, "eval_rewards/margins": float("nan")},  # never finite: no panel
    ]
    grpo = algorithms.get("grpo").plot_series
    assert plot_panels(history, ("loss", *grpo)) == [
        ("loss", ["loss"]),
        ("reward", ["reward"]),
        ("eval_reward", ["eval_reward"]),
        ("eval_pass@k", ["eval_pass@1", "eval_pass@2"]),
        ("eval_length", ["eval_length"]),
    ]
    for algo in ("ppo", "gspo", "distill"):
        assert {"eval_reward", "eval_pass@*", "eval_length"} <= set(algorithms.get(algo).plot_series), algo
    dpo = algorithms.get("dpo").plot_series
    dpo_hist = [{"step": 2, "rewards/margins": 0.1, "eval_rewards/margins": 0.2, "eval_rewards/accuracies": 0.75}]
    assert [label for label, _ in plot_panels(dpo_hist, dpo)] == [
        "rewards/margins",
        "eval_rewards/margins",
        "eval_rewards/accuracies",
    ]


def test_plot_draws_a_pattern_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from polyrl.train.metrics import plot_metrics

    history = [{"step": s, "eval_pass@1": 0.1 * s, "eval_pass@2": 0.15 * s} for s in (1, 2, 3)]
    png = plot_metrics(history, tmp_path / "m.png", ("eval_pass@*",))
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(history, tmp_path / "none.png", ("eval_length",)) is None


def _strict(text: str) -> list:
    """Each line parsed as strict JSON (NaN / Infinity refused, as jq, JavaScript and most readers do)."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def test_non_scalar_and_non_finite_metrics_keep_the_files_strict_json(tmp_path):
    """An array or tensor of several values crashed the run (``.item()``), a NaN inside a list or dict was written as
    NaN (invalid JSON), an object json cannot take (a Path) crashed it; summary.json took NaN from ``extra`` too."""
    import numpy as np
    import torch

    log = MetricsLogger(tmp_path, total_steps=1, stream=io.StringIO(), tensorboard=False, progress=False)
    log.log({
        "step": np.int64(1), "loss": torch.tensor(0.5), "per_group": np.array([1.0, np.inf]),
        "hist": torch.tensor([1.0, float("nan")]), "nested": {"a": float("nan"), 3: -float("inf")},
        "where": tmp_path, "flag": np.bool_(True), "lr": np.float32(0.25),
    })  # fmt: skip
    summary = log.close({"extra": float("nan")}, print_table=False)
    (rec,) = _strict((tmp_path / "metrics.jsonl").read_text())
    assert rec == {
        "step": 1, "loss": 0.5, "per_group": [1.0, "inf"], "hist": [1.0, "nan"], "nested": {"a": "nan", "3": "-inf"},
        "where": str(tmp_path), "flag": True, "lr": 0.25,
    }  # fmt: skip
    assert _strict((tmp_path / "summary.json").read_text().replace("\n", " "))[0]["extra"] == "nan"
    assert summary["final_loss"] == 0.5 and summary["steps"] == 1


def test_resume_skips_lines_that_are_not_step_records(tmp_path):
    """A damaged metrics.jsonl (a bare number, a list, a step that is not a number) made the resume crash."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n3\n[1]\n{"step": "x"}\n{"step": 2, "loss": 1}\n')
    log = MetricsLogger(tmp_path, total_steps=3, start_step=2, stream=io.StringIO(), tensorboard=False)
    log.log({"step": 3, "loss": 0.5})
    log.close(print_table=False)
    assert [r["step"] for r in _strict((tmp_path / "metrics.jsonl").read_text())] == [1, 2, 3]


def test_a_run_directory_that_cannot_be_made_is_a_clear_error(tmp_path, capsys):
    """--out under a file (or in a folder the user cannot write) was a NotADirectoryError / PermissionError traceback
    from mkdir after the config was accepted; the model folder does not exist, so this comes before any load."""
    from polyrl.cli.main import main
    from polyrl.errors import UserError

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match=r"cannot make the run directory .*a-file/run: Not a directory; choose"):
        MetricsLogger(tmp_path / "a-file" / "run", stream=io.StringIO(), tensorboard=False)
    argv = ["train", "--algo", "sft", "--model", str(tmp_path / "no-model"), "--data", "builtin:arithmetic"]
    assert main([*argv, "--out", str(tmp_path / "a-file" / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--out '{tmp_path}/a-file/run' cannot be made: {tmp_path}/a-file is a file, not a folder" in err, err
    if os.geteuid() != 0:  # root writes anywhere: the permission case only applies to other users
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        assert main([*argv, "--out", str(locked / "run")]) == 2
        assert f"cannot write in {locked} (no write permission, or a read-only file system)" in capsys.readouterr().err


def test_a_run_directory_under_a_folder_that_cannot_be_entered_is_a_clear_error(tmp_path, unenterable_dir, capsys):
    """--out under a folder the user may not enter (another user's 0700 home): Path.exists raises PermissionError
    there instead of saying False, which was a traceback; now the folder is named. This machine's tests run as root,
    who enters anywhere, so Path.exists raises as it does for other users under the locked folder."""
    from polyrl.cli.main import main

    locked = unenterable_dir
    argv = ["train", "--algo", "sft", "--model", str(tmp_path / "no-model"), "--data", "builtin:arithmetic"]
    assert main([*argv, "--out", str(locked / "sub" / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--out '{locked}/sub/run' cannot be reached: {locked} may not be entered (Permission denied); choose" in err
    assert "Traceback" not in err
