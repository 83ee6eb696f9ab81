"""Tool calls in the OpenAI format, parsed from and rendered to Qwen/Hermes-style ``<tool_call>`` text.

A model that calls tools writes, anywhere in its reply, blocks of
``<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>``. ``parse_reply(text)``
turns a reply into an OpenAI assistant message: ``content`` (the text outside the blocks, stripped; None when
empty), ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments": JSON string}}]``) and, for
blocks that are not a valid call, ``invalid_tool_calls`` (``[{"text", "error"}]``, LangChain's name). A malformed
call is data for the environment (an observation the policy learns from), never an exception.
``format_tool_calls`` renders calls back to text (for templates that do not render ``tool_calls`` themselves, and
for SFT transcripts); ``tools_system_text`` describes tools in a system prompt for such templates.
Not here: running tools (``polyrl.agents.env.ToolEnvironment``), chat templates (``polyrl.agents.render``).
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def _parse_one(body: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(function dict, None)`` for a valid call body, ``(None, why)`` otherwise."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(obj, dict):
        return None, "the tool call must be a JSON object with 'name' and 'arguments'"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, "the tool call has no 'name' string"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"the arguments of {name!r} are a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"the arguments of {name!r} must be a JSON object"
    return {"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)}, None


def parse_reply(text: str, call_prefix: str = "call") -> dict[str, Any]:
    """The OpenAI assistant message of a model reply (see the module docstring). Call ids are
    ``f"{call_prefix}_{k}"`` in order of appearance (valid calls only)."""
    calls: list[dict[str, Any]] = []
    invalid: list[dict[str, str]] = []
    for m in _BLOCK.finditer(text):
        fn, err = _parse_one(m.group(1).strip())
        if fn is None:
            invalid.append({"text": m.group(0), "error": err or "invalid"})
        else:
            calls.append({"id": f"{call_prefix}_{len(calls)}", "type": "function", "function": fn})
    rest = _BLOCK.sub("", text)
    if OPEN in rest:  # an opened block that never closed (the reply was cut, or the model forgot)
        start = rest.index(OPEN)
        invalid.append({"text": rest[start:], "error": f"a {OPEN} block is not closed with {CLOSE}"})
        rest = rest[:start]
    content = rest.strip() or None
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if invalid:
        msg["invalid_tool_calls"] = invalid
    return msg


def call_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """The decoded arguments of an OpenAI tool call (``function.arguments`` is a JSON string or a dict)."""
    args = call.get("function", {}).get("arguments", {})
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return args if isinstance(args, dict) else {}


def format_tool_calls(calls: list[dict[str, Any]]) -> str:
    """Calls (OpenAI ``tool_calls`` or ``{"name", "arguments"}`` dicts) as ``<tool_call>`` blocks, one per line."""
    parts = []
    for c in calls:
        fn = c.get("function", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # keep the string as the model wrote it
        parts.append(OPEN + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + CLOSE)
    return "\n".join(parts)


def assistant_text(message: dict[str, Any]) -> str:
    """An assistant message as the text a Hermes-style model writes: content, then its tool calls."""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if not calls:
        return content
    blocks = format_tool_calls(calls)
    return f"{content}\n{blocks}" if content else blocks


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """A compact system-prompt description of ``tools`` (OpenAI tool schemas) and how to call them."""
    lines = ["You may call tools. Tools:"]
    for t in tools:
        fn = t.get("function", t)
        params = sorted((fn.get("parameters") or {}).get("properties", {}))
        lines.append(f"- {fn['name']}({', '.join(params)}): {fn.get('description', '')}".rstrip(": "))
    lines.append(f'Call one as {OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}')
    return "\n".join(lines)


__all__ = ["assistant_text", "call_arguments", "format_tool_calls", "parse_reply", "tools_system_text"]
