"""The episode-producer registry: how a layer above the run machinery (``polyrl.agents``) makes online runs roll out
multi-turn episodes instead of single completions, without ``polyrl.run`` importing it.

A producer registers its config table once, at import (``polyrl.agents`` does ``register_episode_table("agent",
AgentConfig)``). ``polyrl.run.config.build`` then accepts that ``[agent]`` table and stores the built config in
``RunConfig.episodes``; the online loop asks it for its run class (``run_class(base)``: ``base`` with the producer's
``collect`` / ``evaluate`` in front) and for the context its episodes need (``max_episode_tokens``).

Not here: environments, tools, the episode loop (``polyrl.agents``).
"""

from __future__ import annotations

from typing import Any, Protocol


class EpisodeConfig(Protocol):
    """A registered episode producer's built config table."""

    max_episode_tokens: int  # the whole episode, opening prompt included: the rollout context must hold it

    @property
    def reward_source(self) -> str:
        """Where the episodes' rewards come from, as the run's start line names it (not the algorithm's reward)."""

    def check(self, algo_config: Any, table: str) -> None:
        """Cross-table validation against the algorithm's ``[table]`` (a ConfigError says what to change)."""

    def run_class(self, base: type) -> type:
        """``base`` (an ``OnlineRun`` subclass) with the producer's episode steps in front."""


_TABLES: dict[str, type] = {}


def register_episode_table(name: str, config_cls: type) -> None:
    """Accept ``[name]`` in run configs, built into ``config_cls`` (an ``EpisodeConfig``)."""
    _TABLES[name] = config_cls


def episode_tables() -> dict[str, type]:
    """Every registered episode table: name -> config class."""
    return dict(_TABLES)


__all__ = ["EpisodeConfig", "episode_tables", "register_episode_table"]
