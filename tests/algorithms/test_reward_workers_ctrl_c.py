"""Ctrl-C during scoring: the terminal sends SIGINT to the trainer and to every reward worker process. A worker exits
quietly (code 130), whether it was inside the user's reward function or waiting for a job, instead of printing a
KeyboardInterrupt traceback above the trainer's one-line "interrupted" (the shared worker entry,
``workers.quiet_on_interrupt``; the environment workers' side is tests/agents/test_env_pool_ctrl_c.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

from polyrl.algorithms.rewards import RewardPool

REWARD = """
import os, pathlib, time

def slow(completion, example):
    if completion == "hang":
        pathlib.Path(example["marker"]).write_text("in the reward")
        time.sleep(30)
    pathlib.Path(example["pids"], str(os.getpid())).touch()  # which workers have served a call
    time.sleep(0.2)
    return 1.0
"""


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_sigint_ends_reward_workers_without_a_traceback(tmp_path, capfd):
    (tmp_path / "slow_reward.py").write_text(REWARD)
    marker, pids = tmp_path / "marker", tmp_path / "pids"
    pids.mkdir()
    example = {"marker": str(marker), "pids": str(pids)}
    # spawn: the workers are this test's children, writing to the stderr capfd captures
    with RewardPool(f"{tmp_path / 'slow_reward.py'}:slow", workers=2, timeout=60.0, start_method="spawn") as pool:
        # every worker past its start-up (a SIGINT while one still imports is the interpreter's, not ours)
        end = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2:
            assert time.monotonic() < end, "both reward workers never served a call"
            assert pool.score(["ok"] * 4, [example] * 4).rewards == [1.0] * 4
        procs = [w.proc for w in pool._workers]
        assert sorted(str(p.pid) for p in procs) == sorted(f.name for f in pids.iterdir())
        scoring = threading.Thread(target=lambda: pool.score(["hang"], [example]))
        scoring.start()
        _wait_for(marker.exists, "the reward function never started")
        for proc in procs:  # one inside the user's function, one waiting for a job
            os.kill(proc.pid, signal.SIGINT)
        scoring.join(60)
        for proc in procs:
            proc.join(10)
        codes = [p.exitcode for p in procs]
    assert 130 in codes and all(c in (130, -signal.SIGKILL) for c in codes), codes  # a crashed one may be killed
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
