"""The builtin environments: ``calculator`` (arithmetic the policy should hand to a tool) and ``guessing`` (a
multi-turn number-guessing game answered in ``user`` turns), plus ``calculator_transcripts``: tool-use
conversations for an SFT warm-up (a tiny model cannot call tools out of the box).

``calculator`` takes any example with a ``prompt`` and a numeric ``answer`` (e.g. ``builtin:arithmetic?max=999&
ops=*``): the policy may call ``calculator(expression)`` (evaluated safely: numbers, + - * / // % **, parentheses)
and finishes with a reply without tool calls; reward 1.0 when the last number in that reply equals the answer.
``guessing`` hides a number in ``1..hi`` (a hash of the prompt, ``hi`` from the example's metadata, default 8) and
answers each guess "higher"/"lower"; reward 1.0 for the right guess. Not here: the API (``env``), tool parsing.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from typing import Any

from polyrl.agents.env import EnvStep, ToolEnvironment

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def safe_eval(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError for anything else (names, calls, huge powers)."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](a, b)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        tree = ast.parse(str(expression).strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    try:
        return ev(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


def _last_number(text: str | None) -> str | None:
    found = _NUMBER.findall(text or "")
    return found[-1] if found else None


def _same_number(a: str | None, b: Any) -> bool:
    if a is None or b is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CALCULATOR_SYSTEM = "Use the calculator tool, then give the answer."


class CalculatorEnv(ToolEnvironment):
    """Arithmetic with a calculator tool (see the module docstring)."""

    tools = [CALCULATOR_TOOL]

    def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        self.answer = example.get("answer")
        return [{"role": "system", "content": CALCULATOR_SYSTEM}, {"role": "user", "content": example["prompt"]}]

    def calculator(self, expression: str) -> str:
        value = safe_eval(expression)
        return str(int(value)) if float(value).is_integer() else f"{value:.6g}"

    def finish(self, message: dict[str, Any]) -> EnvStep:
        right = _same_number(_last_number(message.get("content")), self.answer)
        return EnvStep([], 1.0 if right else 0.0, True, {"correct": float(right)})


class GuessingEnv(ToolEnvironment):
    """Guess the hidden number; the environment says higher or lower (see the module docstring)."""

    tools: list[dict[str, Any]] = []

    def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        self.hi = int((example.get("metadata") or {}).get("hi", 8))
        key = str(example.get("prompt", "")).encode()
        self.secret = 1 + int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % self.hi
        return [{"role": "user", "content": f"Guess my number from 1 to {self.hi}. Reply with one number."}]

    def finish(self, message: dict[str, Any]) -> EnvStep:
        guess = _last_number(message.get("content"))
        if guess is None:
            return EnvStep([{"role": "user", "content": "Reply with one number."}], 0.0, False, {"no_guess": 1.0})
        g = float(guess)
        if g == self.secret:
            return EnvStep([], 1.0, True, {"solved": 1.0})
        hint = "Higher." if g < self.secret else "Lower."
        return EnvStep([{"role": "user", "content": hint}], 0.0, False, {})


def calculator_transcripts(
    examples: list[dict[str, Any]], seed: int = 0, tool_fraction: float = 1.0, renderer: Any = None
) -> list[dict[str, Any]]:
    """SFT rows ``{"messages": [...]}`` of calculator episodes: the same opening messages as ``CalculatorEnv.reset``,
    then (a ``tool_fraction`` of the rows) a ``<tool_call>``, the tool result and the answer, or (the others) a
    direct guess, "The answer is N." with a wrong N, so that RL has a choice to learn. After a call the answer is
    the bare result: with results of one width (e.g. four digits) every copied digit then sits at a fixed distance
    from its source, which a 2-layer model learns in a few hundred steps. With a ``ChatRenderer`` the messages are
    written as its template renders them (tools block, calls as text), ready for ``polyrl train --algo sft``."""
    rng = random.Random(seed)
    rows = []
    for ex in examples:
        if rng.random() >= tool_fraction:
            msgs = CalculatorEnv().reset(ex)
            guess = int(float(ex["answer"])) + rng.choice([-10, -3, -1, 1, 2, 5, 10, 100])
            msgs.append({"role": "assistant", "content": f"The answer is {guess}."})
            rows.append({"messages": renderer.template_messages(msgs, [CALCULATOR_TOOL]) if renderer else msgs})
            continue
        expr = re.sub(r"^What is |\?$", "", ex["prompt"]).strip()
        env = CalculatorEnv()
        msgs = env.reset(ex)
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expr}},
        }
        result = env.calculator(expr)
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": result},
            {"role": "assistant", "content": result},
        ]
        rows.append({"messages": renderer.template_messages(msgs, [CALCULATOR_TOOL]) if renderer else msgs})
    return rows


__all__ = ["CalculatorEnv", "GuessingEnv", "calculator_transcripts", "safe_eval"]
