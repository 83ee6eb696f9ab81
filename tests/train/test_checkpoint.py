"""Checkpoints in-process: round trip (bf16 masters), keep-last-K, crash before publish, overwrite, corruption."""

from __future__ import annotations

import errno
import json
import os
import random

import pytest
import torch
from train_helpers import pack, random_seqs, tiny_lm

from polyrl.errors import CheckpointError
from polyrl.models import load_model
from polyrl.train import (
    CheckpointConfig,
    CheckpointManager,
    OptimConfig,
    PrecisionConfig,
    ScheduleConfig,
    TrainEngine,
    checkpoint,
    latest_checkpoint,
    load_checkpoint,
)
from polyrl.train.checkpoint import cleanup_stale, list_checkpoints

BATCH = [pack(random_seqs(2, 16, 64, 0))]


def _engine(seed: int = 0, dtype: str = "fp32") -> tuple[object, TrainEngine]:
    model = tiny_lm(seed=seed)
    cfgs = (OptimConfig(lr=1e-2, weight_decay=0.1), ScheduleConfig(decay="linear"), PrecisionConfig(dtype))
    return model, TrainEngine(model, *cfgs, total_steps=20)


def test_round_trip_restores_model_optimizer_counters_and_rng(tmp_path):
    model, engine = _engine(dtype="bf16")
    for _ in range(3):
        engine.step(BATCH)
    manager = CheckpointManager(tmp_path)
    torch.manual_seed(99)
    random.seed(5)
    path = manager.save(3, model, engine, data_state={"epoch": 0, "offset": 17}, config={"optim": {"lr": 1e-2}})
    expected_draw = (torch.rand(3), random.random())
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert {"optimizer.safetensors", "rng.pt", "trainer_state.json", "config.json"} <= set(files)
    assert "model/config.json" in files  # the weights are an HF folder polyrl (and transformers) load
    hf = load_model(path / "model")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), hf.state_dict().values()))

    fresh, fresh_engine = _engine(seed=1, dtype="bf16")
    torch.manual_seed(0)
    loaded = load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_engine)
    draw = (torch.rand(3), random.random())
    assert torch.equal(draw[0], expected_draw[0]) and draw[1] == expected_draw[1]
    assert loaded.step == 3 and loaded.data_state == {"epoch": 0, "offset": 17}
    assert loaded.config == {"optim": {"lr": 1e-2}} and fresh_engine.global_step == 3
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    # both continue identically: fp32 masters and moments came back, not just the bf16 weights
    assert [engine.step(BATCH).loss for _ in range(2)] == [fresh_engine.step(BATCH).loss for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_keep_last_k_and_every_n(tmp_path):
    model, engine = _engine()
    manager = CheckpointManager(tmp_path, CheckpointConfig(every_n_steps=2, keep_last_k=2))
    assert [s for s in range(1, 8) if manager.should_save(s)] == [2, 4, 6]
    assert manager.should_save(7, final=True)
    for step in (2, 4, 6):
        manager.save(step, model, engine)
    assert [p.name for p in list_checkpoints(manager.root)] == ["step-00000004", "step-00000006"]
    assert manager.root == tmp_path / "checkpoints" and latest_checkpoint(tmp_path).name == "step-00000006"
    assert not [p for p in manager.root.iterdir() if p.name.startswith(".")]


def test_disk_full_during_save_keeps_previous_and_says_so(tmp_path, monkeypatch):
    """A write that fails (ENOSPC half-way through the optimizer file) removes its temp dir at once (it held the
    disk the run needs) and raises a CheckpointError naming the step, the OS error and the intact previous
    checkpoint; a failing publish of an overwrite puts the copy it moved aside back. (A kill -9 leaves the temp dir
    instead: test_resume.py.)"""
    model, engine = _engine()
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last_k=3))
    good = manager.save(1, model, engine, data_state={"pos": 1})
    good_weights = [p.detach().clone() for p in model.parameters()]
    engine.step(BATCH)
    real_save_file = checkpoint.save_file

    def disk_full(tensors, path, *args, **kwargs):
        if path.endswith("optimizer.safetensors"):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(CheckpointError) as err:
        manager.save(2, model, engine, data_state={"pos": 2})
    msg = str(err.value)
    assert msg.startswith(f"could not write checkpoint step-00000002 in {manager.root}: No space left on device (")
    assert "the newest complete one, step-00000001, is intact; free disk space" in msg and "--resume" in msg
    monkeypatch.undo()
    assert [p.name for p in manager.root.iterdir()] == [good.name]  # no temp dir left behind
    fresh, fresh_engine = _engine(seed=3)
    assert load_checkpoint(good, fresh, fresh_engine).data_state == {"pos": 1}
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), good_weights))

    real_rename = os.rename

    def rename(src, dst):
        if str(src).startswith(str(manager.root / ".tmp-")):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="could not write checkpoint step-00000001 .*Input/output error"):
        manager.save(1, model, engine, data_state={"pos": 9})  # an overwrite whose publish fails
    monkeypatch.undo()
    assert [p.name for p in manager.root.iterdir()] == [good.name]
    assert load_checkpoint(good, restore_rng=False).data_state == {"pos": 1}


def test_overwrite_same_step_and_interrupted_overwrite_recovery(tmp_path):
    model, engine = _engine()
    manager = CheckpointManager(tmp_path)
    first = manager.save(5, model, engine, data_state={"v": 1})
    assert manager.save(5, model, engine, data_state={"v": 2}) == first
    assert load_checkpoint(first, restore_rng=False).data_state == {"v": 2}
    # a crash after moving the old copy aside but before publishing the new one: restored at start
    (manager.root / "step-00000005").rename(manager.root / ".trash-step-00000005")
    assert latest_checkpoint(tmp_path) is None
    cleanup_stale(manager.root)
    assert latest_checkpoint(tmp_path) == first


def test_incomplete_and_corrupted_checkpoints_are_refused(tmp_path):
    model, engine = _engine()
    path = CheckpointManager(tmp_path).save(1, model, engine)
    opt = path / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated files: optimizer.safetensors"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete polyrl checkpoint"):
        load_checkpoint(path)
    assert latest_checkpoint(tmp_path) is None  # no manifest: not listed

    other = CheckpointManager(tmp_path / "b").save(1, tiny_lm(hidden=16, heads=2), None)
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(other, model)
    with pytest.raises(CheckpointError, match="weights only"):
        load_checkpoint(other, tiny_lm(hidden=16, heads=2), engine)


def test_moe_checkpoint_resumes_from_its_per_expert_layout(tmp_path):
    """A checkpoint's model folder holds an MoE model's experts in the hub's per-expert layout (what every saved
    polyrl folder holds); resuming it read the file's names as they were and refused the checkpoint ("missing
    ...mlp.experts.gate_up_proj, unexpected ...mlp.experts.0.gate_proj.weight"): a full fine-tune of tiny-moe
    could not resume. The fused tensors are assembled from the expert matrices, bit-exact."""
    from polyrl.models.decoder import build_model
    from polyrl.models.presets import preset_config

    cfg = preset_config("tiny-moe")
    model = build_model(cfg, dtype=torch.float32, seed=0)
    engine = TrainEngine(model, OptimConfig(lr=1e-2), ScheduleConfig(), PrecisionConfig("fp32"), total_steps=4)
    path = CheckpointManager(tmp_path).save(1, model, engine)
    names = set(json.loads((path / "manifest.json").read_text())["files"])
    assert "model/model.safetensors" in names
    fresh = build_model(cfg, dtype=torch.float32, seed=1)
    fresh_engine = TrainEngine(fresh, OptimConfig(lr=1e-2), ScheduleConfig(), PrecisionConfig("fp32"), total_steps=4)
    assert load_checkpoint(path, fresh, fresh_engine).step == 1
    want, got = model.state_dict(), fresh.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in got)
