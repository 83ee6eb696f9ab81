"""``polyrl export --merge`` given the wrong folders: an ``--out`` that is (or holds) the adapter or the base it
reads is refused before anything is written (it replaced them: the adapter merged into itself was gone); a full
model or a training checkpoint given as ``--adapter`` says what it is and what to give instead."""

from __future__ import annotations

import shutil

import pytest
import torch

from polyrl.cli.main import main
from polyrl.models.checkpoint import load_model
from polyrl.models.lora import LoraConfig, adapter_parameters, load_lora_model, save_adapter
from polyrl.train.checkpoint import save_checkpoint


@pytest.fixture
def workdir(tiny_model_dir, tmp_path, monkeypatch):
    """``<tmp>/models/tiny`` (the base), ``<tmp>/runs/lora`` (an adapter on it), cwd ``<tmp>``; returns the model."""
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    model = load_lora_model("models/tiny", LoraConfig(r=4, alpha=8, targets=["q", "v"]), torch.float32)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.normal_(0, 0.1)
    save_adapter(model, "runs/lora")
    return model


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_out_that_is_or_holds_an_input_is_refused(workdir, tmp_path, capsys):
    adapter, base = tmp_path / "runs" / "lora", tmp_path / "models" / "tiny"
    before = {adapter: _files(adapter), base: _files(base)}
    assert main(["export", "--adapter", "runs/lora", "--merge", "--out", "runs/lora"]) == 2
    err = capsys.readouterr().err
    assert "--out runs/lora is the adapter folder runs/lora, which the export would replace" in err
    assert "give another --out, e.g. runs/lora-merged" in err
    assert main(["export", "--adapter", "runs/lora", "--merge", "--out", "models/tiny"]) == 2
    assert "--out models/tiny is the base folder models/tiny" in capsys.readouterr().err
    shutil.copytree(adapter, base / "adapters" / "a")  # an adapter kept inside its base's folder
    assert main(["export", "--adapter", "models/tiny/adapters/a", "--merge", "--out", "models/tiny"]) == 2
    assert "--out models/tiny holds the adapter folder models/tiny/adapters/a" in capsys.readouterr().err
    assert (
        main(["export", "--adapter", "runs/lora", "--base", "runs/../models/tiny", "--merge", "--out", str(base)]) == 2
    )
    assert "is the base folder runs/../models/tiny" in capsys.readouterr().err  # the same folder, spelt otherwise
    shutil.rmtree(base / "adapters")
    assert {adapter: _files(adapter), base: _files(base)} == before  # nothing was replaced
    # a new folder inside the adapter's is no input: written, and the adapter still loads
    assert main(["export", "--adapter", "runs/lora", "--merge", "--out", "runs/lora/merged"]) == 0
    assert (adapter / "merged" / "model.safetensors").is_file()
    load_lora_model(adapter, None, torch.float32)


def test_a_full_model_or_a_checkpoint_as_adapter_says_what_to_give(workdir, tmp_path, capsys):
    assert main(["export", "--adapter", "models/tiny", "--merge", "--out", "merged"]) == 2
    err = capsys.readouterr().err
    assert "models/tiny is a whole model (config.json, no adapter): a full fine-tune has nothing to merge" in err
    assert "polyrl serve --model models/tiny" in err
    ckpt = save_checkpoint("runs/ckpts", 3, workdir)  # a LoRA run's checkpoint: the adapter is its model/
    assert main(["export", "--adapter", str(ckpt), "--merge", "--out", "merged"]) == 2
    err = capsys.readouterr().err
    assert f"it is a polyrl checkpoint of a LoRA run; its adapter is --adapter {ckpt / 'model'}" in err
    assert main(["export", "--adapter", str(ckpt / "model"), "--merge", "--out", "merged"]) == 0
    full_ckpt = save_checkpoint("runs/full", 2, load_model("models/tiny"))
    assert main(["export", "--adapter", str(full_ckpt), "--merge", "--out", "merged2"]) == 2
    assert "a polyrl checkpoint of a full fine-tune" in capsys.readouterr().err


def test_an_out_under_a_file_is_refused_before_the_model_loads(workdir, tmp_path, capsys, monkeypatch):
    """--out a-file/merged failed only when the merged model was written (a FileExistsError traceback after loading
    and merging the base); it is refused first, as init-model's is."""
    import polyrl.cli.export as export_cli

    (tmp_path / "a-file").write_text("x")
    monkeypatch.setattr(export_cli, "load_model", lambda *a, **k: pytest.fail("the base was loaded"))
    assert main(["export", "--adapter", "runs/lora", "--merge", "--out", "a-file/merged"]) == 2
    err = capsys.readouterr().err
    assert f"error: --out 'a-file/merged' cannot be made: {tmp_path / 'a-file'} is a file, not a folder" in err
    assert main(["init-model", "--preset", "tiny", "--out", "a-file/m"]) == 2
    assert "--out 'a-file/m' cannot be made" in capsys.readouterr().err
    assert main(["export", "--adapter", "runs/lora", "--merge", "--out", "a-file"]) == 2
    assert "error: --out 'a-file' is a file; give a folder" in capsys.readouterr().err
