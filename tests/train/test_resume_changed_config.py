"""``--resume`` with settings that changed since the checkpoint: what makes another model is refused before a step
runs, saying what the checkpoint holds and the flags that resume it (a LoRA adapter's rank, targets and scale; a full
fine-tune resumed as LoRA; another --model); what only steers training (lr, LoRA dropout) is taken and listed."""

from __future__ import annotations

import json
import shutil

import pytest

from polyrl.cli.main import main

ARGS = ["--data", "builtin:arithmetic?n=64", "--micro-batch-tokens", "512", "--max-seq-len", "64", "--log-every", "10"]


def _resume(run, tmp_path, name, *flags):
    out = tmp_path / name
    shutil.copytree(run, out)
    return main(["train", "--out", str(out), "--resume", "--max-steps", "3", *ARGS, *flags]), out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """A LoRA run (r=4, alpha=8, q and v) and a full fine-tune of the tiny model, 2 steps each."""
    root = tmp_path_factory.mktemp("changed")
    base = ["train", "--model", str(tiny_model_dir), "--max-steps", "2", *ARGS]
    assert main([*base, "--out", str(root / "lora"), "--lora", "r=4,alpha=8,targets=q,v"]) == 0
    assert main([*base, "--out", str(root / "full")]) == 0
    return root


def test_a_lora_resume_keeps_rank_targets_and_scale(runs, tiny_model_dir, tmp_path, capsys):
    model = ["--model", str(tiny_model_dir)]
    for i, lora in enumerate(["r=4,alpha=16,targets=q,v", "r=4,alpha=8,targets=q,v,rslora=true", "r=8,targets=q,v"]):
        rc, _ = _resume(runs / "lora", tmp_path, f"bad{i}", *model, "--lora", lora)
        assert rc == 2, lora
        err = capsys.readouterr().err
        assert "does not match this model's adapters" in err and "an adapter keeps its rank, targets and scale" in err
        assert "(r=4,alpha=8,targets=q_proj,v_proj; scale 2)" in err
        assert "resume with --lora r=4,alpha=8,targets=q_proj,v_proj (or the same [lora] table)" in err
    # the named flags resume it; dropout only steers training: taken, and listed as changed
    rc, out = _resume(runs / "lora", tmp_path, "ok", *model, "--lora", "r=4,alpha=8,targets=q_proj,v_proj,dropout=0.1")
    assert rc == 0
    assert "at step 2 (changed since: lora.dropout, out, train.max_steps)" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2


def test_a_full_fine_tune_resumed_as_lora_or_on_another_model_says_so(runs, tiny_model_dir, tmp_path, capsys):
    rc, _ = _resume(runs / "full", tmp_path, "as_lora", "--model", str(tiny_model_dir), "--lora", "r=4")
    assert rc == 2
    err = capsys.readouterr().err
    assert "holds a whole model's weights (a full fine-tune's checkpoint), but this run trains a LoRA adapter" in err
    assert "resume it without --lora / --qlora / [lora]" in err
    other = tmp_path / "wider"
    assert main(["init-model", "--preset", "small", "--out", str(other)]) == 0
    rc, _ = _resume(runs / "full", tmp_path, "other", "--model", str(other))
    assert rc == 2
    err = capsys.readouterr().err
    assert "do not match the model" in err
    assert f"this checkpoint was written by a run of --model {tiny_model_dir}" in err
