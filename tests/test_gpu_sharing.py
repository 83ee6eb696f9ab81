"""tests/gpu_sharing.py: the device lock between GPU-suite workers and the out-of-memory test (CPU, real processes)."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_sharing import DeviceLock, ran_out_of_memory


def _hold_shared(stem: str, ready, release) -> None:
    with DeviceLock(stem).shared():
        ready.set()
        release.wait(10)


def _can_lock(path: str, kind: int) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_shared_holders_coexist_and_exclude_an_exclusive_one(tmp_path):
    stem = str(tmp_path / "dev")
    lock = DeviceLock(stem)
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_shared, args=(stem, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with lock.shared():  # a second shared holder gets in while the other process holds it
            assert not _can_lock(lock.main_path, fcntl.LOCK_EX)
        assert not _can_lock(lock.main_path, fcntl.LOCK_EX)  # the other process still holds it
        assert _can_lock(lock.gate_path, fcntl.LOCK_EX)  # the gate is only held while taking the lock
        t0 = time.monotonic()
        release.set()
        with lock.exclusive():  # waits for the holder to let go, then keeps new shared holders out
            waited = time.monotonic() - t0
            assert not _can_lock(lock.gate_path, fcntl.LOCK_EX)
            assert not _can_lock(lock.main_path, fcntl.LOCK_SH)
        assert waited < 30
        assert _can_lock(lock.main_path, fcntl.LOCK_EX) and _can_lock(lock.gate_path, fcntl.LOCK_EX)
    finally:
        release.set()
        holder.join(30)
    assert holder.exitcode == 0


class _Report:
    def __init__(self, failed: bool, text: str):
        self.failed, self.longreprtext = failed, text


def test_out_of_memory_is_told_from_other_failures():
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB."
    assert ran_out_of_memory([_Report(False, ""), _Report(True, oom)])
    assert not ran_out_of_memory([_Report(True, "AssertionError: 3 == 4")])
    assert not ran_out_of_memory([_Report(False, oom)])  # a passed report that printed it is not a failure


_SUITE = """
import os, pathlib, pytest

COUNT = pathlib.Path(os.environ["RUNS_DIR"])


@pytest.mark.gpu
def test_oom_once():
    runs = COUNT / "oom_once"
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    if len(runs.read_text()) == 1:
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.16 GiB.")


@pytest.mark.gpu
def test_oom_always():
    raise RuntimeError("CUDA out of memory. Tried to allocate 99 GiB.")


@pytest.mark.gpu
def test_wrong():
    runs = COUNT / "wrong"
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    assert 3 == 4


def test_cpu_oom():
    raise RuntimeError("CUDA out of memory (not a gpu test: not re-run).")
"""


def test_an_oom_failure_is_re_run_alone_under_xdist(tmp_path):
    """A real xdist run of a four-test file: only the ``gpu`` test that ran out of memory is run again."""
    pytest.importorskip("xdist")
    (tmp_path / "test_suite.py").write_text(_SUITE)
    runs = tmp_path / "runs"
    runs.mkdir()
    log = tmp_path / "failures.log"
    env = dict(os.environ, RUNS_DIR=str(runs), POLYRL_TESTS_FAILURE_LOG=str(log), PYTHONPATH=str(Path(__file__).parent))
    # the plugins this run needs, xdist and gpu_sharing, and no other installed one (each of the 3 processes would
    # import them all: seconds of the test's time for nothing it checks)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "xdist.plugin", "-p", "gpu_sharing"]
    cmd += ["-p", "no:cacheprovider"]
    cmd += ["-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path / "test_suite.py")]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120).stdout
    assert "3 failed, 1 passed" in out, out
    assert (runs / "oom_once").read_text() == "xx"  # failed once, passed alone
    assert (runs / "wrong").read_text() == "x"  # an assertion failure is not re-run
    text = log.read_text()
    assert "test_oom_once: re-run alone" in text and "(passed)" in text
    assert "test_oom_always: re-run alone" in text and "(failed)" in text
    assert "test_cpu_oom: re-run" not in text
