"""A run's closing calls (``polyrl.run.teardown.release``) and a worker process killed from two threads at once
(``polyrl.algorithms.workers.WorkerProcess.kill``): after a failed run, a closing call's error is logged and the
rest still run, so the run's own error is the one raised; after a good run every call runs and the first error is
raised; a worker's pipe closed by two threads at once no longer fails with EBADF (a failed rank's environment pool
closed while its left-behind producer thread killed the same worker)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import Connection

import pytest

from polyrl.algorithms.workers import WorkerProcess
from polyrl.run.teardown import release


def _calls():
    done = []

    def ok(name):
        return lambda: done.append(name)

    def boom(name):
        def close():
            done.append(name)
            raise OSError(f"{name} failed to close")

        return close

    return done, [("a", ok("a")), ("b", boom("b")), ("c", boom("c")), ("d", ok("d"))]


def test_after_a_failed_run_closing_errors_are_logged_and_the_rest_still_close(caplog):
    done, closers = _calls()
    caplog.set_level(logging.WARNING, logger="polyrl.run.teardown")
    release(closers, failed=True)  # nothing raised: the run's own error goes on
    assert done == ["a", "b", "c", "d"]
    assert "closing the b after the run failed raised OSError: b failed to close" in caplog.text
    assert "c failed to close" in caplog.text


def test_after_a_good_run_every_call_runs_and_the_first_error_is_raised(caplog):
    done, closers = _calls()
    caplog.set_level(logging.WARNING, logger="polyrl.run.teardown")
    with pytest.raises(OSError, match="b failed to close"):
        release(closers, failed=False)
    assert done == ["a", "b", "c", "d"]
    # the later error is not the one raised, so it is logged (else nobody would see that c failed to close)
    assert "closing the c raised OSError: c failed to close" in caplog.text
    assert "b failed to close" not in caplog.text  # the one raised is not logged twice
    release([], failed=False)


def _sleep_forever(conn, spec):
    conn.recv()


def _kill_together(w: WorkerProcess, threads: int) -> list[OSError]:
    start, errors = threading.Barrier(threads), []

    def kill():
        start.wait()
        try:
            w.kill()
        except OSError as exc:
            errors.append(exc)

    pool = [threading.Thread(target=kill) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(30)
    return errors


class _SlowClosing(Connection):
    """The worker's real pipe, whose descriptor takes 0.3 s to close: the threads that kill the worker together all
    reach ``close`` inside that window, so without the lock each closes the descriptor (EBADF) in every round (left
    to chance, the window is microseconds: one round in 30 hit it here)."""

    def _close(self, _close=os.close):
        handle = self._handle
        time.sleep(0.3)
        _close(handle)


def test_a_worker_killed_from_two_threads_at_once_closes_its_pipe_once():
    ctx = mp.get_context("spawn")
    for _ in range(2):
        w = WorkerProcess(ctx, _sleep_forever, "", startup_timeout=30)
        w.conn.__class__ = _SlowClosing
        assert _kill_together(w, 4) == [] and w.conn.closed and not w.proc.is_alive()
        w.kill()  # once more: nothing left to do
