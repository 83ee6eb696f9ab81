"""Every ``examples/*.toml`` builds into a valid ``RunConfig`` (all tables and keys known, every value valid), with
its model pointed at a stub folder holding a ``config.json``: the examples cannot rot as settings move. GRPO and
GSPO examples are one table name apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import polyrl.agents  # noqa: F401 - registers the [agent] table into run, as the CLI does
from polyrl.run import config as rc

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.toml"))


@pytest.fixture(scope="module")
def stub_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stub") / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def test_the_examples_are_there():
    names = {p.stem for p in EXAMPLES}
    assert {"sft_arithmetic", "dpo_arithmetic", "grpo_arithmetic", "gspo_arithmetic", "ppo_arithmetic"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_builds_into_a_run_config(path, stub_model, tmp_path):
    raw = rc.load_file(path)
    cfg = rc.build({**raw, "model": str(stub_model), "out": str(tmp_path / "out")})
    assert cfg.algo == raw.get("algo", "sft")
    table = raw.get(cfg.algo)
    if table is not None:  # the file's algorithm table reached the algorithm's config unchanged
        for key, value in table.items():
            assert getattr(cfg.algo_config, key) == value, (path.name, key)


def test_gspo_example_is_grpo_with_gspo_clipping():
    grpo = rc.load_file(EXAMPLES[0].parent / "grpo_arithmetic.toml")
    gspo = rc.load_file(EXAMPLES[0].parent / "gspo_arithmetic.toml")
    assert {k for k in grpo if k not in ("algo", "out", "grpo")} == {
        k for k in gspo if k not in ("algo", "out", "gspo")
    }
    assert gspo["algo"] == "gspo" and gspo["gspo"]["clip_high"] < 1e-3 and gspo["gspo"]["loss_agg"] != "token-mean"
