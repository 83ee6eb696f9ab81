"""Worker processes for user code (reward functions, environments): started with forkserver (or spawn), one pipe
each, killed and replaced by their pool on a timeout or crash.

Shared by ``rewards.RewardPool`` (stateless calls) and ``polyrl.agents.pool.EnvPool`` (stateful episodes): the
process handle, the start context, the spec resolution and the shutdown, and ``JobInbox`` (jobs fed to a pool's
dispatch loop from another thread while it runs: rewards scored as the rollout finishes them). What a worker runs and
how a pool schedules calls and counts failures stay with each pool.

spawn and forkserver run the parent's main script again in each new worker (as ``__mp_main__``) before the
worker's own code; a script that calls ``fit(...)`` (or starts workers) at its top level, without
``if __name__ == "__main__":``, would start a second run there. ``exit_if_bootstrapping`` stops such a worker at once
with ``REIMPORT_EXIT_CODE``, which its pool reports as ``REIMPORT_MESSAGE``.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - its exit routine registered before ours (see kill_sheltered_at_exit)
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError

REIMPORT_EXIT_CODE = 87
REIMPORT_MESSAGE = (
    "worker processes import your main script again, and it starts a run at its top level: put the fit(...) call "
    '(and anything else that should run once) under `if __name__ == "__main__":`'
)


def bootstrapping() -> bool:
    """True in a spawn/forkserver worker that is still importing the parent's main script."""
    return bool(getattr(mp.process.current_process(), "_inheriting", False))


def exit_if_bootstrapping(what: str) -> None:
    """Called where a run or a worker starts: in a worker still importing the main script, say so on stderr and
    exit with ``REIMPORT_EXIT_CODE`` (the parent's pool turns it into ``REIMPORT_MESSAGE``); else nothing."""
    if bootstrapping():
        print(f"polyrl: {what} in a worker process re-importing the main script; {REIMPORT_MESSAGE}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(REIMPORT_EXIT_CODE)


def exit_status(exitcode: int | None) -> str:
    """``exit code 3`` / ``killed by signal 9, SIGKILL`` / ``still running``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            return f"killed by signal {-exitcode}"
        return f"killed by signal {-exitcode}, {name}"
    return f"exit code {exitcode}"


class WorkerProcess:
    """One daemon process running ``target(conn, spec)`` with the other end of ``conn``; ``job`` and ``deadline``
    are the pool's bookkeeping of the call in flight (the deadline starts as ``startup_timeout`` seconds from now: a
    worker that has not said "ready" by then counts as crashed)."""

    def __init__(self, ctx: Any, target: Callable[[Any, str], None], spec: str, startup_timeout: float) -> None:
        exit_if_bootstrapping("a worker pool was started")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sheltered, args=(target, child, spec), daemon=True)
        self.proc.start()
        track(self.proc)
        child.close()
        self.ready = False
        self.job: Any = None
        self.deadline = time.monotonic() + startup_timeout
        self._kill_lock = threading.Lock()  # kill() may come from the pool's thread and a closing one at once

    def exit_status(self, wait: float = 5.0) -> str:
        """How the process ended (its pipe closed first: give it ``wait`` seconds to be reaped)."""
        self.proc.join(timeout=wait)
        return exit_status(self.proc.exitcode)

    def kill(self) -> None:
        """Kill the process and close its pipe; safe to call again and from two threads at once (a pipe closed
        twice concurrently fails with EBADF)."""
        with self._kill_lock:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)
            if not self.conn.closed:
                self.conn.close()


def shelter_from_stop_signal() -> None:
    """In a worker process: a SIGTERM is left to the trainer while it lives. A stop signal reaches every process of
    the trainer's group at once (torchrun's agent sends ``killpg(SIGTERM)``, Slurm signals every process of the
    step), but the trainer finishes the step in progress and saves it (``polyrl.run.stop_signal``), which needs its
    workers; its pools stop them when it closes them (SIGKILL, EXIT). A worker whose trainer is gone stops on it as
    before. Python handlers are reset by ``exec``, so the user code's own subprocesses keep the default."""
    parent = mp.parent_process()

    def handle(signum: int, frame: Any) -> None:
        if parent is None or not parent.is_alive():
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, handle)


def _interrupted(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # multiprocessing ends the process with this code and prints no traceback


def quiet_on_interrupt() -> None:
    """In a worker process: Ctrl-C reaches every process of the terminal's foreground group; the trainer stops with
    its one-line "interrupted", and a worker (reward or environment) exits quietly with code 130 instead of printing a
    KeyboardInterrupt traceback from inside the user's function or its idle wait. A Python handler, not SIG_IGN: the
    user code's own subprocesses (reset by ``exec``) keep the default."""
    signal.signal(signal.SIGINT, _interrupted)


def _sheltered(target: Callable[[Any, str], None], conn: Any, spec: str) -> None:
    shelter_from_stop_signal()
    quiet_on_interrupt()
    target(conn, spec)


# the sheltered worker processes this process started (``track``): killed at exit if still alive, since
# multiprocessing's own exit routine stops daemonic children with SIGTERM, which they leave to their (living) trainer,
# and then joins them without a timeout
_SHELTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def track(proc: Any) -> Any:
    """Register a started worker process that runs ``shelter_from_stop_signal`` (see ``_SHELTERED``); returns it."""
    _SHELTERED.add(proc)
    return proc


@atexit.register  # after multiprocessing.util's registration (imported above), so this runs before its exit routine
def kill_sheltered_at_exit() -> None:
    """SIGKILL every tracked worker still alive (a pool that a failing program never closed)."""
    for proc in list(_SHELTERED):
        try:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        except (OSError, ValueError, AssertionError):  # already reaped, closed, or not our child
            pass


class JobInbox:
    """Jobs handed to a pool's dispatch loop, which may already be running in another thread: ``put`` (any thread;
    cheap: an append and, when the loop may be asleep, one byte on a pipe), ``close`` (no more jobs), ``take`` (the
    loop: every job queued so far and whether the inbox is closed). ``waker`` is the pipe end the loop adds to its
    ``multiprocessing.connection.wait`` list so a new job wakes it; ``JobInbox(jobs)`` is closed from the start and
    has no pipe (a batch known in full)."""

    def __init__(self, jobs: Any = None) -> None:
        self._jobs: list[Any] = list(jobs) if jobs is not None else []
        self._lock = threading.Lock()
        self.closed = jobs is not None
        self._signalled = False
        self.waker, self._wake = mp.Pipe(duplex=False) if jobs is None else (None, None)

    def put(self, job: Any) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError("a job was put into a closed inbox")
            self._jobs.append(job)
            self._signal()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._signal()

    def _signal(self) -> None:
        if self._wake is not None and not self._signalled:
            self._signalled = True
            self._wake.send_bytes(b"1")

    def take(self) -> tuple[list[Any], bool]:
        """(the jobs queued since the last take, closed): nothing is put after ``closed`` was seen."""
        with self._lock:
            if self._signalled:
                while self.waker.poll():
                    self.waker.recv_bytes()
                self._signalled = False
            jobs, self._jobs = self._jobs, []
            return jobs, self.closed

    def wait(self, timeout: float | None = None) -> None:
        """Block until a job or the close arrives (at most ``timeout`` seconds); returns at once when closed."""
        if self.waker is not None and not self.closed:
            self.waker.poll(timeout)

    def release(self) -> None:
        """Close the pipe (after the loop has seen the inbox closed)."""
        for conn in (self.waker, self._wake):
            if conn is not None:
                conn.close()


def close_workers(workers: list[WorkerProcess]) -> None:
    """Ask each worker to stop (``None`` on its pipe), give it two seconds, then kill it."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        w.proc.join(timeout=2)
        w.kill()


def absolute_spec(spec: str) -> str:
    """``spec`` with a relative ``file.py`` made absolute, so workers started elsewhere find it."""
    target, sep, name = spec.strip().rpartition(":")
    if sep and (target.endswith(".py") or os.sep in target) and Path(target).is_file():
        return f"{Path(target).resolve()}:{name}"
    return spec


def start_context(start_method: str | None) -> Any:
    """The multiprocessing context: forkserver where the platform has it (preloading polyrl's light modules), else
    spawn; never fork (the parent holds a device context and threads)."""
    methods = mp.get_all_start_methods()
    method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["polyrl.algorithms.rewards", "polyrl.data.builtin"])
    return ctx


def serve(
    conn: Any,
    setup: Callable[[], Any],
    handle: Callable[[Any, Any], Any],
    fallback: Callable[[Any, str], Any],
) -> None:
    """A worker's body: ``state = setup()`` (a failure is sent as ``("init_error", message)``), ``("ready", pid)``,
    then for each job until ``None`` or a closed pipe, send ``handle(state, job)`` (nothing when it returns None). A
    reply that cannot be sent (unpicklable, say) is replaced by ``fallback(job, traceback_tail)``."""
    try:
        state = setup()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            reply = handle(state, job)
            if reply is not None:
                conn.send(reply)
        except Exception:  # noqa: BLE001 - never let the worker die silently
            conn.send(fallback(job, traceback.format_exc(limit=1)[-300:]))


def load_user_module(target: str, spec: str, what: str = "reward") -> Any:
    """The module of a user spec ``target`` (``path/to/file.py`` or ``package.module``) from ``--<what> spec``; a
    ConfigError says what is wrong. A file is imported once per process (cached in ``sys.modules``)."""
    if target.endswith(".py") or os.sep in target:
        path = Path(target).resolve()
        if path.is_dir():
            raise ConfigError(
                f"{what} file {target!r} is a folder (from --{what} {spec!r}); give the Python file in it: "
                f"--{what} path/to/file.py:name"
            )
        if not path.is_file():
            where = "" if str(path) == target else f" (looked for {path})"
            raise ConfigError(f"{what} file {target!r} does not exist{where} (from --{what} {spec!r})")
        mod_name = f"polyrl_user_{what}_{abs(hash(str(path)))}"
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except SystemExit as exc:  # sys.exit()/exit() at import would end the run without a word
            raise ConfigError(
                f"{what} file {target} failed to import: SystemExit: {exc.code} (it exits when imported; put that "
                'code under `if __name__ == "__main__":`)'
            ) from None
        except Exception as exc:  # noqa: BLE001 - the user's file: report what broke
            raise ConfigError(f"{what} file {target} failed to import: {type(exc).__name__}: {exc}") from None
        sys.modules[mod_name] = module
        return module
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"{what} module {target!r} cannot be imported ({exc}); give path/to/file.py:fn") from None
