"""``--teacher`` on GRPO and PPO: the per-token reverse-KL term is added to the task reward's advantage. With
``teacher_coef = 0`` the run equals the plain run exactly (the teacher still scores: ``distill/reverse_kl`` is
logged); with a positive coefficient the update changes."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.errors import ConfigError


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """The student with its logits scaled by 3: the same tokenizer, a different distribution."""
    from polyrl.models.checkpoint import load_model, load_tokenizer, save_model

    model = load_model(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    return save_model(model, tmp_path_factory.mktemp("teacher") / "t", tokenizer=load_tokenizer(tiny_model_dir))


def _run(algo, student, out, steps=2, **table):
    from polyrl import run as runner
    from polyrl.run import config

    raw = {
        "algo": algo,
        "model": str(student),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        algo: {
            "reward": "exact_match",
            "reward_workers": 0,
            "prompts_per_step": 2,
            "samples_per_prompt": 4,
            "max_new_tokens": 5,
            "rollouts_to_save": 0,
            **table,
        },
    }
    torch.set_num_threads(1)
    runner.run(config.build(raw))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


KEYS = ("loss", "grad_norm", "reward")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_teacher_coef_zero_is_the_plain_run_and_positive_changes_it(algo, tiny_model_dir, teacher_dir, tmp_path):
    plain = _run(algo, tiny_model_dir, tmp_path / "plain")
    zero = _run(algo, tiny_model_dir, tmp_path / "zero", teacher=str(teacher_dir), teacher_coef=0.0)
    one = _run(algo, tiny_model_dir, tmp_path / "one", steps=1, teacher=str(teacher_dir), teacher_coef=1.0)
    for p, z in zip(plain, zero):
        assert {k: p[k] for k in KEYS} == {k: z[k] for k in KEYS}  # bit-identical updates
        assert "distill/reverse_kl" not in p
    for r in zero + one:  # the teacher is 3x sharper than the student: a clearly positive reverse KL
        assert 0.05 < r["distill/reverse_kl"] < 10.0 and r["distill/teacher_logprob"] < 0
    # step 1 samples the same tokens (same weights, same seeds) and so gets the same rewards and KL; the update
    # (loss and its gradient) differs by the teacher's term
    assert one[0]["reward"] == plain[0]["reward"]
    assert one[0]["distill/reverse_kl"] == pytest.approx(zero[0]["distill/reverse_kl"], abs=1e-6)
    assert one[0]["grad_norm"] != pytest.approx(plain[0]["grad_norm"], rel=1e-3)


def test_teacher_config_errors(teacher_dir, tmp_path):
    from polyrl.algorithms.grpo import GRPOConfig
    from polyrl.algorithms.ppo import PPOConfig

    with pytest.raises(ConfigError, match="both set"):
        GRPOConfig(teacher=str(teacher_dir), teacher_url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="ppo.teacher=.*no config.json"):
        PPOConfig(teacher=str(tmp_path))
    with pytest.raises(ConfigError, match="temperature must be 1.0 with a teacher"):
        GRPOConfig(teacher=str(teacher_dir), temperature=0.8)
    with pytest.raises(ConfigError, match="teacher_coef must be >= 0"):
        GRPOConfig(teacher=str(teacher_dir), teacher_coef=-1.0)
    with pytest.raises(ConfigError, match="must start with http"):
        GRPOConfig(teacher_url="localhost:8000")
    assert GRPOConfig(teacher=str(teacher_dir)).teacher_coef == 1.0


def test_teacher_flags_set_the_algorithm_table():
    import argparse

    from polyrl.cli import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    argv = ["--algo", "grpo", "--model", "m", "--data", "d", "--out", "o", "--teacher-url", "http://h:1"]
    args = parser.parse_args([*argv, "--teacher-coef", "0.5"])
    got = train.overrides_from_args(args)
    assert ("grpo.teacher_url", "http://h:1") in got and ("grpo.teacher_coef", 0.5) in got
