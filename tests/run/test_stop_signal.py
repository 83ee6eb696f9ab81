"""A SIGTERM (preemption) stops a run after the step in progress with a checkpoint of it (``polyrl.run.stop_signal``):
a real ``polyrl train`` process is sent SIGTERM while it trains, exits 143 naming the step and the checkpoint, the
summary says "stopped", and ``--resume`` from that checkpoint gives the same next steps, bit for bit on the CPU, as a
run that was never stopped. In-process: the handler only records the signal, a second one acts at once, and the
previous handler comes back; outside the main thread nothing is installed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from polyrl.cli.main import main
from polyrl.run.stop_signal import StopSignal

DATA = "builtin:arithmetic?n=48"
FLAGS = ["--algo", "sft", "--micro-batch-tokens", "256", "--max-seq-len", "64", "--lr", "1e-3", "--log-every", "1",
         "--seed", "3", "--set", "schedule.decay=constant", "--set", "engine.deterministic=true"]  # fmt: skip


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_saves_the_step_in_progress_and_resume_continues_it_exactly(tiny_model_dir, tmp_path):
    out = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "polyrl", "train", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([*cmd, *FLAGS, "--max-steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and len(_records(out)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    found = re.search(r"stopped by SIGTERM after step (\d+) of 100000; checkpoint (\S+): continue", err)
    assert found, err
    k, ckpt = int(found.group(1)), found.group(2)
    assert ckpt == str(out / "checkpoints" / f"step-{k:08d}") and (out / "checkpoints" / f"step-{k:08d}").is_dir()
    assert [r["step"] for r in _records(out)] == list(range(1, k + 1))  # every step it trained, none lost
    assert json.loads((out / "summary.json").read_text())["status"] == "stopped"
    # the same command resumed from that checkpoint, two more steps, against a run of k + 2 steps never stopped
    assert main(["train", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out), *FLAGS, "--max-steps",
                 str(k + 2), "--resume", ckpt]) == 0  # fmt: skip
    ref = tmp_path / "whole"
    assert main(["train", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(ref), *FLAGS, "--max-steps",
                 str(k + 2)]) == 0  # fmt: skip
    got, want = _records(out), _records(ref)
    assert [r["step"] for r in got] == list(range(1, k + 3))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key  # bitwise on the CPU


def test_the_handler_records_the_first_signal_and_acts_on_the_second(monkeypatch):
    import polyrl.run.stop_signal as stop_signal

    monkeypatch.setattr(stop_signal, "ECHO_S", 0.3)
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGTERM)
            assert stop.received == signal.SIGTERM and stop.name() == "SIGTERM" and seen == []
            signal.raise_signal(signal.SIGTERM)  # at once: the echo of the first (torchrun's, after Slurm's)
            assert seen == [] and signal.getsignal(signal.SIGTERM) == stop._handle
            time.sleep(0.35)
            signal.raise_signal(signal.SIGTERM)  # the second: the handler before it runs, at once
            assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not stop._handle
        signal.raise_signal(signal.SIGTERM)  # after the block: the previous handler again
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    got = {}

    def run():
        with StopSignal() as stop:
            got["handler"] = signal.getsignal(signal.SIGTERM)
            got["received"] = stop.received

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert got == {"handler": before, "received": None}


@pytest.mark.parametrize("flag", [False, True])
def test_run_steps_stops_after_the_step_any_rank_was_signalled_on(tmp_path, flag):
    """``agree`` decides (a data-parallel run's all-reduce): a stop another rank got stops this one too, after a
    checkpoint of the same step."""
    from polyrl.errors import RunStopped
    from polyrl.run.offline import run_steps
    from polyrl.train.checkpoint import CheckpointManager

    saved, ran = [], []
    ckpts = CheckpointManager(tmp_path)
    agree = lambda local: flag and len(ran) == 3  # noqa: E731 - "another rank" asks to stop after step 3
    if not flag:
        run_steps(0, 6, lambda i: ran.append(i) or {}, None, ckpts, saved.append, agree=agree)
        assert ran == list(range(6)) and saved == [6]
        return
    with pytest.raises(RunStopped, match="stopped by a stop signal on another rank after step 3 of 6") as stopped:
        run_steps(0, 6, lambda i: ran.append(i) or {}, None, ckpts, saved.append, agree=agree)
    assert ran == [0, 1, 2] and saved == [3] and stopped.value.exit_code == 143


def test_sigterm_to_the_process_group_leaves_the_reward_workers_to_finish_the_step(tiny_model_dir, tmp_path):
    """torchrun's agent stops a rank with ``killpg(SIGTERM)`` (Slurm signals every process of the step too): the
    reward worker processes get the signal with the trainer. They must not die mid-step: the step in progress, whose
    checkpoint the stop saves, is scored in full (no reward failures) as in a run never stopped."""
    reward = tmp_path / "slow_reward.py"
    reward.write_text("import time\n\ndef slow(completion, example):\n    time.sleep(0.4)\n    return 1.0\n")
    out = tmp_path / "grpo"
    cmd = [sys.executable, "-m", "polyrl", "train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data",
           "builtin:arithmetic?max=9&n=16", "--out", str(out), "--reward", f"{reward}:slow", "--reward-workers", "2",
           "--prompts-per-step", "2", "--n", "2", "--max-new-tokens", "4", "--micro-batch-tokens", "256",
           "--log-every", "1", "--max-steps", "100000"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").is_file() and len(_records(out)) >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
            time.sleep(0.05)
        time.sleep(0.2)  # inside the next step's scoring (each reward call takes 0.4 s)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    recs = _records(out)
    assert len(recs) >= 2, err
    assert [r["reward_failures"] for r in recs] == [0] * len(recs), err
    assert [r["reward"] for r in recs] == [1.0] * len(recs), err


UNCLOSED = """
import multiprocessing as mp, time
from polyrl.algorithms.workers import WorkerProcess

def target(conn, spec):
    while True:
        time.sleep(1)

if __name__ == "__main__":
    w = WorkerProcess(mp.get_context("spawn"), target, "", 30)
    time.sleep(1.0)
    print(w.proc.pid, flush=True)
"""


def test_a_program_that_never_closes_its_worker_pool_still_exits(tmp_path):
    """A worker leaves a SIGTERM to its living trainer, and multiprocessing's exit routine stops daemonic children
    with SIGTERM and then joins them without a timeout: the exit hook kills tracked workers first, so a program that
    never closed its pool exits (it hung for good without it) and leaves no worker behind."""
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    pid = int(res.stdout.split()[0])
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2], pid


@pytest.mark.parametrize("algo", ["sft", "grpo"])
def test_a_sigterm_while_the_run_finishes_lets_it_finish(tiny_model_dir, tmp_path, monkeypatch, capsys, algo):
    """A SIGTERM during the final model's export (the run's last moments) does not cut it short: the final folder is
    written, the summary says finished, the run returns 0; the handler is gone afterwards."""
    import polyrl.run.offline as offline
    import polyrl.run.online as online

    real = offline.export_final
    seen = []

    def signalled_export(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # recorded, not acted on
        seen.append(signal.getsignal(signal.SIGTERM))
        return real(*args, **kwargs)

    monkeypatch.setattr(offline, "export_final", signalled_export)
    monkeypatch.setattr(online, "export_final", signalled_export)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / algo
    argv = ["train", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out), "--max-steps", "2"]
    if algo == "sft":
        argv += FLAGS
    else:
        argv += ["--algo", "grpo", "--reward", "numeric", "--prompts-per-step", "2", "--n", "2", "--max-new-tokens",
                 "4", "--micro-batch-tokens", "256", "--log-every", "1"]  # fmt: skip
    assert main(argv) == 0
    assert len(seen) == 1 and seen[0] not in (before, signal.SIG_DFL)  # the run's handler was in place
    assert (out / "final" / "config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert "the run is finishing: its final checkpoint and model are written first" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_in_the_last_step_saves_the_final_checkpoint_without_a_stop(tmp_path, capsys):
    from polyrl.run.offline import run_steps
    from polyrl.train.checkpoint import CheckpointManager

    saved, ran = [], []

    def step(i):
        ran.append(i)
        if i == 3:
            signal.raise_signal(signal.SIGTERM)
        return {}

    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        run_steps(0, 4, step, None, CheckpointManager(tmp_path), saved.append, stop=stop)
        assert stop.received == signal.SIGTERM and stop.finishing
    assert ran == [0, 1, 2, 3] and saved == [4]
    assert signal.getsignal(signal.SIGTERM) == before
    # the last step is past the stop decision: the message says the run finishes, not that it stops
    err = capsys.readouterr().err
    assert "the run is finishing" in err and "the run stops after this step" not in err, err


def test_a_sigterm_while_ppo_exports_its_critic_lets_it_finish(tiny_model_dir, tmp_path, monkeypatch):
    """PPO's final critic (``<out>/critic/final``) is part of the run's finish: a SIGTERM while it is written is
    recorded by the run's handler, not the default action that would kill the process mid-export."""
    import polyrl.run.actor_critic as actor_critic

    real = actor_critic.save_value_model
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def signalled_save(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGTERM))
        if seen[-1] not in (before, signal.SIG_DFL):  # only under the run's handler: the default would end pytest
            signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(actor_critic, "save_value_model", signalled_save)
    out = tmp_path / "ppo"
    argv = ["train", "--algo", "ppo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out)]
    argv += ["--max-steps", "1", "--reward", "numeric", "--reward-workers", "0", "--n", "2", "--prompts-per-step", "2"]
    argv += ["--max-new-tokens", "4", "--micro-batch-tokens", "256", "--set", "checkpoint.save_final=false"]
    assert main(argv) == 0
    assert len(seen) == 1 and seen[0] not in (before, signal.SIG_DFL), seen  # the run's handler was in place
    assert (out / "critic" / "final" / "config.json").is_file() and (out / "final" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_critic"] == str(out / "critic" / "final")
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_ppo_run_whose_critic_export_fails_is_not_summarised_as_finished(tiny_model_dir, tmp_path, monkeypatch):
    """The summary is written once the run's whole finish is done, PPO's final critic included: a failure there is
    the run's ``failed`` (the launcher reads ``finished`` as a run complete)."""
    import polyrl.run.actor_critic as actor_critic

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(actor_critic, "save_value_model", failing_save)
    out = tmp_path / "ppo"
    argv = ["train", "--algo", "ppo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out)]
    argv += ["--max-steps", "1", "--reward", "numeric", "--reward-workers", "0", "--n", "2", "--prompts-per-step", "2"]
    argv += ["--max-new-tokens", "4", "--micro-batch-tokens", "256", "--set", "checkpoint.save_final=false"]
    with pytest.raises(OSError, match="disk full"):
        main(argv)
    assert json.loads((out / "summary.json").read_text())["status"] == "failed: OSError"


def test_a_sigterm_while_an_agentic_run_closes_its_environments_lets_it_finish(tiny_model_dir, tmp_path, monkeypatch):
    """An agentic run's environment pool is closed in the run's finish, under its handler: a SIGTERM then is
    recorded (the run ends 0, finished), not the default action."""
    from polyrl.agents.pool import EnvPool

    real = EnvPool.close
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def signalled_close(self, *args, **kwargs):
        seen.append(signal.getsignal(signal.SIGTERM))
        if seen[-1] not in (before, signal.SIG_DFL):  # only under the run's handler: the default would end pytest
            signal.raise_signal(signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EnvPool, "close", signalled_close)
    out = tmp_path / "agentic"
    argv = [
        "train", "--algo", "gspo", "--model", str(tiny_model_dir), "--data", "builtin:arithmetic?max=9&n=16",
        "--out", str(out), "--env", "calculator", "--max-turns", "2", "--max-new-tokens", "5",
        "--max-episode-tokens", "200", "--env-workers", "0", "--n", "2", "--prompts-per-step", "2", "--max-steps", "1",
        "--set", "checkpoint.save_final=false", "--set", "train.save_final_model=false",
    ]  # fmt: skip
    assert main(argv) == 0
    assert seen and all(h not in (before, signal.SIG_DFL) for h in seen), seen  # the run's handler was in place
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert signal.getsignal(signal.SIGTERM) == before
