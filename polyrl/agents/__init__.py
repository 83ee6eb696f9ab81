"""polyrl.agents: agentic multi-turn RL: environments, tool calls, episodes on the rollout engine, training.

- ``env``: ``Environment`` (``reset(example) -> messages``, ``step(assistant_message) -> EnvStep``),
  ``ToolEnvironment``, the registry (``--env calculator|guessing|path/to/file.py:Class``).
- ``tools``: Hermes/Qwen ``<tool_call>`` parsing into OpenAI ``tool_calls`` (malformed calls are observations).
- ``render``: chat-template prompts and per-turn observation deltas (earlier turns are never re-tokenised).
- ``episode``: the token-level record (ids, policy mask, old log-probs, turns, reward, metrics).
- ``pool``: environments in worker processes with timeouts; ``rollout``: many episodes at once on ``LLM``.
- ``config``: ``AgentConfig``, the ``[agent]`` table (``--env`` / ``--agent``), registered here into
  ``polyrl.run.episodes`` so online runs roll out episodes; ``train``: the episode steps of GRPO/GSPO/PPO;
  ``remote``: environment episodes in async RL's rollout worker processes (``async_producer = "process"``).
- ``proxy`` (token-exact recording of an ``openai``-client agent's calls) and ``proxy_server`` (the per-episode
  OpenAI-compatible endpoint; imports FastAPI, so it is imported only in proxy mode): ``--agent file.py:fn``.
- ``builtin``: the calculator and guessing environments, calculator SFT transcripts; ``demo``: ``polyrl demo
  --agent``.
Importing this package registers the ``[agent]`` table; it imports no FastAPI, transformers or device code.
"""

from __future__ import annotations

from polyrl.agents.config import TABLE, AgentConfig
from polyrl.agents.env import BUILTIN_ENVS, Environment, EnvStep, ToolEnvironment, register_env, resolve_env
from polyrl.agents.episode import Episode
from polyrl.agents.tools import format_tool_calls, parse_reply
from polyrl.run.episodes import register_episode_table

register_episode_table(TABLE, AgentConfig)

__all__ = [
    "BUILTIN_ENVS",
    "AgentConfig",
    "EnvStep",
    "Environment",
    "Episode",
    "ToolEnvironment",
    "format_tool_calls",
    "parse_reply",
    "register_env",
    "resolve_env",
]
