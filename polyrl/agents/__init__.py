"""polyrl.agents: agentic multi-turn RL: environments, tool calls, episodes on the rollout engine, training.

- ``env``: ``Environment`` (``reset(example) -> messages``, ``step(assistant_message) -> EnvStep``),
  ``ToolEnvironment``, the registry (``--env calculator|guessing|path/to/file.py:Class``).
- ``tools``: Hermes/Qwen ``<tool_call>`` parsing into OpenAI ``tool_calls`` (malformed calls are observations).
- ``render``: chat-template prompts and per-turn observation deltas (earlier turns are never re-tokenised).
- ``episode``: the token-level record (ids, policy mask, old log-probs, turns, reward, metrics).
- ``pool``: environments in worker processes with timeouts; ``rollout``: many episodes at once on ``LLM``.
- ``train``: GRPO/GSPO/PPO over episodes (``polyrl train --algo grpo --env ...``).
- ``proxy`` (token-exact recording of an ``openai``-client agent's calls) and ``proxy_server`` (the per-episode
  OpenAI-compatible endpoint; imports FastAPI, so it is imported only in proxy mode): ``--agent file.py:fn``.
- ``builtin``: the calculator and guessing environments, calculator SFT transcripts; ``demo``: ``polyrl demo
  --agent``.
Importing this package imports no FastAPI, transformers or device code.
"""

from __future__ import annotations

from polyrl.agents.env import BUILTIN_ENVS, Environment, EnvStep, ToolEnvironment, register_env, resolve_env
from polyrl.agents.episode import Episode
from polyrl.agents.tools import format_tool_calls, parse_reply

__all__ = [
    "BUILTIN_ENVS",
    "EnvStep",
    "Environment",
    "Episode",
    "ToolEnvironment",
    "format_tool_calls",
    "parse_reply",
    "register_env",
    "resolve_env",
]
