"""Stopping a run on SIGTERM with nothing lost: the preemption signal of clusters and schedulers (Slurm, Kubernetes,
torchrun's agent when it is itself stopped).

``StopSignal`` (a context manager around the run loop, ``offline.run_steps``) catches SIGTERM in the main thread and
only records it: the step in progress finishes, the loop saves a checkpoint of that step (unless it just saved one)
and raises ``RunStopped``, which the CLI turns into its message and exit code 143 (128 + SIGTERM, so a scheduler
still sees a run that did not finish, and requeues it); ``--resume`` continues it exactly, as from any checkpoint. A
second SIGTERM restores the previous handler and delivers the signal again: the process stops at once (no new
checkpoint). Only one sent ``ECHO_S`` seconds or more after the first counts as that second one: Slurm signals every
process of the step at once, and torchrun's agent then passes the signal on to each rank again a moment later; that
echo must not end a rank that is finishing its step. Under torchrun every rank sees the signal (the agent forwards
it) but maybe at different steps: the loop agrees through one tiny all-reduce per step, so all ranks save the same
step and stop together. The grace the launcher allows between SIGTERM and SIGKILL must cover a step and a checkpoint
(Slurm: ``--signal``/``KillWait``; Kubernetes: ``terminationGracePeriodSeconds``). The signal often reaches every
process of the run at once (torchrun's agent sends it to each rank's process group, Slurm to every process of the
step): the reward, environment and rollout worker processes leave it to the trainer while it lives
(``algorithms.workers.shelter_from_stop_signal``), so the step in progress is scored and generated in full; the
pools stop them when the trainer closes them.

A SIGTERM while the run is finishing (its last step, the final checkpoint, the final model folder, the summary) does
not cut that short: those are moments away and are what the run is for, so the run completes them and ends as
finished (exit 0); a second SIGTERM still stops it at once. The trainers hold one ``StopSignal`` across the loop and
the finish for this (``OfflineRun.train``; ``OnlineRun.run`` around ``_run``, with PPO's final critic in its
``export_more`` and an agentic run's environment pool and agent proxy closed in ``EpisodeSteps._run``);
``run_steps`` calls ``finish()`` as the last step starts (no stop decision follows it), which switches the message.
Under the ``--nproc-per-node`` launcher, torchrun, signalled, exits 1 even then: the launcher exits 0 when the run's
``summary.json``, written since it started, says finished.

Ctrl-C (SIGINT) is left as it was (an immediate ``KeyboardInterrupt``): a terminal sends it to every process of the
foreground group, so reward, environment and rollout worker processes would die mid-step. Outside the main thread
(``fit()`` called from another thread) no handler can be installed and nothing changes.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from polyrl.errors import RunStopped

STOP_SIGNALS = (signal.SIGTERM,)
ECHO_S = 5.0  # a repeat of the signal sooner than this after the first is its echo (ignored)


class StopSignal:
    """``with StopSignal() as stop:`` the stop signals are recorded in ``stop.received`` (the first one's number)
    instead of ending the process; the handlers in place before are restored on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.finishing = False  # the run is past its last step's decision: the signal lets it finish
        self._first = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # the second one: what the signal did before, now (not an echo)
            if time.monotonic() - self._first < ECHO_S:
                return
            self._restore()
            signal.raise_signal(signum)
            return
        self.received, self._first = signum, time.monotonic()
        what = (
            "the run is finishing: its final checkpoint and model are written first"
            if self.finishing
            else "the run stops after this step, with a checkpoint"
        )
        print(
            f"polyrl: {signal.Signals(signum).name} received: {what} (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def finish(self) -> None:
        """From now on the run is finishing: a signal lets it complete (a different message, no stop)."""
        self.finishing = True

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""


# RunStopped lives in polyrl.errors (the CLI catches it)
__all__ = ["ECHO_S", "STOP_SIGNALS", "RunStopped", "StopSignal"]
