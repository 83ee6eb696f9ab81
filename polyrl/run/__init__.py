"""polyrl.run: the run machinery that trains a registered algorithm end to end — the typed ``RunConfig`` (TOML +
overrides, ``config``), the loops (``offline``: packed data and one loss; ``online``: rollout, rewards, advantages;
``actor_critic``: online with a critic), the colocated policy they roll out with (``colocated``), data-parallel
steps (``data_parallel``), asynchronous RL (``async_rollout``, ``async_steps``; rollout worker processes:
``rollout_workers``, ``rollout_worker_process``, ``worker_partial``, ``replica_balance``, ``weight_sync``),
held-out evaluation (``evaluate``) and the episode-producer registry (``episodes``) that ``polyrl.agents`` plugs into.
``polyrl.trainer`` and the CLI build on it; ``polyrl.algorithms`` never imports it.

``run(cfg)`` picks the loop the algorithm names (``AlgorithmSpec.loop``) from ``LOOPS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

from polyrl.errors import ConfigError
from polyrl.run.actor_critic import run_actor_critic
from polyrl.run.config import RunConfig, build, resolve
from polyrl.run.offline import FINAL_DIR, run_offline
from polyrl.run.online import run_online

# loop name (``AlgorithmSpec.loop``) -> the function that runs it
LOOPS: dict[str, Callable[[RunConfig, TextIO | None], dict[str, Any]]] = {
    "offline": run_offline,
    "online": run_online,
    "actor_critic": run_actor_critic,
}


def run(cfg: RunConfig, stream: TextIO | None = None) -> dict[str, Any]:
    """Train ``cfg`` with the loop its algorithm names; returns the run summary."""
    loop = LOOPS.get(cfg.spec.loop)
    if loop is None:
        raise ConfigError(f"algorithm {cfg.algo!r} names loop {cfg.spec.loop!r}; known loops: {', '.join(LOOPS)}")
    return loop(cfg, stream)


__all__ = ["FINAL_DIR", "LOOPS", "RunConfig", "build", "resolve", "run"]
