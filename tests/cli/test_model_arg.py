"""``polyrl generate`` / ``polyrl serve`` given a PEFT adapter folder as ``--model`` name its base and the command that
runs it (``serve --lora``, ``export --merge``), before anything loads."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main
from polyrl.cli.model_arg import adapter_base


def _adapter(folder, base="runs/small"):
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    if base is not None:
        config["base_model_name_or_path"] = base
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_generate_names_the_merge_command(tmp_path, monkeypatch, capsys):
    _adapter(tmp_path / "runs" / "lora" / "final")
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "runs/lora/final", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: --model runs/lora/final is a PEFT adapter folder (LoRA adapters on the base runs/small)"
    )
    assert "`polyrl export --adapter runs/lora/final --merge --out runs/lora-merged`" in err
    assert "config.json not found" not in err


def test_serve_names_the_base_with_lora(tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastapi", reason='the serve extra: pip install -e ".[serve]"')
    _adapter(tmp_path / "adapters" / "math")
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--model", "adapters/math", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "`polyrl serve --model runs/small --lora NAME=adapters/math`" in err
    assert "--merge --out adapters/math-merged`" in err


def test_an_adapter_without_a_base_says_base(tmp_path):
    assert adapter_base(_adapter(tmp_path / "a", base=None)) == "BASE"
    assert adapter_base(_adapter(tmp_path / "b", base="Qwen/Qwen3-0.6B")) == "Qwen/Qwen3-0.6B"


@pytest.mark.parametrize("given", ["final", "./final", "."])
def test_merge_folder_of_a_relative_final_is_a_real_folder(tmp_path, monkeypatch, capsys, given):
    run = tmp_path / "runs" / "lora"
    _adapter(run / "final")
    monkeypatch.chdir(run if given != "." else run / "final")
    assert main(["generate", "--model", given, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    # not ".-merged" (a hidden-looking folder named after the current directory's '.')
    assert f"--merge --out {run}-merged`" in err
