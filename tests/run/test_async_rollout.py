"""Asynchronous RL (``max_staleness``, ``polyrl.run.async_rollout``) on the CPU with the tiny preset: K = 0 is the
synchronous run; K = 1 trains every sample exactly one version stale with the decoupled objective; the threaded
producer (its own copy of the weights) gives bit-for-bit the inline producer's run while its generation overlaps
training; batches older than K are dropped and replaced (counted); a resumed async run reproduces the
uninterrupted one exactly (the queue is checkpointed)."""

from __future__ import annotations

import json
import shutil

import pytest
from _async_runs import raw_config as _raw
from _async_runs import records as _records
from _async_runs import run as _run
from _async_runs import shared_records, without_clocks, write_reward


@pytest.fixture()
def reward(tmp_path):
    return write_reward(tmp_path)


# the reference runs several tests compare against, made once per test process (``shared_records``): the
# synchronous run (3 steps) and the K = 1 run of the threaded producer (4 steps)
SYNC = {}
THREAD = {"steps": 4, "max_staleness": 1, "async_producer": "thread"}


def _plain(rec):
    """A record without wall-clock values (nor the weight sync's: the inline producer has none; nor the replicas'
    shares: they describe the producer's latest split, none yet in a resumed run whose first batches were queued)."""
    return without_clocks(rec, ("weight_sync/", "async/replica"))


def test_staleness_zero_is_the_synchronous_run(tiny_model_dir, tmp_path, reward):
    sync = shared_records(tiny_model_dir, tmp_path, **SYNC)
    _run(_raw(tiny_model_dir, tmp_path / "k0", reward, max_staleness=0))
    k0 = _records(tmp_path / "k0")
    assert [_plain(r) for r in sync] == [_plain(r) for r in k0]
    assert not any(k.startswith("async/") for r in k0 for k in r)
    assert sync[-1]["loss"] != 0.0 and sync[0]["reward"] != sync[-1]["reward"]  # the run learns: a real comparison


def test_threaded_producer_equals_inline_and_overlaps_training(tiny_model_dir, tmp_path, reward):
    sync, thread = shared_records(tiny_model_dir, tmp_path, **SYNC), shared_records(tiny_model_dir, tmp_path, **THREAD)
    _run(_raw(tiny_model_dir, tmp_path / "inline", reward, steps=4, max_staleness=1))
    inline = _records(tmp_path / "inline")
    # same samples, same versions, same updates: bit for bit
    assert [_plain(r) for r in inline] == [_plain(r) for r in thread]
    # step 1 trains the same batch as the synchronous run (version 0 on version 0); later ones one version stale
    assert inline[0]["reward"] == sync[0]["reward"] and inline[0]["async/staleness_max"] == 0.0
    assert inline[0]["loss"] == pytest.approx(sync[0]["loss"], abs=1e-6)
    assert inline[1]["reward"] != sync[1]["reward"]  # sync: version 1 samples; async: version 0 samples
    for r in inline[1:]:
        assert r["async/staleness_mean"] == 1.0 and r["async/staleness_max"] == 1.0
        assert r["async/tokens_lag1"] > 0 and "async/tokens_lag0" not in r
        # the weights moved between behaviour (v-1) and proximal (v) policies: weights != 1, capped at 2
        assert r["async/is_weight_max"] > 1.001 or r["async/is_weight_min"] < 0.999
        assert 0.0 <= r["async/is_truncated_fraction"] <= 1.0 and r["mismatch_mean"] > 1e-4
    assert all(r["async/stale_dropped_total"] == 0.0 for r in inline)
    # the thread generated batch s+1 while step s trained; the inline producer before it
    for a, b in zip(thread, thread[1:]):
        assert b["async/gen_start_s"] < a["async/train_end_s"] and b["async/gen_end_s"] > a["async/train_start_s"]
    for a, b in zip(inline, inline[1:]):
        assert b["async/gen_end_s"] <= a["async/train_start_s"]


def test_stale_batches_are_dropped_and_replaced():
    from polyrl.algorithms.rl_batch import Sample
    from polyrl.run.async_rollout import InlineRollouts, RolloutBatch

    calls = []

    def produce(step, version):
        calls.append((step, version))
        s = Sample([1], [2, 3], [-0.5, -0.5], "stop", "x")
        return RolloutBatch(step, version, [s, Sample([1], [2], [-0.1], "stop", "y")], [0.0, 1.0], {}, 0.0)

    src = InlineRollouts(produce, max_staleness=1)
    for step in (0, 1, 2):  # an over-eager producer: steps 1 and 2 from version 0
        src.submit(step)
    assert src.get(0).version == 0
    src.weights_updated(1)
    assert src.get(1).version == 0  # one version stale: allowed
    src.weights_updated(2)
    b = src.get(2)  # two versions stale: dropped, generated afresh from version 2
    assert b.version == 2 and [s.policy_version for s in b.samples] == [2, 2]
    assert (src.stale_dropped_total, src.stale_dropped_samples) == (1, 2)
    assert calls == [(0, 0), (1, 0), (2, 0), (2, 2)]
    # never-submitted steps are produced on demand with the current version
    assert src.get(5).version == 2


def test_staleness_metrics_count_tokens_per_lag():
    import torch

    from polyrl.algorithms.rl_batch import Sample
    from polyrl.run.async_rollout import staleness_metrics

    ss = [Sample([1], [2, 3, 4], [0.0] * 3, "stop", "", policy_version=v) for v in (5, 4, 4)]
    ss[2].mask = [1, 0, 1]
    beh = [torch.log(torch.tensor([0.5, 0.5, 0.5]))] * 2 + [torch.log(torch.tensor([0.5, 0.5]))]
    prox = [torch.log(torch.tensor([0.5, 0.5, 0.5])), torch.log(torch.tensor([0.25, 1.0, 1.75])), None]
    m = staleness_metrics(5, ss, [0, 1, 2], beh, prox, cap=2.0)
    assert m["async/tokens_lag0"] == 3 and m["async/tokens_lag1"] == 5
    assert m["async/staleness_mean"] == pytest.approx(5 / 8) and m["async/staleness_max"] == 1
    assert m["async/is_weight_max"] == pytest.approx(3.5) and m["async/is_weight_min"] == pytest.approx(0.5)
    assert m["async/is_weight_mean"] == pytest.approx((3 + 0.5 + 2 + 3.5) / 6)
    assert m["async/is_truncated_fraction"] == pytest.approx(1 / 6)
    # data-parallel: each rank counts its share and ``gather`` brings the others' counts: the same metrics
    parts = []
    staleness_metrics(5, ss, [0], beh, prox, 2.0, gather=lambda local: parts.append(local) or [local])
    split = staleness_metrics(5, ss, [1, 2], beh, prox, 2.0, gather=lambda local: [parts[0], local])
    assert split == pytest.approx(m) and split.keys() == m.keys()


@pytest.mark.parametrize("producer", ["inline", "thread", "process"])
def test_async_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path, reward, producer):
    full = tmp_path / "full"
    raw = _raw(tiny_model_dir, full, reward, algo="gspo", steps=4, save_every=2, max_staleness=2)
    raw["gspo"]["async_producer"] = producer
    _run(raw)
    ckpt = full / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())["data"]["async"]
    assert state["version"] == 2 and [b["step"] for b in state["queue"]] == [2, 3]  # K = 2 batches ahead
    assert [b["version"] for b in state["queue"]] == [0, 1]
    resumed = tmp_path / "resumed"
    raw2 = json.loads(json.dumps(raw))
    raw2["out"], raw2["resume"] = str(resumed), str(ckpt)
    assert _run(raw2)["resumed_from_step"] == 2
    a, b = _records(full)[2:], _records(resumed)
    assert [r["step"] for r in b] == [3, 4]
    assert [_plain(r) for r in a] == [_plain(r) for r in b]
    assert [r["async/staleness_max"] for r in b] == [2.0, 2.0]
    shutil.rmtree(resumed)


def test_resume_with_a_lower_max_staleness_says_what_it_drops(tiny_model_dir, tmp_path, reward, capsys):
    """A K = 2 checkpoint resumed with K = 1 drops both queued batches (each 2 versions old) at their steps and
    regenerates them; resumed with K = 0 (synchronous) it drops the whole queue. Both say so before the first step,
    not only in the counters."""
    full = tmp_path / "full"
    raw = _raw(tiny_model_dir, full, reward, steps=4, save_every=2, max_staleness=2)
    _run(raw)
    ckpt = full / "checkpoints" / "step-00000002"
    capsys.readouterr()
    for k in (1, 0):
        raw2 = json.loads(json.dumps(raw))
        raw2["out"], raw2["resume"] = str(tmp_path / f"k{k}"), str(ckpt)
        raw2["grpo"]["max_staleness"] = k
        raw2["checkpoint"]["every_n_steps"] = 0
        _run(raw2)
        out = capsys.readouterr().out
        recs = _records(tmp_path / f"k{k}")
        assert [r["step"] for r in recs] == [3, 4]
        if k == 1:
            assert "note: 2 of the 2 rollout batch(es) queued in" in out and "(steps 3, 4) are older than" in out
            assert [r["async/stale_dropped_total"] for r in recs] == [1.0, 2.0]
            assert [r["async/staleness_max"] for r in recs] == [0.0, 0.0]  # regenerated from the current weights
        else:
            assert "holds 2 rollout batch(es) generated ahead by an asynchronous run; this run is synchronous" in out
            assert not any(key.startswith("async/") for r in recs for key in r)
    shutil.rmtree(full)


def test_ppo_runs_asynchronously(tiny_model_dir, tmp_path, reward):
    out = tmp_path / "ppo"
    _run(_raw(tiny_model_dir, out, reward, algo="ppo", steps=3, max_staleness=1, prompts_per_step=8,
              samples_per_prompt=1))  # fmt: skip
    recs = _records(out)
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert "async/is_weight_mean" in recs[-1] and "value_loss" in recs[-1]


def test_config_and_cli_errors():
    from polyrl.algorithms.grpo import GRPOConfig
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError, match="max_staleness must be an integer >= 0"):
        GRPOConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match="async_producer"):
        GRPOConfig(max_staleness=1, async_producer="gpu")
    with pytest.raises(ConfigError, match="rollout_workers must be a positive integer"):
        GRPOConfig(max_staleness=1, async_producer="process", rollout_workers=0)
    GRPOConfig(max_staleness=1, tis_cap=3.0)  # async always recomputes: tis_cap needs no old_logprobs
    with pytest.raises(ConfigError, match="old_logprobs"):
        GRPOConfig(tis_cap=3.0)  # synchronous: as before


@pytest.mark.parametrize("algo", ["grpo", "gspo", "ppo"])
def test_cli_max_staleness(tiny_model_dir, tmp_path, reward, algo):
    from polyrl.cli.main import main

    out = tmp_path / algo
    argv = ["train", "--algo", algo, "--model", str(tiny_model_dir), "--data", "builtin:arithmetic?max=9&n=32"]
    argv += ["--out", str(out), "--max-steps", "2", "--reward", reward, "--reward-workers", "0", "--n", "2"]
    argv += ["--prompts-per-step", "4", "--max-new-tokens", "4", "--micro-batch-tokens", "256", "--max-staleness", "1"]
    argv += [
        "--async-producer",
        "thread",
        "--set",
        "train.save_final_model=false",
        "--set",
        "checkpoint.save_final=false",
    ]
    assert main(argv) == 0
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg[algo]["max_staleness"] == 1 and cfg[algo]["async_producer"] == "thread"
    assert [r["async/staleness_max"] for r in _records(out)] == [0.0, 1.0]


def test_agentic_grpo_runs_asynchronously(tiny_model_dir, tmp_path):
    import polyrl.agents  # noqa: F401  (registers the [agent] table)

    out = tmp_path / "agent"
    raw = _raw(tiny_model_dir, out, "exact_match", steps=3, max_staleness=1, prompts_per_step=2, samples_per_prompt=3,
               max_new_tokens=6, rollouts_to_save=2)  # fmt: skip
    raw["agent"] = {"env": "guessing", "env_workers": 1, "max_turns": 3, "max_episode_tokens": 256}
    raw["engine"]["micro_batch_tokens"] = 512
    _run(raw)
    recs = _records(out)
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert all(r["async/tokens_lag1"] == r["response_length"] * 6 for r in recs[1:])  # 6 episodes' policy tokens
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3] and all(r["kind"] == "episode" for r in rows)
    # each row's transcript (kept by the run) is the episode of its own sample, not of the batch generated since
    for r in rows:
        first = r["mask"].index(0)
        assert "".join(r["tokens"][:first]).strip() == r["messages"][1]["content"].strip()


def test_rollout_worker_process_equals_the_thread(tiny_model_dir, tmp_path, reward):
    thread = shared_records(tiny_model_dir, tmp_path, **THREAD)
    _run(_raw(tiny_model_dir, tmp_path / "proc", reward, steps=4, max_staleness=1, async_producer="process"))
    proc = _records(tmp_path / "proc")
    # the worker process loads the same folder, gets the trainer's weights over gloo, draws the same tokens
    assert [_plain(r) for r in thread] == [
        {k: v for k, v in _plain(r).items() if "rollout_worker" not in k} for r in proc
    ]
    assert all(r["async/replica_share_max"] == 1.0 for r in proc)  # one replica: all of each batch's work
    assert all(r["async/rollout_workers_alive"] == 1.0 for r in proc)


def test_a_killed_rollout_worker_does_not_stop_training(tiny_model_dir, tmp_path, reward):
    import os
    import signal

    from polyrl.run import online

    thread = shared_records(tiny_model_dir, tmp_path, **THREAD)
    # the worker is killed after step 2's update: step 3's batch (already generated) and the later ones still come
    original = online.OnlineRun._async_record

    def kill_after_step_2(self, batch, t_train, t_end):
        if batch.step == 1:
            self.source.drain()
            os.kill(self.policy.remote.procs[0].pid, signal.SIGKILL)
            self.policy.remote.procs[0].join()
        return original(self, batch, t_train, t_end)

    online.OnlineRun._async_record = kill_after_step_2
    try:
        # restarts off: dropped at once (restarts: test_placement, test_rollout_workers)
        raw = _raw(tiny_model_dir, tmp_path / "killed", reward, steps=4, max_staleness=1, async_producer="process",
                   rollout_worker_restarts=0)  # fmt: skip
        _run(raw)
    finally:
        online.OnlineRun._async_record = original
    killed = _records(tmp_path / "killed")
    assert [r["step"] for r in killed] == [1, 2, 3, 4]
    assert [r["async/rollout_workers_alive"] for r in killed] == [1.0, 0.0, 0.0, 0.0]
    assert killed[-1]["async/rollout_worker_failures_total"] == 1.0
    assert killed[-1]["async/rollout_worker_restarts_total"] == 0.0
    # the trainer's own engine took over with the same weights and seeds: the same rewards and losses
    assert [_plain(r)["reward"] for r in killed] == [r["reward"] for r in thread]
    assert [r["loss"] for r in killed] == [r["loss"] for r in thread]
