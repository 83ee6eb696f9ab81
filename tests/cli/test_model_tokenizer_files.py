"""A model folder with weights but no tokenizer files (only config.json, weights and a chat template copied) given to
``generate`` / ``eval`` / ``serve``: one sentence saying the tokenizer files are missing. transformers builds an
empty tokenizer from config.json alone, so these failed later with "the prompt is empty" (a prompt was given) or "no
prompt fits the context"."""

from __future__ import annotations

import shutil

import pytest

from polyrl.cli.main import main


@pytest.fixture
def no_tokenizer(tiny_model_dir, tmp_path):
    folder = tmp_path / "weights-only"
    shutil.copytree(tiny_model_dir, folder)
    removed = [p for p in folder.iterdir() if p.name.startswith("tokenizer")]
    assert removed, "the tiny preset should ship a tokenizer file"
    for p in removed:
        p.unlink()
    return folder


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "What is 57 + 2?", "--max-tokens", "2"],
        ["eval", "--data", "builtin:arithmetic@test", "--reward", "numeric", "--n", "1"],
        ["serve", "--port", "0"],
    ],
    ids=["generate", "eval", "serve"],
)
def test_a_folder_without_tokenizer_files_is_named(argv, no_tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main([argv[0], "--model", str(no_tokenizer), *argv[1:]])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"--model {no_tokenizer} has no tokenizer files (tokenizer.json" in err, err
    assert "prompt is empty" not in err and "no prompt fits" not in err


def test_a_folder_with_its_tokenizer_still_generates(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "2", "--seed", "0"]) == 0
    assert "[2 tokens, finish=length]" in capsys.readouterr().out
