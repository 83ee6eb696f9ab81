"""``AgentConfig``: the ``[agent]`` table of a run (``--env`` / ``--agent`` and their limits): it makes an online run
(GRPO, GSPO, PPO) roll out multi-turn episodes against an environment, or drive an openai-client agent program
through the proxy, instead of single completions. Registered into ``polyrl.run.episodes`` by ``polyrl.agents``, so
the run loop finds it without importing this package.

Not here: the episode steps themselves (``train``), environments (``env``), the episode loop (``rollout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl.agents.train import with_episodes
from polyrl.errors import ConfigError

TABLE = "agent"


@dataclass
class AgentConfig:
    """Episodes instead of single completions; ``max_new_tokens`` of the algorithm's table is per assistant turn."""

    env: str | None = None  # builtin environment (calculator, guessing) or path/to/file.py:Class
    agent: str | None = None  # proxy mode: path/to/file.py:fn, fn(base_url, example) -> reward, an openai-client agent
    max_turns: int = 4  # assistant turns per episode
    max_episode_tokens: int = 1024  # the whole episode, opening prompt included
    env_workers: int = 2  # processes; 0 = in this process (no timeout)
    env_timeout: float = 30.0  # seconds per reset/step call (proxy mode: per agent episode)

    def __post_init__(self) -> None:
        if self.env is None and self.agent is None:
            raise ConfigError(f"[{TABLE}] needs env (--env NAME) or agent (--agent file.py:fn)")
        if self.env is not None and self.agent is not None:
            raise ConfigError(f"{TABLE}.env and {TABLE}.agent are two ways to run episodes; set only one")
        if self.agent is not None and (not isinstance(self.agent, str) or ":" not in self.agent):
            raise ConfigError(f"{TABLE}.agent must be path/to/file.py:function (an agent taking base_url, example)")
        if self.env is not None and (not isinstance(self.env, str) or not self.env.strip()):
            raise ConfigError(f"{TABLE}.env must name an environment (calculator, guessing) or path/to/file.py:Class")
        for key in ("max_turns", "max_episode_tokens"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{TABLE}.{key} must be a positive integer, got {v!r}")
        if not isinstance(self.env_workers, int) or isinstance(self.env_workers, bool) or self.env_workers < 0:
            raise ConfigError(f"{TABLE}.env_workers must be >= 0, got {self.env_workers!r}")
        if not self.env_timeout > 0:
            raise ConfigError(f"{TABLE}.env_timeout must be > 0 seconds, got {self.env_timeout}")

    @property
    def reward_source(self) -> str:
        """The start line's reward: the environment's or the agent program's, not the algorithm's ``reward``."""
        return f"from the environment {self.env!r}" if self.env is not None else f"from the agent {self.agent!r}"

    def check(self, algo_config: Any, table: str) -> None:
        """Against the algorithm's ``[table]``: an online algorithm, room for more than one turn, and (async RL) a
        producer that runs episodes: inline, thread, or process (agent programs through the proxy too: in the rollout
        worker processes, under torchrun rank 0's). Partial rollouts take either kind of episode with the thread or
        the process producer (the episode loop, or the proxy's engine driver thread, calls the weight-swap hook between
        engine steps: the producer's, or in a rollout worker its job's), under torchrun too (the process producer's
        workers are rank 0's, ``train.EpisodeSteps.root_episodes``)."""
        max_new = getattr(algo_config, "max_new_tokens", None)
        if max_new is None:
            raise ConfigError(f"[{TABLE}] runs episodes for online RL (grpo, gspo, ppo), not for {table}")
        if self.max_episode_tokens <= max_new:
            raise ConfigError(
                f"{TABLE}.max_episode_tokens ({self.max_episode_tokens}) must exceed {table}.max_new_tokens "
                f"({max_new}, per turn); raise it"
            )
        # asynchronous RL takes every producer: the inline producer and the producer thread run episodes
        # (polyrl.agents.train), and the rollout worker processes run environment episodes and agent programs
        # (polyrl.agents.remote), with or without partial rollouts; the producer's own checks are the run's
        # (async_steps)

    def run_class(self, base: type) -> type:
        """``base`` with the episode steps in front (``train.with_episodes``)."""
        return with_episodes(base)


__all__ = ["TABLE", "AgentConfig"]
