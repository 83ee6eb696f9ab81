"""Evaluation during RL (``train.eval_every``) for every online algorithm on the CPU with the tiny preset: a GRPO run
with ``eval_n`` > 1 carries the sampled mean reward, unbiased pass@k (monotone in k, pass@1 = the mean of a 0/1
reward) and mean length beside the greedy eval reward; PPO, GSPO and distillation runs log the eval metrics at the
eval steps only (every N steps and the last), in range, and the last step's greedy ``eval_reward`` equals a direct
greedy evaluation of the final model (``polyrl.eval.rewards.reward_eval``) on the same prompts."""

from __future__ import annotations

import json

import pytest
import torch

REWARD = "def has_digit(completion, example):\n    return float(any(ch.isdigit() for ch in completion))\n"
# a reward in [0, 1] that depends on every character of the completion: equal mean rewards mean equal completions
TEXT_CODE = "def text_code(completion, example):\n    return (sum(map(ord, completion)) % 101) / 100\n"
EVAL_DATA = "builtin:arithmetic?max=9&n=16"


def _raw(algo, model_dir, out, reward, steps, eval_every, **table):
    table = {
        "reward": reward,
        "reward_workers": 0,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "max_new_tokens": 6,
        "eval_prompts": 6,
        **table,
    }
    return {
        "algo": algo,
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": steps, "log_every": 100, "eval_every": eval_every, "eval_data": EVAL_DATA},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        algo: table,
    }


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory):
    """The tiny model with its attention and MLP outputs scaled up 30x: a random tiny model with tied embeddings
    greedily repeats the prompt's last token ("\\n" six times for every prompt); this one's greedy completions differ
    from prompt to prompt."""
    from polyrl.models.checkpoint import load_model, load_tokenizer, save_model
    from polyrl.models.presets import create_model_from_preset

    src = create_model_from_preset("tiny", tmp_path_factory.mktemp("lively") / "random", seed=0)
    model = load_model(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(30.0)
            layer.self_attn.o_proj.weight.mul_(30.0)
    return save_model(model, src.parent / "lively", tokenizer=load_tokenizer(src))


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_eval_n_reports_pass_at_k(tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config

    torch.set_num_threads(1)
    (tmp_path / "r.py").write_text(REWARD)
    out = tmp_path / "grpo"
    raw = _raw("grpo", tiny_model_dir, out, f"{tmp_path / 'r.py'}:has_digit", 1, 1, eval_n=4)
    raw["train"]["eval_data"] = None  # the builtin's @test part
    runner.run(config.build(raw))
    (rec,) = _records(out)
    assert "eval_reward" in rec  # the greedy evaluation is still there
    p1, p2, p4 = rec["eval_pass@1"], rec["eval_pass@2"], rec["eval_pass@4"]
    assert 0 < p1 < 1 and p1 <= p2 <= p4 <= 1  # a random tiny model writes a digit in some samples
    assert p1 == rec["eval_sampled_reward"]  # 0/1 rewards: pass@1 is the mean reward
    assert 0 < rec["eval_length"] <= 6


@pytest.mark.parametrize("algo", ["ppo", "gspo", "distill"])
def test_eval_during_training_every_algorithm(algo, lively_model_dir, tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.eval.loading import eval_engine, load_eval_model
    from polyrl.eval.rewards import reward_eval
    from polyrl.run import config

    torch.set_num_threads(1)
    (tmp_path / "r.py").write_text(TEXT_CODE)
    reward = f"{tmp_path / 'r.py'}:text_code"
    extra = {"ppo": {"critic_lr": 3e-3}, "gspo": {}, "distill": {"teacher": str(tiny_model_dir), "reward_coef": 1.0}}
    out = tmp_path / algo
    runner.run(
        config.build(_raw(algo, lively_model_dir, out, reward, 3, 2, eval_n=2, eval_pass_threshold=0.5, **extra[algo]))
    )
    recs = _records(out)
    assert [r["step"] for r in recs] == [1, 2, 3]
    keys = ("eval_reward", "eval_accuracy", "eval_sampled_reward", "eval_pass@1", "eval_pass@2", "eval_length")
    for r in recs:
        if r["step"] == 1:  # not an eval step
            assert not any(k in r for k in keys)
            continue
        assert all(k in r for k in keys), r  # every 2 steps and the last
        assert all(0.0 <= r[k] <= 1.0 for k in keys[:-1])
        assert r["eval_pass@1"] <= r["eval_pass@2"] and 0 < r["eval_length"] <= 6

    # the last evaluation saw the final weights: a direct greedy evaluation of the final model agrees
    model, tok = load_eval_model(out / "final", "float32", "cpu")
    got = reward_eval(eval_engine(model, tok), EVAL_DATA, reward, n=1, max_tokens=6, limit=6, workers=0, keep_samples=6)
    assert got.num_prompts == 6 and len({x["reward"] for x in got.samples}) > 1  # not one repeated completion
    assert recs[-1]["eval_reward"] == pytest.approx(got.mean_reward)
