"""Issue 29 (rewards never stall the rollout): an online run hands each sample to the reward pool as the rollout
engine finishes it. Same seed: the same rewards and the same trained weights with and without streaming; with a slow
reward, the step waits for rewards after generation for a small part of the scoring time only (metrics.jsonl)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

REWARDS = """
import time

def digits(completion, example):
    h = sum(completion.encode()) % 6
    if h == 0:
        raise ValueError("bad completion")  # failures are part of what must match
    return {"reward": sum(ch.isdigit() for ch in completion) / max(1, len(completion)), "h": float(h)}

def slow(completion, example):
    time.sleep(0.05)
    return float(len(completion) % 3)
"""


def _raw(model_dir, out, reward, steps, stream, **algo_kw):
    table = {
        "reward": reward,
        "reward_workers": 0,
        "prompts_per_step": 4,
        "samples_per_prompt": 4,
        "max_new_tokens": 8,
        "temperature": 1.0,
        "rollout_max_num_seqs": 4,  # 16 samples in 4 waves: the first ones finish while the others generate
        "stream_rewards": stream,
        "rollouts_to_save": 16,
        **algo_kw,
    }
    return {
        "algo": "grpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 5e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": True},
        "grpo": table,
    }


def _run(raw):
    from polyrl import run as runner
    from polyrl.run import config

    return runner.run(config.build(raw))


def _records(out, name="metrics.jsonl"):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.fixture(autouse=True)
def _one_thread():
    # a tiny model on a shared CPU: more torch threads only contend (10x slower decode steps under load)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "stream_rewards.py"
    path.write_text(REWARDS)
    return path


def test_streamed_rewards_give_the_same_run(tiny_model_dir, tmp_path, reward_file):
    runs = {}
    for stream in (True, False):
        out = tmp_path / f"stream-{stream}"
        summary = _run(_raw(tiny_model_dir, out, f"{reward_file}:digits", 3, stream))
        weights = load_file(out / "final" / "model.safetensors")
        runs[stream] = (summary, _records(out), _records(out, "rollouts.jsonl"), weights)
    (s1, m1, r1, w1), (s0, m0, r0, w0) = runs[True], runs[False]
    assert s1["reward_failures"] == s0["reward_failures"] and s1["reward_failures"]["error"] > 0
    for key in ("reward", "reward_std", "reward_failures", "reward/h", "loss", "grad_norm"):
        assert [r[key] for r in m1] == [r[key] for r in m0], key
    assert [(r["completion"], r["reward"]) for r in r1] == [(r["completion"], r["reward"]) for r in r0]
    assert w1.keys() == w0.keys() and all(torch.equal(w1[k], w0[k]) for k in w1)
    assert all(r["reward/overlap_frac"] == 0.0 and r["reward_wait_s"] == r["reward_s"] for r in m0)
    assert all(r["reward/overlap_frac"] > 0.0 for r in m1)  # the first waves were scored during generation


def test_slow_reward_overlaps_generation(tiny_model_dir, tmp_path, reward_file):
    """50 ms per sample, two workers, samples finishing in waves of 4 over the rollout: scoring runs while the later
    waves generate. What can overlap is bounded by the shorter of the two phases (an unloaded CPU generates faster
    than the workers score): at least 30% of that must have overlapped (scored after the batch: 0%)."""
    out = tmp_path / "slow"
    _run(_raw(tiny_model_dir, out, f"{reward_file}:slow", 2, True, reward_workers=2, max_new_tokens=32))
    recs = _records(out)
    last = recs[1:]  # step 1 also starts the two reward workers (seconds on a loaded CPU)
    wait = sum(r["reward_wait_s"] for r in last)
    scoring = sum(r["reward_s"] for r in last)
    assert scoring >= 16 * 0.05 / 2  # 16 samples x 50 ms on 2 workers, at least
    rollout = sum(r["rollout_s"] for r in last)
    overlapped = scoring - wait
    seen = [(r["reward_wait_s"], r["reward_s"], r["rollout_s"]) for r in recs]
    assert overlapped >= 0.3 * min(rollout, scoring), seen
    assert all(0.0 < r["reward/overlap_frac"] <= 1.0 for r in last)


@pytest.mark.parametrize("path", ["local", "dead_workers"])
def test_rollout_on_finish_gives_each_sample_at_its_position(tiny_model, path):
    """``ColocatedPolicy.rollout(on_finish=...)``: sample ``(group, index)`` is ``samples[group * n + index]``; with
    every rollout worker dead, the trainer's engine generates their prompts and still reports each by prompt."""
    from polyrl.infer.config import RolloutConfig
    from polyrl.infer.sampling_params import SamplingParams
    from polyrl.run.colocated import ColocatedPolicy
    from polyrl.run.rollout_workers import RolloutWorkers

    policy = ColocatedPolicy(tiny_model(), rollout=RolloutConfig(num_blocks=64, block_size=4, max_num_seqs=3))
    if path == "dead_workers":
        remote = RolloutWorkers.__new__(RolloutWorkers)  # two workers that died: no process to spawn
        remote.procs, remote.alive, remote.failures = [None, None], [False, False], 2
        remote.reply_timeout_s, remote.job_partial, remote.closing = None, None, False
        remote._lock, remote.local_lock = threading.RLock(), threading.Lock()
        policy.remote = remote
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    seen = {}

    def hook(g, j, sample):
        assert (g, j) not in seen
        seen[(g, j)] = (sample.group, sample.index, sample.prompt_ids, sample.completion_ids, sample.logprobs)

    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    samples = policy.rollout(prompts, 3, sampling, seeds=[1, 2, 3, 4], on_finish=hook)
    assert len(seen) == len(samples) == 12
    for (g, j), got in seen.items():
        s = samples[g * 3 + j]
        assert got == (s.group, s.index, s.prompt_ids, s.completion_ids, s.logprobs) and s.prompt_ids == prompts[g]
