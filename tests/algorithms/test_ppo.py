"""PPO: the value loss in each clipping region, the policy loss is the shared clip math, config errors, the critic
(value head load/save, values of packed samples), and tiny end-to-end runs on the CPU (finite losses, the value loss
falls, critic warm-up, the KL penalty, exact resume of policy and critic)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from polyrl import run as runner
from polyrl.algorithms.losses import clipped_token_loss
from polyrl.algorithms.ppo import PPOConfig, explained_variance, make_policy_loss, make_value_loss, value_loss
from polyrl.algorithms.rl_batch import Sample, pack_samples
from polyrl.errors import ConfigError
from polyrl.run import config as rc


# ---- losses -------------------------------------------------------------------------------------
def test_value_loss_clipping_regions():
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    ret = torch.tensor([1.0, 1.0, -1.0, 0.05, 1.0])
    v = torch.tensor([0.5, 0.1, 0.5, 0.5, 1.0], requires_grad=True)
    loss, clipped = value_loss(v, old, ret, clip=0.2)
    # 0: V moved 0.5 toward R (clip to 0.2): clipped error 0.8^2 > 0.5^2 -> clipped branch, no gradient
    # 1: inside the clip range: both branches equal (0.9^2), not clipped
    # 2: V moved 0.5 away from R: unclipped error 1.5^2 > clipped 1.2^2 -> unclipped, gradient flows
    # 3: V overshot R: clipped V = 0.2, error 0.15^2 < 0.45^2 -> unclipped
    # 4: V == V_old == R: zero
    want = [0.5 * 0.8**2, 0.5 * 0.9**2, 0.5 * 1.5**2, 0.5 * 0.45**2, 0.0]
    assert loss.tolist() == pytest.approx(want, rel=1e-6, abs=1e-8)
    assert clipped.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    loss.sum().backward()
    assert v.grad.tolist() == pytest.approx([0.0, -0.9, 1.5, 0.45, 0.0], abs=1e-6)
    unclipped, none = value_loss(v.detach(), old, ret, clip=None)
    assert unclipped.tolist() == pytest.approx([0.5 * x**2 for x in (0.5, 0.9, 1.5, 0.45, 0.0)], rel=1e-6)
    assert none.sum() == 0


def _samples():
    return [
        Sample([3, 4, 5], [6, 7, 8], [-1.0, -2.0, -0.5], "stop", "", 0),
        Sample([3, 9], [10, 11], [-0.3, -1.2], "length", "", 1),
    ]


def test_policy_loss_is_the_shared_clip_math(tiny_model):
    from polyrl.algorithms.rl_batch import completion_logprobs

    model = tiny_model("qwen3", seed=3)
    samples = _samples()
    adv = [[1.0, -0.5, 2.0], [-1.0, 0.25]]
    old = [[-5.0, -4.2, -4.9], [-5.1, -4.6]]
    (batch,) = pack_samples(samples, {"adv": adv, "old_logp": old}, 64)
    cfg = PPOConfig(clip_low=0.1, clip_high=0.3, reward_workers=0, max_new_tokens=4)
    tokens = float(batch.num_target_tokens)
    loss, metrics = make_policy_loss(cfg, tokens, tokens)(model, batch)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, 1.0)
    sel = batch.mask > 0
    want, active, _ = clipped_token_loss(logp[sel], batch.fields["old_logp"][sel], batch.fields["adv"][sel], 0.1, 0.3)
    assert loss.item() == pytest.approx(want.sum().item(), rel=1e-5)
    assert metrics["clip_fraction"].item() == pytest.approx(active.sum().item(), rel=1e-6)
    # the ratios here are far from 1 (old log-probs are made up), so some tokens are clipped
    assert 0 < active.sum().item() < 5


def test_value_loss_fn_on_a_packed_batch(tiny_model, tiny_config):
    from polyrl.models.value_head import ValueModel, zero_head

    base = tiny_model("qwen3", seed=4)
    critic = ValueModel(tiny_config("qwen3"))
    critic.load_state_dict({**base.state_dict(), "score.weight": torch.zeros(1, 64), "score.bias": torch.zeros(1)})
    zero_head(critic)
    with torch.no_grad():
        critic.score.bias.fill_(0.5)  # every value is 0.5
    samples = _samples()
    fields = {"old_value": [[0.4, 0.4, 0.4], [0.0, 0.0]], "returns": [[1.0, 1.0, 1.0], [0.0, 0.0]]}
    (batch,) = pack_samples(samples, fields, 64)
    cfg = PPOConfig(value_clip=0.2, reward_workers=0)
    loss, m = make_value_loss(cfg, 5.0, 5.0)(critic, batch)
    # sample 0: V 0.5 within 0.2 of 0.4 -> 0.5 * 0.5^2 each; sample 1: V - V_old = 0.5 clipped to 0.2 ->
    # max(0.5^2, 0.2^2) = 0.25 -> 0.125 each
    assert loss.item() == pytest.approx(3 * 0.125 + 2 * 0.125, rel=1e-5)
    assert m["value_pred"].item() == pytest.approx(0.5 * 5, rel=1e-5) and m["value_clip_fraction"].item() == 0.0
    assert explained_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 1.0


def test_config_validation():
    assert PPOConfig(reward_workers=0).samples_per_prompt == 1
    for bad, match in [
        ({"gamma": 1.5}, r"ppo.gamma must be in \[0, 1\]"),
        ({"lam": -0.1}, r"ppo.lam must be in \[0, 1\]"),
        ({"value_clip": -0.1}, "value_clip must be >= 0"),
        ({"critic_lr": 0.0}, "critic_lr must be > 0"),
        ({"critic_warmup_steps": -1}, "critic_warmup_steps"),
        ({"kl_estimator": "k2"}, "kl_estimator"),
        ({"old_logprobs": "x"}, "old_logprobs"),
        ({"clip_low": 1.0}, "clip_low"),
    ]:
        with pytest.raises(ConfigError, match=match):
            PPOConfig(**bad)


# ---- the value model ----------------------------------------------------------------------------
def test_value_model_from_policy_and_save_round_trip(tiny_model_dir, tmp_path):
    from polyrl.models import AttnMetadata
    from polyrl.models.checkpoint import load_model
    from polyrl.models.value_head import load_value_model, save_value_model

    policy = load_model(tiny_model_dir)
    critic = load_value_model(tiny_model_dir)
    assert critic.lm_head is None and critic.score.weight.abs().sum() == 0
    ids = torch.tensor([5, 6, 7, 8])
    meta = AttnMetadata.from_seqlens([4], ids.device)
    with torch.no_grad():
        h_policy = policy(ids, torch.arange(4), meta)
        assert torch.equal(critic(ids, torch.arange(4), meta), h_policy)  # the policy's backbone
        assert critic.value(ids, torch.arange(4), meta).tolist() == [0.0] * 4
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.25)
        want = critic.value(ids, torch.arange(4), meta)
    out = save_value_model(critic, tmp_path / "critic", tokenizer=tiny_model_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForTokenClassification"] and cfg["num_labels"] == 1
    again = load_value_model(out)
    with torch.no_grad():
        assert torch.equal(again.value(ids, torch.arange(4), meta), want)


def test_value_model_loads_in_transformers_token_classification(tiny_model_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from polyrl.models import AttnMetadata
    from polyrl.models.value_head import load_value_model, save_value_model

    critic = load_value_model(tiny_model_dir)
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 0.5)
        critic.score.bias.fill_(-0.1)
    out = save_value_model(critic, tmp_path / "critic")
    hf = transformers.AutoModelForTokenClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([5, 6, 7, 8, 9])
    with torch.no_grad():
        ours = critic.value(ids, torch.arange(5), AttnMetadata.from_seqlens([5], ids.device))
        theirs = hf(input_ids=ids[None]).logits[0, :, 0]
    assert torch.allclose(ours, theirs, atol=1e-4)


# ---- runs ---------------------------------------------------------------------------------------
REWARDS = '''
def digits(completion, example):
    """1 + the fraction of the completion's characters that are digits (the offset gives the critic work)."""
    return 1.0 + sum(ch.isdigit() for ch in completion) / max(1, len(completion))
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "toy_rewards.py"
    path.write_text(REWARDS)
    return path


def _raw(model_dir, out, reward, steps=6, **ppo):
    table = {
        "reward": reward,
        "reward_workers": 0,
        "prompts_per_step": 4,
        "samples_per_prompt": 2,
        "max_new_tokens": 4,
        "critic_lr": 3e-3,
        **ppo,
    }
    return {
        "algo": "ppo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=64"},
        "engine": {"micro_batch_tokens": 512},
        "optim": {"lr": 2e-3, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100},
        "checkpoint": {"every_n_steps": 3, "keep_last_k": 0},
        "ppo": table,
    }


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_ppo_run_trains_critic_first_then_policy(tiny_model_dir, tmp_path, reward_file):
    out = tmp_path / "ppo"
    summary = runner.run(rc.build(_raw(tiny_model_dir, out, f"{reward_file}:digits", steps=6, critic_warmup_steps=2)))
    recs = _records(out)
    assert summary["status"] == "finished" and len(recs) == 6
    assert [r["policy_updated"] for r in recs] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert "loss" not in recs[0] and all(math.isfinite(r["loss"]) for r in recs[2:])
    assert all(math.isfinite(r["value_loss"]) and math.isfinite(r["reward"]) for r in recs)
    # the critic starts at V = 0 and learns the returns: its loss falls (measured: ~0.1 -> ~0.02)
    assert recs[0]["values_mean"] == 0.0
    first, last = recs[0]["value_loss"], min(r["value_loss"] for r in recs[-3:])
    assert last < 0.5 * first, [r["value_loss"] for r in recs]
    assert abs(recs[-1]["values_mean"] - recs[-1]["returns_mean"]) < abs(recs[0]["returns_mean"])
    # critic checkpoints beside the policy's, and the final critic
    assert sorted(p.name for p in (out / "critic" / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    assert (out / "critic" / "final" / "config.json").is_file() and summary["final_critic"].endswith("final")


def test_ppo_resume_is_exact_with_kl_penalty(tiny_model_dir, tmp_path, reward_file):
    def raw(out, steps):
        r = _raw(tiny_model_dir, out, f"{reward_file}:digits", steps=steps, kl_coef=0.05, old_logprobs="recompute")
        r["checkpoint"]["every_n_steps"] = 1
        return r

    full, part = tmp_path / "full", tmp_path / "part"
    runner.run(rc.build(raw(full, 2)))
    runner.run(rc.build(raw(part, 1)))
    resumed = raw(part, 2)
    resumed["resume"] = "latest"
    runner.run(rc.build(resumed))
    a, b = _records(full), _records(part)
    assert [r["step"] for r in b] == [1, 2]
    assert a[0]["kl"] == 0.0 and a[1]["kl"] != 0.0  # the KL to the initial policy appears after an update
    for key in ("reward", "loss", "value_loss", "kl", "values_mean", "grad_norm", "critic_grad_norm"):
        assert a[1][key] == b[1][key], key


@pytest.mark.gpu
def test_ppo_run_on_the_accelerator(tiny_model_dir, tmp_path, reward_file):
    """On the GPU (bf16 compute, real rollout engine): the run trains end to end and the critic's loss falls."""
    out = tmp_path / "ppo"
    summary = runner.run(rc.build(_raw(tiny_model_dir, out, f"{reward_file}:digits", steps=6, critic_warmup_steps=1)))
    recs = _records(out)
    assert summary["status"] == "finished"
    assert all(math.isfinite(r["value_loss"]) for r in recs) and all(math.isfinite(r["loss"]) for r in recs[1:])
    assert min(r["value_loss"] for r in recs[-3:]) < 0.5 * recs[0]["value_loss"]
