"""A ``ToolEnvironment`` runs each tool as the method of the tool's name, so a tool whose method is missing (a typo
in either name) is a ConfigError when the environment is loaded, naming the tool and the methods there are. Before,
every call of that tool was silently answered "error: 'T' object has no attribute ..." and counted as a tool error,
so the policy learned that the tool always fails."""

from __future__ import annotations

import pytest

from polyrl.agents.pool import EnvInfo, EnvPool
from polyrl.errors import ConfigError

ENV = """
from polyrl.agents import EnvStep, ToolEnvironment

TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}

class Typo(ToolEnvironment):
    tools = [TOOL]
    def reset(self, example):
        return [{"role": "user", "content": "go"}]
    def calculater(self, expression):
        return 4
    def finish(self, message):
        return EnvStep([], 0.0, True)

class OwnStep(Typo):  # dispatches its tools itself: not checked
    def step(self, message):
        return EnvStep([], 1.0, True)
"""


def test_a_tool_without_its_method_is_refused_at_load(tmp_path):
    path = tmp_path / "tool_env.py"
    path.write_text(ENV)
    with pytest.raises(ConfigError) as err:
        EnvPool(f"{path}:Typo", workers=0)
    assert str(err.value) == (
        "Typo.tools offers 'calculator' but Typo has no method of that name (its methods: calculater, finish, reset); "
        "a ToolEnvironment runs each tool as the method named like it: rename the method or the tool"
    )
    assert [t["function"]["name"] for t in EnvInfo.of(f"{path}:OwnStep").tools] == ["calculator"]
    assert [t["function"]["name"] for t in EnvInfo.of("calculator").tools] == ["calculator"]
