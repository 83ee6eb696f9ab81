"""``polyrl.trainer.fit``: every algorithm through the Python API, the same run as ``polyrl train`` (outputs,
summary, metrics), with tables given as dicts or config dataclasses, and errors that name the setting."""

from __future__ import annotations

import json

import pytest

from polyrl.errors import ConfigError
from polyrl.train import OptimConfig
from polyrl.trainer import fit


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_through_fit_raises_the_reward_margin(tiny_model_dir, tmp_path):
    out = tmp_path / "dpo"
    summary = fit(
        "dpo",
        model=tiny_model_dir,
        data={"path": "builtin:arithmetic-pref?max=9&n=32", "max_seq_len": 64},
        out=out,
        optim=OptimConfig(lr=2e-3, weight_decay=0.0),  # a dataclass works as well as a dict
        engine={"micro_batch_tokens": 512},
        schedule={"decay": "constant"},
        train={"max_steps": 8, "log_every": 100, "save_final_model": False},
        dpo={"beta": 0.5},
    )
    recs = _records(out)
    assert summary["status"] == "finished" and summary["algo"] == "dpo" and len(recs) == 8
    assert recs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2 at the reference
    assert sum(r["rewards/margins"] for r in recs[-3:]) / 3 > 0.1 and recs[-1]["loss"] < 0.6


def test_ppo_through_fit_trains_critic_then_policy(tiny_model_dir, tmp_path):
    out = tmp_path / "ppo"
    summary = fit(
        "ppo",
        model=str(tiny_model_dir),
        data="builtin:arithmetic?max=9&n=64",
        out=out,
        seed=3,
        optim={"lr": 2e-3},
        train={"max_steps": 3, "log_every": 100},
        ppo={"reward": "exact_match", "reward_workers": 0, "prompts_per_step": 2, "samples_per_prompt": 2,
             "max_new_tokens": 4, "critic_warmup_steps": 1},
    )  # fmt: skip
    recs = _records(out)
    assert summary["status"] == "finished" and summary["algo"] == "ppo"
    assert [r["policy_updated"] for r in recs] == [0.0, 1.0, 1.0]
    assert all("value_loss" in r for r in recs) and (out / "critic" / "final" / "config.json").is_file()
    assert json.loads((out / "run_config.json").read_text())["seed"] == 3


def test_fit_errors_name_the_setting(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown setting"):
        fit("sft", model=tiny_model_dir, data="builtin:arithmetic", out=tmp_path / "a", optimizer={"lr": 1})
    with pytest.raises(ConfigError, match="must be a dict or a config dataclass"):
        fit("sft", model=tiny_model_dir, data="builtin:arithmetic", out=tmp_path / "b", optim=0.1)
    with pytest.raises(ConfigError, match="grpo.temperature"):
        fit("grpo", model=tiny_model_dir, data="builtin:arithmetic", out=tmp_path / "c", grpo={"temperature": 0})
