"""The Responses API's items, shared by ``polyrl serve`` (``polyrl.server.responses``) and the agent proxy
(``proxy_server``): input items to chat messages and function tools to chat tools, and the output items and
response object back. Errors are ``ItemError`` (a ``UserError`` naming the request field and an OpenAI error code);
the HTTP layers turn them into 400s. Not here: HTTP, streaming events, sampling.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from polyrl.errors import UserError


class ItemError(UserError):
    """A request field the Responses conversion cannot take: ``param`` names it, ``code`` is OpenAI's."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ItemError(f"{where} must be a string or a list of text parts", where, "invalid_value")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and not isinstance(part.get("text"), str):
            raise ItemError(f"{where}.{j}.text must be a string", f"{where}.{j}.text", "invalid_value")
        if kind not in _TEXT_PARTS:
            raise ItemError(
                f"{where}[{j}]: content parts of type {kind!r} are not supported; send input_text", f"{where}.{j}",
                "unsupported",
            )  # fmt: skip
        out.append(part["text"])
    return "".join(out)


def input_messages(input: str | list[Any], instructions: str | None = None) -> list[dict[str, Any]]:
    """The conversation as chat messages (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        messages.append({"role": "user", "content": input})
        return messages
    if not isinstance(input, list):
        raise ItemError("input must be a string or a list of items", "input", "invalid_value")
    open_turn = False  # the last message is an assistant turn that function_call items may join
    for i, item in enumerate(input):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ItemError(f"{where} must be an object (a message or a function_call item)", where, "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ItemError(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}", f"{where}.role",
                    "invalid_value",
                )  # fmt: skip
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            open_turn = role == "assistant"
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise ItemError(
                    f"{where}: a function_call item needs string name, arguments and call_id", where, "invalid_value"
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if not open_turn:
                messages.append({"role": "assistant", "content": ""})
                open_turn = True
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ItemError(f"{where}.call_id must be a string", f"{where}.call_id", "invalid_value")
            output = item.get("output", "")
            output = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
            open_turn = False
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise ItemError(
                f"{where}: item references need stored responses, which polyrl serve does not keep; send the items",
                f"{where}.type",
                "unsupported",
            )
        else:
            raise ItemError(
                f"{where}: input items of type {kind!r} are not supported; send messages, function_call and "
                "function_call_output items",
                f"{where}.type",
                "unsupported",
            )
    if not messages:
        raise ItemError("input is empty; give at least one message", "input", "invalid_value")
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise ItemError(
                f"tools.{i}: only function tools are supported on polyrl serve, got type {kind!r}", f"tools.{i}",
                "unsupported",
            )  # fmt: skip
        if "name" not in t and isinstance(t.get("function"), dict):
            raise ItemError(
                f"tools.{i}: the Responses API takes function tools flat ({{type: function, name, parameters}}), "
                "not in chat's {type, function: {name, parameters}}",
                f"tools.{i}.name",
                "invalid_value",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
        raise ItemError(
            f"tool_choice of type {choice.get('type')!r} is not supported; use none, auto, required or a function",
            "tool_choice",
            "unsupported",
        )
    return choice


def usage(num_prompt: int, num_output: int) -> dict[str, Any]:
    return {
        "input_tokens": num_prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt + num_output,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    arguments = fn["arguments"] if status == "completed" else ""
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": arguments,
        "status": status,
    }


class ResponseShell:
    """The response object around its output items (``body``: the request's fields, as a dict or an object)."""

    def __init__(self, body: Any, model: str) -> None:
        body = body if isinstance(body, dict) else body.model_dump()
        self.body, self.model = body, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def build(self, status: str, output: list, usage: dict | None, incomplete: str | None = None) -> dict[str, Any]:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": b.get("temperature") if b.get("temperature") is not None else 1.0,
            "text": {"format": fmt},
            "tool_choice": b.get("tool_choice") if b.get("tool_choice") is not None else "auto",
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p") if b.get("top_p") is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": b.get("user"),
        }


def output_items(content: str | None, calls: list[dict[str, Any]], cut: bool = False) -> list[dict[str, Any]]:
    """A reply's output: a ``message`` item when there is text (or nothing else, unless the token limit ``cut`` it:
    a reply cut before any text or whole call has no items), then one ``function_call`` each."""
    head = [message_item(f"msg_{uuid.uuid4().hex}", content or "")] if content or not (calls or cut) else []
    return head + [call_item(c) for c in calls]


__all__ = [
    "ItemError",
    "ResponseShell",
    "call_item",
    "chat_tool_choice",
    "chat_tools",
    "input_messages",
    "message_item",
    "output_items",
    "usage",
]
