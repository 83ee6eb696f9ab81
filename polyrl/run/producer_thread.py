"""``ProducerThread``: the rollout producer's thread for the threaded async-RL sources (``async_rollout``).

What a ``ThreadPoolExecutor(max_workers=1)`` gives (calls run one at a time, in the order submitted, each with its
``concurrent.futures.Future``), with one difference that matters under torchrun: the thread is a daemon. An
executor's threads are joined when the interpreter exits, so a rank whose trainer failed while its producer was
inside a batch that waits on the other ranks (their gather, or an update whose all-gather needs this rank) could not
exit until the process group's timeout (30 minutes by default); torchrun only stops the other ranks once one has
exited. ``shutdown(wait=False)`` leaves such a batch behind, and the process exits with its error.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STOP = object()


class ProducerThread:
    """One daemon thread running the calls given to ``submit`` in order (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` in the thread, after every call submitted before it; its future."""
        if self._stopped:
            raise RuntimeError("the rollout producer thread was shut down; no more batches can be submitted")
        fut: Future[Any] = Future()
        self._calls.put((fut, fn, args))
        return fut

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is _STOP:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever reads the future, as an executor does
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking calls; ``cancel_futures``: cancel those not started; ``wait``: join the thread (the call it
        runs ends first). Idempotent."""
        if not self._stopped:
            self._stopped = True
            if cancel_futures:
                while True:
                    try:
                        item = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if item is not _STOP:
                        item[0].cancel()
            self._calls.put(_STOP)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


__all__ = ["ProducerThread"]
