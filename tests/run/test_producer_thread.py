"""``ProducerThread`` (the threaded async-RL sources' producer): calls run one at a time in the order submitted,
each result or error reaches its future, ``shutdown(cancel_futures=True)`` cancels the calls not started, and the
thread is a daemon that ``shutdown(wait=False)`` leaves inside a call that never ends (a failed rank's batch)."""

from __future__ import annotations

import threading
import time

import pytest

from polyrl.run.producer_thread import ProducerThread


def test_calls_run_in_order_one_at_a_time_with_their_results_and_errors():
    pool = ProducerThread("test-producer")
    seen, inside = [], []

    def call(i):
        inside.append(i)
        assert len(inside) == 1, inside  # never two calls at once
        time.sleep(0.01)
        seen.append(i)
        inside.remove(i)
        if i == 3:
            raise ValueError("call 3 fails")
        return i * 10

    futs = [pool.submit(call, i) for i in range(5)]
    assert [f.result(10) for f in futs[:3]] == [0, 10, 20]
    with pytest.raises(ValueError, match="call 3 fails"):
        futs[3].result(10)
    assert futs[4].result(10) == 40 and seen == [0, 1, 2, 3, 4]  # a failing call does not stop the thread
    pool.shutdown()
    assert not pool._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(call, 5)


def test_shutdown_cancels_what_has_not_started_and_can_leave_a_stuck_call_behind():
    pool = ProducerThread("test-producer")
    never = threading.Event()
    started = threading.Event()

    def stuck():
        started.set()
        never.wait(20)  # a batch waiting on ranks that are gone (bounded: a shutdown that joins it fails, not hangs)

    first = pool.submit(stuck)
    queued = pool.submit(lambda: "not run")
    assert started.wait(10)
    t0 = time.monotonic()
    pool.shutdown(wait=False, cancel_futures=True)
    assert time.monotonic() - t0 < 1.0  # not waited for
    assert queued.cancelled() and first.running() and not first.done()
    assert pool._thread.daemon and pool._thread.is_alive()  # left behind; a daemon does not hold the process's exit
    never.set()
    pool.shutdown()  # idempotent; now waits for the (released) call to end
    assert first.done() and not pool._thread.is_alive()
