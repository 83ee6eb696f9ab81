"""``release``: a run's closing calls at its end, where one that fails must neither skip the others nor hide the run's
own error. After a failed run (``failed``) a closing call's error is logged and the next one runs: under torchrun a
failed rank leaves its producer thread behind (``async_rollout``'s ``close(abandon=True)``), and a call that races
it (an environment pool it still uses) may fail too, which would otherwise replace the run's error as the one the
user sees. After a run that went well every call still runs, and the first error is raised at the end (a later one
is logged)."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def release(closers: list[tuple[str, Callable[[], object]]], failed: bool) -> None:
    """Call each ``(what, close)`` of ``closers`` in order (see the module docstring)."""
    first: BaseException | None = None
    for what, close in closers:
        try:
            close()
        except Exception as exc:
            if failed:
                log.warning("closing the %s after the run failed raised %s: %s", what, type(exc).__name__, exc)
            elif first is None:
                first = exc
            else:  # only the first is raised: a later one would otherwise vanish unseen
                log.warning("closing the %s raised %s: %s", what, type(exc).__name__, exc)
    if first is not None:
        raise first


__all__ = ["release"]
