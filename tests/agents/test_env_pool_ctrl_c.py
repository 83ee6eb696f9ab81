"""Ctrl-C during a rollout: the terminal sends SIGINT to the trainer and to every environment worker process. A
worker exits quietly (code 130), whether it was inside the user's ``step`` or waiting for a job, instead of
printing a KeyboardInterrupt traceback into the user's terminal above the trainer's one-line "interrupted"."""

from __future__ import annotations

import os
import signal
import threading
import time

from polyrl.agents.env import register_env
from polyrl.agents.pool import EnvPool

ENV = """
import pathlib, time
from polyrl.agents import Environment, EnvStep

class Slow(Environment):
    def reset(self, example):
        self.marker = pathlib.Path(example["marker"])
        return [{"role": "user", "content": "go"}]

    def step(self, message):
        self.marker.write_text("in step")
        time.sleep(30)
        return EnvStep([], 1.0, True)
"""


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_sigint_ends_env_workers_without_a_traceback(tmp_path, capfd):
    (tmp_path / "slow_env.py").write_text(ENV)
    register_env("slow-ctrl-c-test", f"{tmp_path / 'slow_env.py'}:Slow")
    marker = tmp_path / "marker"
    # spawn: the workers are this test's children, writing to the stderr capfd captures
    with EnvPool("slow-ctrl-c-test", workers=2, timeout=60.0, start_method="spawn") as pool:
        example = {"prompt": "p", "marker": str(marker)}
        assert all(o.ok for o in pool.reset([(0, example), (1, example)]).values())
        busy, idle = pool._home[0].proc, pool._home[1].proc  # episode 0 steps, episode 1's worker waits
        out = {}
        stepping = threading.Thread(target=lambda: out.update(pool.step([(0, {"role": "assistant"})])))
        stepping.start()
        _wait_for(marker.exists, "the environment never entered step()")
        for proc in (busy, idle):
            os.kill(proc.pid, signal.SIGINT)
        stepping.join(60)
        idle.join(10)
    assert out[0].kind == "crash"  # what the trainer's pool saw (a real Ctrl-C interrupts the trainer too)
    assert idle.exitcode == 130
    assert busy.exitcode in (130, -signal.SIGKILL)  # the pool kills a crashed worker that is still exiting
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
