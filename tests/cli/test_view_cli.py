"""``polyrl view`` names the folder to give when it is handed something other than a run directory."""

from __future__ import annotations

import json

from polyrl.cli.main import main


def _run_dir(tmp_path):
    run = tmp_path / "runs" / "sft"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    rows = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _view(argv, capsys):
    code = main(["view", *argv])
    return code, capsys.readouterr().err


def test_a_folder_inside_a_run_names_the_run_directory(tmp_path, monkeypatch, capsys):
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, err = _view(["runs/sft/final"], capsys)
    assert code == 2
    assert "runs/sft/final is a folder inside the run directory runs/sft; run `polyrl view runs/sft`" in err


def test_a_missing_path_and_a_file_say_what_to_give(tmp_path, monkeypatch, capsys):
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, err = _view(["runs/nope"], capsys)
    assert code == 2 and "runs/nope does not exist; give the --out directory of a polyrl train run" in err
    code, err = _view(["runs/sft/metrics.jsonl"], capsys)
    assert code == 2 and "runs/sft/metrics.jsonl is a file; give the --out directory" in err


def test_the_run_directory_itself_is_written(tmp_path, monkeypatch, capsys):
    run = _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["view", "runs/sft"]) == 0
    page = (run / "viewer.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "polyrl run sft" in page


def test_an_unrelated_summary_json_in_a_parent_is_not_taken_for_a_run(tmp_path, monkeypatch, capsys):
    """A summary.json (many tools write one) above a folder that is no run does not make that parent "the run
    directory" (was: "data is a folder inside the run directory ."): the folder itself is named as not a run. A parent
    with run_config.json (written before a run's first step) still is one."""
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    code, err = _view(["data"], capsys)
    assert code == 2 and "folder inside the run directory" not in err
    assert "data is not a run directory: it has none of metrics.jsonl" in err
    (tmp_path / "run_config.json").write_text("{}")
    code, err = _view(["data"], capsys)
    assert code == 2 and "data is a folder inside the run directory .; run `polyrl view .`" in err


def test_a_folder_inside_a_run_given_as_dot_names_the_run(tmp_path, monkeypatch, capsys):
    """From inside a run's final/ or a checkpoint, `polyrl view .` (or `..`) has no parents as written, so the run
    around it was not found and the folder was only 'not a run directory'; the parents on disk are searched, and the
    run directory is named as the user can type it from there."""
    run = tmp_path / "runs" / "sft"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "final").mkdir()
    (run / "run_config.json").write_text("{}")
    monkeypatch.chdir(run / "final")
    code, err = _view(["."], capsys)
    assert code == 2 and ". is a folder inside the run directory ..; run `polyrl view ..`" in err, err
    monkeypatch.chdir(run / "checkpoints" / "step-00000002")
    code, err = _view([".."], capsys)
    assert code == 2 and ".. is a folder inside the run directory ../..; run `polyrl view ../..`" in err, err
    code, err = _view([str(run / "final")], capsys)
    assert code == 2 and f"inside the run directory {run}; run `polyrl view {run}`" in err, err


def test_a_run_directory_under_a_folder_that_cannot_be_entered_is_a_clear_error(unenterable_dir, capsys):
    """RUN_DIR under a folder the user may not enter: Path.exists raises PermissionError there (for a non-root user;
    made to here), which was a traceback from the first check of polyrl view."""
    run = unenterable_dir / "runs" / "sft"
    code, err = _view([str(run)], capsys)
    assert code == 2 and f"error: {run} cannot be reached: {unenterable_dir} may not be entered (Permission" in err
