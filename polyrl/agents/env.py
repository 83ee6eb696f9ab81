"""The environment API of agentic RL: ``Environment`` (``reset(example) -> messages``, ``step(assistant_message) ->
EnvStep``), ``ToolEnvironment`` (tools as Python methods, OpenAI tool schemas, malformed calls answered as
observations) and the registry that resolves ``--env NAME`` or ``--env path/to/file.py:Class``.

An episode: ``reset`` gets the prompt example (``{"prompt", "messages", "answer", "task", "metadata"}``, the same
dict a reward function receives) and returns the opening messages (system/user); the policy replies; ``step``
gets that reply as an OpenAI assistant message (``content``, ``tool_calls``, and ``invalid_tool_calls`` for blocks
that did not parse, see ``polyrl.agents.tools``) and returns the next observation messages (``tool`` or ``user``
role), a reward, whether the episode is over, metrics, and optionally the next turn's ``response_format``. The
episode's reward is the sum of its step rewards.
One instance serves one episode (a fresh instance per ``reset``), so an environment may keep state in ``self``.
Message content is text (a string or None; OpenAI ``{"type": "text"}`` parts are joined). Instances live in worker
processes (``polyrl.agents.pool``): an environment that raises, hangs or returns a message whose content is not text
ends its episode with the failure reward and is counted, never fatal.
Not here: running episodes on the engine (``rollout``), worker processes (``pool``), the builtins (``builtin``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from polyrl.agents.tools import call_arguments
from polyrl.algorithms.workers import load_user_module
from polyrl.errors import ConfigError

# name -> "module:Class"; add a builtin with a row here (or ``register_env`` at runtime).
BUILTIN_ENVS: dict[str, str] = {
    "calculator": "polyrl.agents.builtin:CalculatorEnv",
    "guessing": "polyrl.agents.builtin:GuessingEnv",
}


@dataclass
class EnvStep:
    """What ``Environment.step`` returns: observation messages, reward, done, and numeric metrics."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    # the format of the next assistant turn (``polyrl.agents.formats``); None: the environment's / the run's
    response_format: Any = None


class Environment:
    """Base class of an environment (see the module docstring). ``tools``: OpenAI tool schemas the policy is
    offered (rendered into the prompt by the chat template, or a system block when the template has no tools).
    ``response_format``: the format every assistant turn must match (an OpenAI ``response_format`` dict or a spec
    string, see ``polyrl.agents.formats``; with tools, a turn may call one instead); None = free (or the run's).
    ``parallel_tool_calls``: under a format, whether a turn may make several calls (False: one call or the answer)."""

    tools: list[dict[str, Any]] = []
    response_format: Any = None
    parallel_tool_calls: bool = True

    def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def step(self, message: dict[str, Any]) -> EnvStep:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """An environment whose tools are methods named in ``tools`` (``tools[i]["function"]["name"]``). A reply with
    tool calls gets one ``tool`` message per call (the method's return value as text; an exception or an unknown
    tool becomes ``"error: ..."`` and counts in ``tool_errors``; a malformed call is answered the same way). A reply
    without calls is the final answer: ``finish(message) -> EnvStep``. A tool without a method of its name is a
    ConfigError when the environment loads (unless the class overrides ``step``)."""

    def finish(self, message: dict[str, Any]) -> EnvStep:
        raise NotImplementedError

    def step(self, message: dict[str, Any]) -> EnvStep:
        calls = message.get("tool_calls") or []
        invalid = message.get("invalid_tool_calls") or []
        if not calls and not invalid:
            return self.finish(message)
        known = {t.get("function", t)["name"] for t in self.tools}
        out, errors = [], 0
        for c in calls:
            name = c["function"]["name"]
            try:
                if name not in known:
                    raise KeyError(f"unknown tool {name!r}; tools: {', '.join(sorted(known))}")
                result = str(getattr(self, name)(**call_arguments(c)))
            except Exception as exc:  # noqa: BLE001 - a failing tool call is an observation
                result, errors = f"error: {exc}", errors + 1
            out.append({"role": "tool", "tool_call_id": c.get("id", ""), "name": name, "content": result})
        for bad in invalid:
            out.append({"role": "tool", "content": f"error: {bad['error']}"})
        return EnvStep(out, 0.0, False, {"tool_errors": float(errors + len(invalid))})


def register_env(name: str, target: str) -> None:
    """Make ``target`` (``"module:Class"`` or ``"path/file.py:Class"``) available as ``--env name``."""
    BUILTIN_ENVS[name] = target


def resolve_env(spec: str) -> type:
    """The environment class of ``spec``: a builtin name, ``module:Class``, ``path/to/file.py:Class``, or
    ``gymnasium:TARGET`` (a Gymnasium text environment, ``polyrl.agents.adapters``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("no environment given; pass --env NAME (calculator, guessing) or --env file.py:Class")
    spec = spec.strip()
    if spec.startswith("gymnasium:"):
        # lazy: the adapter module holds environments of other libraries (it imports this module)
        from polyrl.agents.adapters import PREFIX, gymnasium_env

        return gymnasium_env(spec[len(PREFIX) :])
    target = BUILTIN_ENVS.get(spec, spec)
    module_name, sep, name = target.rpartition(":")
    if not sep or not module_name or not name:
        raise ConfigError(
            f"unknown environment {spec!r}; use a builtin ({', '.join(sorted(BUILTIN_ENVS))}) or path/to/file.py:Class"
        )
    if module_name.endswith(".py") or "/" in module_name:
        module = load_user_module(module_name, spec, "env")
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"environment module {module_name!r} cannot be imported ({exc})") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"environment {spec!r}: {module_name} has no class {name!r}")
    if not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ConfigError(f"environment {spec!r}: {name} needs reset(example) and step(message) methods")
    return cls


def env_tools(cls: type) -> list[dict[str, Any]]:
    """The tool schemas a class offers (validated: each needs a function name)."""
    tools = list(getattr(cls, "tools", []) or [])
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConfigError(f"{cls.__name__}.tools must be OpenAI tool schemas with function names, got {t!r}")
    if isinstance(cls, type) and issubclass(cls, ToolEnvironment) and cls.step is ToolEnvironment.step:
        # ToolEnvironment.step calls the method of each tool's name: a missing one would make every call of that
        # tool an "error: ... has no attribute" observation, run after run, with nothing said
        missing = [t.get("function", t)["name"] for t in tools]
        missing = [name for name in missing if not callable(getattr(cls, name, None))]
        if missing:
            own = sorted(k for k, v in vars(cls).items() if callable(v) and not k.startswith("_"))
            raise ConfigError(
                f"{cls.__name__}.tools offers {', '.join(map(repr, missing))} but {cls.__name__} has no method of that "
                f"name (its methods: {', '.join(own) or 'none'}); a ToolEnvironment runs each tool as the method named "
                "like it: rename the method or the tool"
            )
    return tools


__all__ = ["BUILTIN_ENVS", "EnvStep", "Environment", "ToolEnvironment", "env_tools", "register_env", "resolve_env"]
