"""Environments written for other libraries, loaded into ``--env``: Gymnasium (the most used environment library
installable here: ``pip install -e ".[envs]"``) text environments, as ``--env gymnasium:TARGET``.

``TARGET`` is a registered id (``TextGuess-v0``, or ``my_package.envs:TextGuess-v0``, which imports the module
that registers it first; made with ``gymnasium.make``, wrappers such as ``TimeLimit`` included) or
``path/to/file.py:Class`` / ``module:Class`` naming a ``gymnasium.Env`` subclass (instantiated directly).

How an episode maps (``gymnasium_env(target)`` returns a class with the methods of a polyrl ``Environment``;
``step`` returns ``(messages, reward, done, metrics)``, which the environment pool takes as an ``EnvStep``):

- ``reset(example)`` -> ``env.reset(seed=S, options=example)``: the example dict a reward function gets (``prompt``,
  ``messages``, ``answer``, ``task``, ``metadata``) is the options, so an environment may use the data row; ``S`` is
  a hash of the example's prompt, so every sample of a GRPO group plays the same game. The observation becomes the
  opening ``user`` message (after a ``system`` message when the environment has a ``system_prompt`` attribute).
- ``step(assistant message)`` -> ``env.step(content)``: the action is the reply's text (``spaces.Text`` actions).
  The reward is Gymnasium's; ``terminated or truncated`` ends the episode; otherwise the observation is the next
  ``user`` message. Numeric ``info`` values are the step's metrics (``episode/<key>`` in the logs).
- Observations: a ``str``; a dict's ``"text"`` / ``"observation"`` / ``"prompt"`` entry; anything else as ``str()``.

Errors raised by the Gymnasium environment are counted environment failures, as for any ``--env``.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Mapping
from numbers import Real
from typing import Any

from polyrl.algorithms.workers import load_user_module
from polyrl.errors import ConfigError

PREFIX = "gymnasium:"


def _gymnasium() -> Any:
    try:
        return importlib.import_module("gymnasium")
    except ImportError:
        raise ConfigError(
            'gymnasium environments need gymnasium: pip install -e ".[envs]" (or pip install gymnasium)'
        ) from None


def _text(obs: Any) -> str:
    if isinstance(obs, str):
        return obs
    if isinstance(obs, Mapping):
        for key in ("text", "observation", "prompt"):
            if isinstance(obs.get(key), str):
                return obs[key]
    return str(obs)


def _seed(example: Mapping[str, Any]) -> int:
    key = str(example.get("prompt") or example.get("messages") or "")
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def _factory(target: str) -> Any:
    """A zero-argument callable making one Gymnasium environment of ``target`` (checked here, in the caller)."""
    gym = _gymnasium()
    module_name, sep, name = target.rpartition(":")
    if sep and (module_name.endswith(".py") or "/" in module_name):
        cls = getattr(load_user_module(module_name, f"{PREFIX}{target}", "env"), name, None)
    elif sep and name[:1].isupper() and "-v" not in name:
        try:
            cls = getattr(importlib.import_module(module_name), name, None)
        except ImportError as exc:
            raise ConfigError(f"environment module {module_name!r} cannot be imported ({exc})") from None
    else:  # a registered id, maybe "module:Id-v0" (the module registers it when imported)
        env_id = name if sep else target
        if sep:
            try:
                importlib.import_module(module_name)
            except ImportError as exc:
                raise ConfigError(f"environment module {module_name!r} cannot be imported ({exc})") from None
        try:
            gym.spec(env_id)
        except Exception as exc:  # noqa: BLE001 - gymnasium raises several error types for an unknown id
            raise ConfigError(f"--env {PREFIX}{target}: {type(exc).__name__}: {exc}") from None
        return lambda: gym.make(env_id)
    if not (isinstance(cls, type) and issubclass(cls, gym.Env)):
        raise ConfigError(f"--env {PREFIX}{target}: {name!r} is not a gymnasium.Env subclass")
    return cls


def gymnasium_env(target: str) -> type:
    """The polyrl ``Environment`` class that plays Gymnasium environment ``target`` (see the module docstring)."""
    make = _factory(target)

    class GymnasiumEnvironment:  # an ``env.Environment`` by its methods (``env`` imports this module)
        gymnasium_target = target
        tools: list[dict[str, Any]] = []

        def __init__(self) -> None:
            self.env: Any = None

        def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
            self.env = make()
            obs, _info = self.env.reset(seed=_seed(example), options=dict(example))
            system = getattr(self.env.unwrapped, "system_prompt", None)
            opening = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
            return [*opening, {"role": "user", "content": _text(obs)}]

        def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool, dict[str, float]]:
            obs, reward, terminated, truncated, info = self.env.step(message.get("content") or "")
            done = bool(terminated or truncated)
            metrics = {
                str(k): float(v) for k, v in (info or {}).items() if isinstance(v, Real) and not isinstance(v, bool)
            }
            if done:
                self.env.close()
            return [] if done else [{"role": "user", "content": _text(obs)}], float(reward), done, metrics

    GymnasiumEnvironment.__name__ = GymnasiumEnvironment.__qualname__ = f"Gymnasium[{target}]"
    return GymnasiumEnvironment


__all__ = ["PREFIX", "gymnasium_env"]
