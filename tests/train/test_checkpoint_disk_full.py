"""A full disk while ``polyrl train`` saves a checkpoint: the run stops with one clear error (exit 2, no traceback)
naming the step, the OS error and the previous checkpoint, leaves no partial folder, and ``--resume`` continues from
the previous checkpoint once there is space."""

from __future__ import annotations

import errno
import json
import os

from polyrl.cli.main import main
from polyrl.train import checkpoint

ARGS = ["--data", "builtin:arithmetic?n=64", "--max-steps", "4", "--save-every", "2", "--micro-batch-tokens", "512"]
ARGS += ["--max-seq-len", "64", "--log-every", "10", "--deterministic"]


def test_a_full_disk_on_save_stops_the_run_clearly_and_resume_continues(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_save_file = checkpoint.save_file

    def disk_full(tensors, path, *args, **kwargs):
        if "step-00000004" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    argv = ["train", "--model", str(tiny_model_dir), "--out", str(out), *ARGS]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not write checkpoint step-00000004 in ") and "Traceback" not in err
    assert "No space left on device" in err and "step-00000002, is intact" in err and "--resume" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    assert json.loads((out / "summary.json").read_text())["status"] == "failed: CheckpointError"
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from_step"] == 2


def test_a_full_disk_on_a_lora_checkpoint_or_the_final_folder(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A LoRA run writes its adapter through ``save_adapter`` (the checkpoint's ``model/``, then ``final/``): the same
    clear error for either, nothing half-written left, and ``--resume`` finishes the run once there is space."""
    from polyrl.models import hf_io

    out = tmp_path / "run"
    real_save_file = hf_io.save_file

    def full_disk_at(word):
        def save_file(tensors, path, *args, **kwargs):
            if word in path:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            return real_save_file(tensors, path, *args, **kwargs)

        return save_file

    argv = ["train", "--model", str(tiny_model_dir), "--out", str(out), "--lora", "r=4", *ARGS]
    monkeypatch.setattr(hf_io, "save_file", full_disk_at("step-00000004"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not write checkpoint step-00000004 in ") and "No space left on device" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    monkeypatch.setattr(hf_io, "save_file", full_disk_at(".final.tmp-"))
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: could not write the model folder {out / 'final'}: No space left on device")
    assert "nothing was written there" in err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") or p.name == "final") == []
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    assert (out / "final" / "adapter_model.safetensors").is_file()
