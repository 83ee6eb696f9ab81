"""GRPO/GSPO runs end to end on the CPU through the same RunConfig + runner as ``polyrl train``: mean reward rises on
a toy task, reward-function failures (raise, hang, non-number) are counted and never stop the run, and a resumed run
reproduces the rewards and losses of an uninterrupted one exactly."""

from __future__ import annotations

import json

import pytest

REWARDS = '''
import os, time

def digits(completion, example):
    """Fraction of the completion's characters that are digits."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))

def has_digit(completion, example):
    """1 when the completion holds a digit: a random tiny model writes one in about a third of its samples."""
    return float(any(ch.isdigit() for ch in completion))

def flaky(completion, example):
    flag = os.path.join(os.path.dirname(__file__), "hung-once")
    if not os.path.exists(flag):
        open(flag, "w").close()
        time.sleep(30)  # hangs once: the 1 s timeout kills the worker
    h = sum(completion.encode()) % 5
    if h == 0:
        raise ValueError("bad completion")
    if h == 1:
        return "not a number"
    return {"reward": digits(completion, example), "length": len(completion)}
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "toy_rewards.py"
    path.write_text(REWARDS)
    return path


def _raw(model_dir, out, reward, algo="grpo", steps=4, save_every=0, **algo_kw):
    table = {
        "reward": reward,
        "reward_workers": 0,
        "prompts_per_step": 4,
        "samples_per_prompt": 4,
        "max_new_tokens": 4,
        "temperature": 1.0,
        **algo_kw,
    }
    return {
        "algo": algo,
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 5e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100},
        "checkpoint": {"every_n_steps": save_every, "keep_last_k": 0, "save_final": save_every > 0},
        algo: table,
    }


def _run(raw):
    from polyrl import run as runner
    from polyrl.run import config

    return runner.run(config.build(raw))


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_raises_mean_reward_on_toy_task(tiny_model_dir, tmp_path, reward_file):
    out = tmp_path / "grpo"
    # random tiny model: about a third of its 4-token samples hold a digit; a high lr makes the toy task fast
    # (seeds 0, 1, 2 measured: first three steps 0.35-0.42, last three 0.98-1.0)
    summary = _run(_raw(tiny_model_dir, out, f"{reward_file}:has_digit", steps=10))
    recs = _records(out)
    first = sum(r["reward"] for r in recs[:3]) / 3
    last = sum(r["reward"] for r in recs[-3:]) / 3
    assert first < 0.5 and last >= 0.9 and last > first + 0.45, (first, last)
    assert summary["status"] == "finished" and summary["steps"] == 10
    r = recs[0]
    keys = ("mismatch_mean", "mismatch_max", "entropy", "clip_fraction", "response_length", "rollout_s", "loss")
    for key in (*keys, "rollout_tokens_per_s"):
        assert key in r, key
    assert r["mismatch_max"] < 1e-3  # fp32 CPU: the rollout engine and the trainer agree
    assert r["clip_fraction"] == 0.0  # one optimizer step per batch: ratio 1 at the first step
    assert r["rollout_tokens_per_s"] == pytest.approx(16 * r["response_length"] / r["rollout_s"])
    assert (out / "final" / "config.json").is_file() and (out / "metrics.png").is_file()


def test_several_optimizer_steps_per_batch_move_the_ratio_and_clip(tiny_model_dir, tmp_path, reward_file):
    out = tmp_path / "ppo-epochs"
    _run(
        _raw(
            tiny_model_dir,
            out,
            f"{reward_file}:digits",
            steps=2,
            ppo_epochs=2,
            mini_batches=2,
            clip_low=0.01,
            clip_high=0.01,
            old_logprobs="recompute",
            kl_coef=0.1,
            loss_agg="seq-mean-token-mean",
        )
    )
    recs = _records(out)
    assert all(r["optimizer_steps"] == 4 * (i + 1) for i, r in enumerate(recs))
    assert max(r["clip_fraction_last"] for r in recs) > 0.0  # later optimizer steps see ratios outside 1 +- 0.01
    assert all(r["kl"] >= 0.0 for r in recs) and recs[-1]["kl_before"] > 0.0


def test_reward_failures_are_counted_and_do_not_stop_the_run(tiny_model_dir, tmp_path, reward_file):
    out = tmp_path / "flaky"
    raw = _raw(
        tiny_model_dir, out, f"{reward_file}:flaky", steps=2, reward_workers=2, reward_timeout=1.0, failure_reward=-1.0
    )
    summary = _run(raw)
    assert summary["status"] == "finished" and summary["steps"] == 2
    fails = summary["reward_failures"]
    assert fails["timeout"] >= 1 and fails["error"] >= 1 and fails["non_number"] >= 1
    recs = _records(out)
    assert recs[-1]["reward_failures_total"] == sum(fails.values())
    assert "reward/length" in recs[0]


def test_resume_reproduces_rewards_and_losses_exactly(tiny_model_dir, tmp_path, reward_file):
    full = tmp_path / "full"
    _run(_raw(tiny_model_dir, full, f"{reward_file}:digits", algo="gspo", steps=3, save_every=2))
    resumed = tmp_path / "resumed"
    raw = _raw(tiny_model_dir, resumed, f"{reward_file}:digits", algo="gspo", steps=3, save_every=2)
    raw["resume"] = str(full / "checkpoints" / "step-00000002")
    summary = _run(raw)
    assert summary["resumed_from_step"] == 2
    a, b = _records(full)[2:], _records(resumed)
    assert [r["step"] for r in b] == [3]
    for key in ("reward", "loss", "grad_norm", "response_length", "mismatch_max"):
        assert [r[key] for r in a] == [r[key] for r in b], key


def test_training_forward_measures_what_the_separate_pass_measures(tiny_model_dir):
    """The single-pass path (no no-grad pass before the update) reports the same mismatch and entropy."""
    import torch

    from polyrl.algorithms.advantages import group_advantages
    from polyrl.algorithms.grpo import GRPOConfig, make_policy_loss
    from polyrl.infer import SamplingParams
    from polyrl.train import OptimConfig, StepConfig
    from polyrl.trainer import Trainer

    tr = Trainer(model=str(tiny_model_dir), optim=OptimConfig(lr=1e-3), engine=StepConfig(micro_batch_tokens=64))
    samples = tr.rollout_batch(
        [[5, 6, 7], [9, 10]], n=4, sampling=SamplingParams(temperature=1.0, max_tokens=5), seeds=[1, 2]
    )
    lps, ents = tr.logprobs(samples, 1.0, entropy=True)
    diffs = torch.cat([(torch.tensor(s.logprobs) - lp).abs() for s, lp in zip(samples, lps)])
    adv = group_advantages([float(len(s.text)) for s in samples], [s.group for s in samples])
    rollout = [s.logprobs for s in samples]
    batches = tr.make_batch(samples, {"adv": adv, "old_logp": rollout, "rollout_logp": rollout}, max_tokens=24)
    assert len(batches) > 1  # several micro-batches: the max and the sums accumulate across them
    tokens = float(sum(b.num_target_tokens for b in batches))
    loss_fn = make_policy_loss(GRPOConfig(), tokens, tokens, measure=True)
    stats = tr.train(batches, loss_fn, normalizer=tokens).to_dict()
    assert stats["mismatch_mean"] == pytest.approx(float(diffs.mean()), abs=1e-6)
    assert float(loss_fn.mismatch_max) == pytest.approx(float(diffs.max()), abs=1e-6)
    assert stats["entropy"] == pytest.approx(float(torch.cat(ents).mean()), rel=1e-5)
