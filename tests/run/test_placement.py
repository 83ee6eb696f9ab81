"""Placements (``rollout_devices`` / ``train_devices``, ``polyrl.run.placement``): validation errors say what to
set; two CPU rollout replicas (``--rollout-devices cpu,cpu``, worker processes fed over gloo) train the same run as
one rollout engine, before and after a replica dies (restarted with the current weights, then dropped for good),
with the weight sync's metrics in metrics.jsonl; the CLI flags reach the config."""

from __future__ import annotations

import pytest
import torch
from _async_runs import raw_config, shared_records, without_clocks, write_reward
from _async_runs import records as _records

from polyrl.errors import ConfigError
from polyrl.platform import device
from polyrl.run.placement import Placement, check_torchrun_rollout, resolve_placement


@pytest.fixture()
def two_gpus(monkeypatch):
    """The machine facts of a 2-GPU CUDA host (placement validation reads only these)."""
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(device, "count", lambda: 2)
    monkeypatch.setattr(device, "is_accelerator", lambda: True)


def test_config_errors_say_what_to_set():
    from polyrl.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match='async_producer = "process"'):
        GRPOConfig(rollout_devices="cpu,cpu")  # synchronous: nothing drives worker processes
    with pytest.raises(ConfigError, match="--max-staleness 1 --async-producer process"):
        GRPOConfig(rollout_devices="cuda:1", max_staleness=1, async_producer="thread")
    with pytest.raises(ConfigError, match="one worker per device"):
        GRPOConfig(rollout_devices="cpu,cpu", max_staleness=1, async_producer="process", rollout_workers=3)
    with pytest.raises(ConfigError, match="weight_sync_dtype"):
        GRPOConfig(weight_sync_dtype="fp16")
    with pytest.raises(ConfigError, match="weight_sync_bucket_mb"):
        GRPOConfig(weight_sync_bucket_mb=0)
    ok = GRPOConfig(rollout_devices="cpu,cpu", max_staleness=1, async_producer="process", rollout_workers=2)
    assert ok.rollout_devices == "cpu,cpu"


def test_devices_are_checked_against_the_machine(two_gpus):
    p = resolve_placement("cuda:1", "cuda:0")
    assert p == Placement((torch.device("cuda", 1),), torch.device("cuda", 0)) and not p.colocated
    assert resolve_placement().colocated and resolve_placement("", "cuda:1").train == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"cuda:1 is listed twice \(rollout_devices and train_devices\)"):
        resolve_placement("cuda:1", "cuda:1")
    with pytest.raises(ConfigError, match="cuda:0 is listed twice"):
        resolve_placement("cuda:0,cuda:0")
    with pytest.raises(
        ConfigError, match=r"cuda:2 does not exist: this machine has 2 cuda device\(s\) \(cuda:0..cuda:1\)"
    ):
        resolve_placement("cuda:1,cuda:2")
    with pytest.raises(ConfigError, match="one trainer process trains on one device"):
        resolve_placement("", "cuda:0,cuda:1")
    with pytest.raises(ConfigError, match="not a device"):
        resolve_placement("gpu 1")
    with pytest.raises(ConfigError, match="does not exist on this machine"):
        resolve_placement("npu:0")
    with pytest.raises(ConfigError, match="train_devices = cpu"):
        resolve_placement("cuda:1", "cpu")
    # CPU replicas may repeat; the trainer's GPU and CPU replicas mix
    assert resolve_placement("cpu,cpu,cuda:1", "cuda:0").rollout == (torch.device("cpu"),) * 2 + (
        torch.device("cuda", 1),
    )


def test_on_the_cpu_only_cpu_exists():
    if device.device_type() != "cpu":
        pytest.skip("a CPU-only machine's facts")
    assert resolve_placement("cpu,cpu").rollout == (torch.device("cpu"),) * 2
    with pytest.raises(ConfigError, match="it has no accelerator"):
        resolve_placement("cuda:0")
    # the fix offered is one this machine takes: cpu (repeated), never a cpu:N it refuses
    for typo in ("cpu,cpux", "cuda:9"):
        with pytest.raises(ConfigError) as err:
            resolve_placement(typo)
        assert "cpu:N" not in str(err.value) and "list cpu (cpu,cpu for two CPU replicas)" in str(err.value)


def test_under_torchrun_rollout_devices_avoid_the_ranks_devices(monkeypatch):
    # local rank r trains on accelerator r: with 2 ranks a node's cuda:0 and cuda:1 are taken, cuda:2 on are free
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cuda = [torch.device("cuda", i) for i in range(4)]
    check_torchrun_rollout(Placement((cuda[2], cuda[3])), "grpo")
    check_torchrun_rollout(Placement((torch.device("cpu"),) * 2), "grpo")  # CPU replicas: nothing to check
    check_torchrun_rollout(Placement(), "grpo")
    fix = r"--nproc-per-node 2: local rank r trains on cuda:r.*--rollout-devices cuda:2\), or lower --nproc-per-node"
    with pytest.raises(ConfigError, match=r"grpo.rollout_devices lists cuda:1, a rank's own device .*" + fix):
        check_torchrun_rollout(Placement((cuda[1], cuda[2])), "grpo")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="lists cuda:2, cuda:3, a rank's own device"):
        check_torchrun_rollout(Placement((cuda[2], cuda[3])), "grpo")


def _raw(model_dir, out, reward, max_steps=3, **algo_kw):
    return raw_config(model_dir, out, reward, steps=max_steps, **{"max_staleness": 1, **algo_kw})


def _plain(rec):
    return without_clocks(rec, ("weight_sync/", "rollout_worker", "replica"))


def test_two_cpu_replicas_train_the_same_run_as_one_engine(tiny_model_dir, tmp_path, monkeypatch):
    import os
    import signal

    from polyrl import run as runner
    from polyrl.run import config, online

    spec = write_reward(tmp_path)
    # one rollout engine: the K = 1 thread run (made once per test process: test_async_rollout compares with it too)
    one = shared_records(tiny_model_dir, tmp_path, steps=4, max_staleness=1, async_producer="thread")
    # replica 1 is killed after step 2's update and again after step 3's (one restart allowed): the first time it is
    # restarted and rejoins at step 2's weight push (with those weights), so step 3's batch comes from replica 0 and
    # the restarted replica 1; the second time it is dropped for good, so step 4's batch comes from replica 0 and the
    # trainer's engine
    original = online.OnlineRun._async_record

    def kill_after_steps_2_and_3(self, batch, t_train, t_end):
        # the reply deadline reaches the workers (set generously: healthy replicas never miss it, the run is the same)
        assert self.policy.remote.reply_timeout_s == 300.0
        if batch.step in (1, 2):
            self.source.drain()
            os.kill(self.policy.remote.procs[1].pid, signal.SIGKILL)
            self.policy.remote.procs[1].join()
            assert self.policy.remote.wait_for_restarts(120)  # so that it rejoins at this step's push (timing)
        return original(self, batch, t_train, t_end)

    monkeypatch.setattr(online.OnlineRun, "_async_record", kill_after_steps_2_and_3)
    # the count split (i mod 2): the "work" default splits by measured speeds, so the replicas' batches (and with them
    # the last bit of a CPU forward's log-probs) would depend on timing; tests/run/test_replica_balance.py covers it
    two = _raw(tiny_model_dir, tmp_path / "two", spec, async_producer="process", rollout_devices="cpu,cpu", max_steps=4,
               rollout_worker_restarts=1, rollout_worker_timeout_s=300, rollout_balance="count")  # fmt: skip
    runner.run(config.build(two))
    two = _records(tmp_path / "two")
    # prompts split over the replicas (i mod 2), seeds per prompt: the same tokens, log-probs, rewards and updates,
    # before and after the loss of a replica, and with the restarted one
    assert [_plain(r) for r in one] == [_plain(r) for r in two]
    assert [r["async/rollout_workers_alive"] for r in two] == [2.0, 2.0, 1.0, 1.0]
    assert [r["async/rollout_worker_failures_total"] for r in two] == [0.0, 1.0, 2.0, 2.0]
    assert [r["async/rollout_worker_restarts_total"] for r in two] == [0.0, 1.0, 1.0, 1.0]
    # load balancing (replica_balance): the largest share of a batch's estimated work, and each replica's speed
    assert all(0.5 <= r["async/replica_share_max"] <= 1.0 and r["async/replica0_work_per_s"] > 0 for r in two)
    # the sync metrics: the thread's in-process copy and the replicas' broadcasts (bytes summed over live ones)
    model_bytes = one[0]["weight_sync/bytes"]
    assert model_bytes > 100_000 and all(r["weight_sync/bytes"] == model_bytes for r in one)
    assert [r["weight_sync/bytes"] for r in two] == [2 * model_bytes] * 2 + [model_bytes] * 2
    assert all(r["weight_sync/seconds"] > 0 and r["weight_sync/gbps"] > 0 for r in one + two)


def test_cli_placement_flags(tiny_model_dir, tmp_path, capsys):
    import argparse

    from polyrl.cli import train
    from polyrl.cli.main import main

    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", "builtin:arithmetic?max=9&n=32"]
    argv += ["--out", str(tmp_path / "x"), "--max-steps", "1", "--reward-workers", "0", "--rollout-devices", "cpu,cpu"]
    assert main(argv) == 2  # one clear sentence, no traceback
    assert 'async_producer = "process"' in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args([*argv[1:], "--train-devices", "cpu", "--weight-sync-dtype", "bf16",
                              "--weight-sync-bucket-mb", "64"])  # fmt: skip
    got = dict(train.overrides_from_args(args))
    assert got["grpo.rollout_devices"] == "cpu,cpu" and got["grpo.train_devices"] == "cpu"
    assert got["grpo.weight_sync_dtype"] == "bf16" and got["grpo.weight_sync_bucket_mb"] == 64.0


def test_a_lora_run_sends_the_adapters_alone_to_its_replica(tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config

    spec = write_reward(tmp_path)
    lora = {"r": 4, "alpha": 8, "targets": "q,v"}
    thread = _raw(tiny_model_dir, tmp_path / "thread", spec, async_producer="thread")
    proc = _raw(tiny_model_dir, tmp_path / "proc", spec, async_producer="process", rollout_devices="cpu")
    for raw in (thread, proc):
        raw["lora"] = lora
        raw["optim"]["lr"] = 0.5  # adapters move enough in 3 steps to change the samples
        runner.run(config.build(raw))
    one, rep = _records(tmp_path / "thread"), _records(tmp_path / "proc")
    # the replica builds the same LoRA model from the folder and gets the trained adapters each step (a replica
    # that kept its initial adapters samples other tokens: this comparison then fails, checked by hand)
    assert [_plain(r) for r in one] == [_plain(r) for r in rep]
    # adapters alone: the in-process copy and the replica's broadcast move the same bytes, a few % of the model
    assert all(r["weight_sync/bytes"] == one[0]["weight_sync/bytes"] for r in one + rep)
    assert one[0]["weight_sync/bytes"] < 0.1 * 820_736  # the tiny model's fp32 weights: 820,736 bytes


@pytest.mark.multi_gpu
def test_rollout_replica_on_cuda1_trainer_on_cuda0(tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    raw = _raw(tiny_model_dir, tmp_path / "gpu", write_reward(tmp_path), async_producer="process",
               rollout_devices="cuda:1", train_devices="cuda:0")  # fmt: skip
    runner.run(config.build(raw))
    recs = _records(tmp_path / "gpu")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["async/rollout_workers_alive"] == 1.0 and r["weight_sync/bytes"] > 0 for r in recs)
    assert recs[-1]["async/staleness_max"] == 1.0
