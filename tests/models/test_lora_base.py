"""Where an adapter's base model is: ``adapter_config.json`` keeps the base as the user passed it (a relative path
stays relative), ``base_model_path`` finds it from the current directory or beside the adapter folder, a base that
moved is refused naming what was looked for and ``--base``, and ``--base`` / ``lora.base`` repoint it for
``polyrl export``, ``polyrl train`` and ``load_lora_model``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_helpers import logits, packed

from polyrl.cli.main import main
from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.lora import (
    LoraConfig,
    adapter_parameters,
    base_model_path,
    load_adapter,
    load_lora_model,
    read_adapter_config,
    save_adapter,
)
from polyrl.run import config as rc

LENS = [5, 9]


@pytest.fixture
def workdir(tiny_model_dir, tmp_path, monkeypatch):
    """A copy of the tiny base at ``<tmp>/models/tiny``, the current directory ``<tmp>``, and an adapter trained
    on it as the user would have named it: ``models/tiny`` (relative), saved to ``<tmp>/runs/lora``."""
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    model = load_lora_model("models/tiny", LoraConfig(r=4, alpha=8), torch.float32)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    save_adapter(model, "runs/lora")
    return tmp_path


def test_the_base_is_stored_as_given_and_found_from_the_cwd(workdir):
    d = json.loads((workdir / "runs/lora/adapter_config.json").read_text())
    assert d["base_model_name_or_path"] == "models/tiny"  # not /tmp/.../models/tiny of this machine
    assert base_model_path("runs/lora") == "models/tiny"
    model = load_lora_model("runs/lora", None, torch.float32)
    assert model.lora_base == "models/tiny"  # a run continuing from it saves the same string again


def test_a_relative_base_is_found_beside_the_adapter_folder(workdir, tmp_path_factory, monkeypatch):
    # the adapter and its base shipped together: <bundle>/runs/lora + <bundle>/runs/models/tiny, read from elsewhere
    shutil.move(str(workdir / "models"), str(workdir / "runs" / "models"))
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    adapter = workdir / "runs" / "lora"
    assert base_model_path(adapter) == str(workdir / "runs" / "models" / "tiny")
    load_lora_model(adapter, None, torch.float32)


def test_a_moved_base_is_refused_naming_it_and_base_repoints_it(workdir):
    ids, pos, meta = packed(LENS, 512, seed=4)
    want = logits(load_lora_model("runs/lora", None, torch.float32), ids, pos, meta)
    (workdir / "models" / "tiny").rename(workdir / "models" / "tiny-moved")

    with pytest.raises(CheckpointError) as err:
        load_lora_model("runs/lora", None, torch.float32)
    msg = str(err.value)
    assert "'models/tiny'" in msg and "runs/models/tiny" in msg and "--base" in msg, msg

    model = load_lora_model("runs/lora", LoraConfig(base="models/tiny-moved"), torch.float32)
    assert model.lora_base == "models/tiny-moved"
    torch.testing.assert_close(logits(model, ids, pos, meta), want)
    with pytest.raises(CheckpointError, match="--base models/nope: no config.json"):
        base_model_path("runs/lora", "models/nope")


def test_export_refuses_a_moved_base_and_takes_base(workdir, capsys):
    (workdir / "models" / "tiny").rename(workdir / "models" / "tiny-moved")
    assert main(["export", "--adapter", "runs/lora", "--merge", "--out", "merged"]) == 2
    assert "--base" in capsys.readouterr().err
    assert main(["export", "--adapter", "runs/lora", "--merge", "--out", "merged", "--base", "models/tiny-moved"]) == 0
    assert (workdir / "merged" / "config.json").is_file()
    assert (
        main(["export", "--adapter", "runs/lora", "--merge", "--out", "merged2", "--model", "models/tiny-moved"]) == 0
    )


def test_train_config_takes_base_for_an_adapter_only(workdir):
    (workdir / "models" / "tiny").rename(workdir / "models" / "tiny-moved")
    raw = {"algo": "sft", "model": "runs/lora", "data": {"path": "builtin:arithmetic?n=8"}, "out": "runs/sft"}
    with pytest.raises(CheckpointError, match="--base"):
        rc.build(raw)
    cfg = rc.build({**raw, "lora": {"base": "models/tiny-moved"}})
    assert cfg.lora.base == "models/tiny-moved" and cfg.lora.r == 4  # r from the adapter, base from the user
    with pytest.raises(ConfigError, match="drop --base"):
        rc.build({**raw, "model": "models/tiny-moved", "lora": {"base": "models/tiny-moved"}})


def test_train_from_an_adapter_with_a_moved_base(workdir):
    (workdir / "models" / "tiny").rename(workdir / "models" / "tiny-moved")
    argv = ["train", "--model", "runs/lora", "--data", "builtin:arithmetic?n=16", "--out", "runs/more"]
    argv += ["--max-steps", "1", "--micro-batch-tokens", "256", "--max-seq-len", "64", "--save-every", "0"]
    assert main([*argv, "--base", "models/tiny-moved"]) == 0
    cfg, base = read_adapter_config(workdir / "runs/more/final")
    assert base == "models/tiny-moved" and cfg.r == 4


def test_peft_reads_the_base_as_given(workdir):
    peft = pytest.importorskip("peft")
    assert peft.PeftConfig.from_pretrained("runs/lora").base_model_name_or_path == "models/tiny"


def test_an_adapter_on_a_base_of_another_width_names_its_base(workdir, tiny_model):
    """The same layers and targets but another hidden size (a wrong --base): the shape error says which adapter, that
    it may be for another base, and the base it was trained on (it said only 'shape (4, 64) != model (4, 96)')."""
    wider = tiny_model("qwen3", hidden_size=96, num_attention_heads=6)
    match = "adapter runs/lora does not fit this model: model.layers.0.self_attn.q_proj.lora_A.weight has shape"
    with pytest.raises(
        CheckpointError, match=match + r".*another base model\? \(its adapter_config.json names 'models/tiny'"
    ):
        load_adapter(wider, "runs/lora")
