"""One GPU shared by the pytest-xdist workers of the GPU suite (a pytest plugin, loaded by tests/conftest.py).

The GPU suite runs test files in several processes on one device (``scripts/gpu_stage.sh gpu-tests``). Tests size
what they allocate from their share (``POLYRL_DEVICE_MEMORY_SHARE``), but a few allocate big tensors directly, and
two of those running at once can leave a third worker's test without memory: a CUDA out-of-memory error that says
nothing about the test itself. So, under xdist and for ``gpu``-marked tests only:

- every test runs holding a shared lock on the device (a file lock in the temporary directory, one per test run);
- a test that fails with an out-of-memory error is run once more holding the lock exclusively: the other workers
  finish the test they are in and wait, so it runs alone on the device. Its reports are the second run's, with a
  section saying it was re-run; a test that runs out of memory alone fails as before. The re-run is appended to
  ``POLYRL_TESTS_FAILURE_LOG`` when that is set, so a run that passed this way still shows it;
- with ``POLYRL_TESTS_MEMORY_LOG=PATH``, a line per test is appended to PATH: its peak reserved device memory, then
  the memory still reserved and still allocated after its teardown (which collects garbage and empties the cache),
  then what is still reserved after this plugin empties the cache once more and how much of that is in private
  (CUDA graph) pools, in GiB, the worker and the test id. The peak finds the tests that need a lot; memory still
  *allocated* after a test is live tensors it left behind (a worker was seen keeping ~60 GiB across tests, starving
  the others); reserved with nothing allocated (seen 2026-12-04: each worker kept its running peak) is memory the
  allocator could not return, which the last two columns split.

New shared holders wait behind a waiting exclusive holder (a gate lock taken first), so the re-run cannot starve.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator

import pytest
from _pytest.runner import runtestprotocol


class DeviceLock:
    """A readers-writer lock between processes: ``shared()`` for every test, ``exclusive()`` for a re-run alone."""

    def __init__(self, stem: str):
        self.gate_path = stem + ".gate"
        self.main_path = stem + ".main"

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with open(self.gate_path, "a") as gate, open(self.main_path, "a") as main:
            fcntl.flock(gate, fcntl.LOCK_EX)  # waits while an exclusive holder waits or runs
            fcntl.flock(main, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(main, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with open(self.gate_path, "a") as gate, open(self.main_path, "a") as main:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(main, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(main, fcntl.LOCK_UN)
                fcntl.flock(gate, fcntl.LOCK_UN)


def ran_out_of_memory(reports) -> bool:
    return any(r.failed and "out of memory" in r.longreprtext.lower() for r in reports)


def _device_lock() -> DeviceLock:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "serial")
    return DeviceLock(os.path.join(tempfile.gettempdir(), f"polyrl-gpu-tests-{run}"))


def _cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _append(env: str, line: str) -> None:
    path = os.environ.get(env)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _run_measured(item, nextitem):
    cuda = _cuda()
    if cuda is not None:
        cuda.reset_peak_memory_stats()
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    cuda = _cuda()
    if cuda is not None:
        gib = 2**30
        peak, reserved, allocated = cuda.max_memory_reserved(), cuda.memory_reserved(), cuda.memory_allocated()
        after = _release(cuda)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        _append(
            "POLYRL_TESTS_MEMORY_LOG",
            f"{peak / gib:7.2f} {reserved / gib:7.2f} {allocated / gib:7.2f} {after['reserved'] / gib:7.2f} "
            f"{after['private_pools'] / gib:7.2f} {worker} {item.nodeid}",
        )
    return reports


def _release(cuda) -> dict[str, int]:
    """Collect garbage and return the allocator's free segments to the device once more (the teardown fixture did it
    already: if this frees more, something outlived that fixture), then what is still reserved, and how much of it
    sits in private pools (a CUDA graph's pool lives as long as its graph: graphs kept alive pin their memory)."""
    import gc

    gc.collect()
    cuda.empty_cache()
    private = 0
    try:
        for seg in cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
                private += int(seg.get("total_size", 0))
    except (RuntimeError, AttributeError, TypeError):  # an older torch without pool ids: not counted
        private = 0
    return {"reserved": cuda.memory_reserved(), "private_pools": private}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("PYTEST_XDIST_WORKER") or item.get_closest_marker("gpu") is None:
        return None
    lock = _device_lock()
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    with lock.shared():
        reports = _run_measured(item, nextitem)
    if ran_out_of_memory(reports):
        with lock.exclusive():
            cuda = _cuda()
            if cuda is not None:
                import gc

                gc.collect()
                cuda.empty_cache()
            reports = _run_measured(item, nextitem)
        note = "re-run alone on the device after an out-of-memory error while sharing it with other workers"
        for r in reports:
            r.sections.append(("polyrl gpu sharing", note))
        _append(
            "POLYRL_TESTS_FAILURE_LOG",
            f"=== {item.nodeid}: {note} ({'failed' if any(r.failed for r in reports) else 'passed'})\n",
        )
    for r in reports:
        item.ihook.pytest_runtest_logreport(report=r)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
