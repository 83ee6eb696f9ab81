"""Issue 33 item 11: ``--resume latest`` with a truncated or corrupted newest checkpoint falls back to the newest
complete one with a warning that names the bad one (checked against the manifest's file sizes and the safetensors
headers); keep-last-K never deletes a complete checkpoint to keep a broken one."""

from __future__ import annotations

import dataclasses

import pytest
from train_helpers import tiny_lm

from polyrl.errors import CheckpointError
from polyrl.run import config as rc
from polyrl.run.offline import resume_point
from polyrl.train import CheckpointConfig, CheckpointManager
from polyrl.train.checkpoint import checkpoint_problem, list_checkpoints


def _run(tmp_path, tiny_model_dir, steps=(2, 4)):
    out = tmp_path / "run"
    manager = CheckpointManager(out, CheckpointConfig(keep_last_k=0))
    model = tiny_lm()
    paths = [manager.save(s, model, None, data_state={"iterator": {}}) for s in steps]
    raw = {"model": str(tiny_model_dir), "out": str(out), "data": {"path": "builtin:arithmetic"}, "resume": "latest"}
    return rc.build(raw), paths


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_latest_falls_back_with_a_warning(tmp_path, tiny_model_dir, capsys):
    cfg, (good, bad) = _run(tmp_path, tiny_model_dir)
    _truncate(bad / "model" / "model.safetensors")
    assert "model/model.safetensors" in checkpoint_problem(bad) and checkpoint_problem(good) is None
    assert resume_point(cfg) == good
    err = capsys.readouterr().err
    assert f"warning: resume: skipping {bad}: " in err and "truncated" in err and good.name in err
    assert bad.is_dir()  # nothing deleted


def test_corrupted_safetensors_header_and_manifest_are_caught(tmp_path, tiny_model_dir, capsys):
    cfg, (good, bad) = _run(tmp_path, tiny_model_dir, steps=(2, 4))
    rng = bad / "rng.pt"
    saved = rng.read_bytes()
    rng.write_bytes(bytes(len(saved)))  # zeroed, same size: the size check alone would pass
    assert "rng.pt" in checkpoint_problem(bad)
    rng.write_bytes(saved)
    st = bad / "model" / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[8:16] = b"\x00" * 8  # a broken header of the same size
    st.write_bytes(bytes(data))
    assert "model/model.safetensors" in checkpoint_problem(bad)
    assert resume_point(cfg) == good
    (good / "manifest.json").write_text('{"files": ')  # a torn manifest
    with pytest.raises(CheckpointError, match=r"no complete checkpoint .*step-00000004.*step-00000002"):
        resume_point(cfg)


def test_explicit_resume_of_a_broken_checkpoint_names_it(tmp_path, tiny_model_dir):
    cfg, (_, bad) = _run(tmp_path, tiny_model_dir)
    _truncate(bad / "optimizer.safetensors" if (bad / "optimizer.safetensors").exists() else bad / "rng.pt")
    with pytest.raises(CheckpointError, match=rf"{bad.name} is corrupted"):
        resume_point(dataclasses.replace(cfg, resume=str(bad)))


def test_prune_keeps_complete_checkpoints_over_broken_ones(tmp_path, tiny_model_dir):
    _, (good, bad) = _run(tmp_path, tiny_model_dir)
    _truncate(bad / "rng.pt")
    manager = CheckpointManager(tmp_path / "run", CheckpointConfig(keep_last_k=1))
    newer = manager.save(3, tiny_lm(), None)  # resumed from step 2: step 4 is still the broken one
    assert list_checkpoints(manager.root) == [newer, bad]
    assert good not in list_checkpoints(manager.root) and checkpoint_problem(newer) is None


def test_a_checkpoint_moved_aside_by_an_interrupted_overwrite_is_resumed_from(tmp_path, tiny_model_dir):
    """A kill between the overwrite's two renames leaves step 4 as ``.trash-step-00000004`` and no ``step-00000004``:
    ``--resume latest`` puts it back and resumes from it, not from step 2 (the manager's cleanup ran only later)."""
    cfg, (older, newest) = _run(tmp_path, tiny_model_dir)
    aside = newest.parent / f".trash-{newest.name}"
    newest.rename(aside)
    assert list_checkpoints(newest.parent) == [older]
    assert resume_point(cfg) == newest
    assert checkpoint_problem(newest) is None and not aside.exists()


def test_resume_paths_that_are_not_a_checkpoint_say_what_they_are(tmp_path, tiny_model_dir):
    """A path that does not exist says so; the checkpoints folder itself (or the run directory) names its newest."""
    cfg, (_, newest) = _run(tmp_path, tiny_model_dir)
    with pytest.raises(CheckpointError, match=r"--resume '.*nothere' does not exist; give a checkpoints/step-\*"):
        resume_point(dataclasses.replace(cfg, resume=str(tmp_path / "nothere")))
    for given in (newest.parent, newest.parent.parent):
        with pytest.raises(CheckpointError, match=rf"no manifest.json.*its newest is --resume {newest}$"):
            resume_point(dataclasses.replace(cfg, resume=str(given)))
