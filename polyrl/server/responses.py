"""``POST /v1/responses``: OpenAI's Responses API over the chat path (``chat.submit_chat``), stateless.

Request -> chat: ``instructions`` becomes the system message; ``input`` is a string (one user message) or a list
of items: messages (``role`` user / system / developer (as system) / assistant, ``content`` a string or
``input_text`` / ``output_text`` parts), ``function_call`` items (joined into the assistant turn they follow, as
``tool_calls``), ``function_call_output`` items (``tool`` messages with ``tool_call_id`` = ``call_id``);
``reasoning`` items are skipped. ``tools`` are function tools (``{"type": "function", "name", "parameters"}``);
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text / json_object / json_schema: structured outputs),
``max_output_tokens``, ``temperature``, ``top_p`` map to their chat counterparts. ``store`` is accepted and nothing
is stored (the response says ``store: false``); ``previous_response_id`` and ``item_reference`` items are a 400
(send the whole conversation); ``background: true``, non-function tools, non-text content parts and
``top_logprobs`` are 400s naming the field. ``reasoning``, ``metadata``, ``include``, ``truncation``, ``user`` are
accepted and ignored (``metadata`` is echoed). A 400 from the chat path names the Responses field
(``in_responses_terms``: ``max_output_tokens``, ``input``, ``tools.N.name``).

Response: ``{"object": "response", "status": "completed" | "incomplete", "output": [message item (when there is
text), function_call items], "usage": {input_tokens, output_tokens, ...}}``; a reply cut by ``max_output_tokens``
is ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"``, its whole calls kept and a call it cut
half written dropped (no item, not message text; no message item when no text is left). ``stream: true`` sends the typed
events (``event: <type>`` + JSON with ``sequence_number``): response.created, response.in_progress, then for text
response.output_item.added, response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done, response.output_item.done, then per tool call response.output_item.added,
response.function_call_arguments.delta, response.function_call_arguments.done, response.output_item.done, and
response.completed (or response.incomplete). Not here: the HTTP app.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pydantic import ValidationError

from polyrl.agents.responses_items import (
    ItemError,
    ResponseShell,
    call_item,
    chat_tool_choice,
    chat_tools,
    input_messages,
    message_item,
    output_items,
    usage,
)
from polyrl.agents.tool_parsers import ToolCallStream, finished_text
from polyrl.server.api_errors import APIError, bad_request, validation_message
from polyrl.server.chat import call_prefix, parse_calls, submit_chat
from polyrl.server.protocol import ChatCompletionRequest, ResponsesRequest
from polyrl.server.streaming import final_outputs, guarded_stream


def to_chat(body: ResponsesRequest) -> tuple[ChatCompletionRequest, dict[str, Any] | None]:
    """(the chat request this Responses request runs as, its ``text.format``) or a 400."""
    try:
        return _to_chat(body)
    except ItemError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from None


def _to_chat(body: ResponsesRequest) -> tuple[ChatCompletionRequest, dict[str, Any] | None]:
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: polyrl serve keeps no response state; send the whole "
            "conversation in input (as the openai-agents SDK does by default)",
            "previous_response_id",
            "unsupported",
        )
    if body.background:
        raise bad_request("background responses are not supported; leave background unset", "background", "unsupported")
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses", "top_logprobs", "unsupported")
    fmt = (body.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format", "invalid_value")
    chat = {
        "model": body.model,
        "messages": input_messages(body.input, body.instructions),
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "seed": body.seed,
        "top_k": body.top_k,
        "min_p": body.min_p,
    }
    try:
        req = ChatCompletionRequest.model_validate_json(json.dumps({k: v for k, v in chat.items() if v is not None}))
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise bad_request(message, param, "invalid_value") from None
    return req, fmt


# The chat request's field names in a 400 from the chat path, as this request spelled them.
_RENAMES = [
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"\btool_choice\.function\."), "tool_choice."),
    (re.compile(re.escape('{"type": "function", "function": {"name": ...}}')), '{"type": "function", "name": ...}'),
    (re.compile(r"^messages$"), "input"),
    (re.compile(r"the length of the messages"), "the length of the input"),
]


def in_responses_terms(exc: APIError) -> APIError:
    """``exc`` (from the chat path) naming the Responses fields: ``max_output_tokens``, ``input``, ``tools.N.name``,
    ``tool_choice.name`` (flat function tools and tool choice) instead of ``max_tokens``, ``messages``,
    ``tools.N.function.name``, ``tool_choice.function.name``."""
    param, message = exc.param, exc.message
    for pattern, repl in _RENAMES:
        param = pattern.sub(repl, param) if param is not None else None
        message = pattern.sub(repl, message)
    return APIError(message, exc.status, exc.type, param, exc.code, exc.headers)


def _output(plan: Any, text: str, reason: str | None) -> list[dict[str, Any]]:
    """The reply's output items: its message (its content text) and its function calls. A reply cut by
    ``max_output_tokens`` drops the call it left half written (``finished_text``), and has no message item when
    no text is left (the cut came before any)."""
    text = finished_text(plan.parser, text, reason)
    calls: list[dict[str, Any]] = []
    if plan.parser is not None:
        parsed = parse_calls(plan, text)
        text, calls = parsed["content"] or "", parsed["tool_calls"]
    return output_items(text, calls, cut=reason == "length")


async def create_response(state: Any, body: ResponsesRequest, request: Any) -> Any:
    req, fmt = to_chat(body)
    if fmt is not None:
        req = req.model_copy(update={"response_format": fmt})
    rid = f"resp-{uuid.uuid4().hex}"
    try:
        model, ids, plan, group = await submit_chat(state, req, rid, "text.format")
    except APIError as exc:
        raise in_responses_terms(exc) from None
    shell = ResponseShell(body, model)
    if body.stream:
        return guarded_stream(group, _stream(state, group, shell, plan, len(ids)))
    out = (await final_outputs(group, request))[rid].outputs[0]
    output = _output(plan, out.text, out.finish_reason)
    cut = out.finish_reason == "length"
    counts = usage(len(ids), len(out.token_ids))
    return shell.build("incomplete" if cut else "completed", output, counts, "max_output_tokens" if cut else None)


def event(kind: str, seq: int, **fields: Any) -> str:
    data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


async def _stream(state: Any, group: Any, shell: ResponseShell, plan: Any, num_prompt: int):
    seq = 0

    def ev(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return event(kind, seq - 1, **fields)

    yield ev("response.created", response=shell.build("in_progress", [], None))
    yield ev("response.in_progress", response=shell.build("in_progress", [], None))
    parser = ToolCallStream(plan.parser, call_prefix(), plan.parallel) if plan.parser is not None else None
    msg_id = f"msg_{uuid.uuid4().hex}"
    text, sent, opened = "", "", False
    output: list[dict[str, Any]] = []
    final = None

    def open_message():
        yield ev("response.output_item.added", output_index=0, item=message_item(msg_id, "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield ev("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part)

    def text_delta(delta: str):
        nonlocal opened, sent
        if not delta:
            return
        if not opened:
            opened = True
            yield from open_message()
        sent += delta
        yield ev(
            "response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta=delta, logprobs=[]
        )

    async for _, out in group:
        c = out.outputs[0]
        if c.new_text:
            text += c.new_text
            for e in text_delta(parser.feed(text) if parser is not None else c.new_text):
                yield e
        if c.finish_reason is not None:
            final = c
    if final is None:  # aborted under us: the guard has already stopped the group
        return
    calls: list[dict[str, Any]] = []
    cut = final.finish_reason == "length"
    if parser is not None:
        whole = finished_text(plan.parser, final.text, final.finish_reason)
        rest, msg = parser.finish(whole)
        calls = msg.get("tool_calls") or []
        if not calls:
            rest = whole[len(sent) :] if whole.startswith(sent) else rest
        for e in text_delta(rest):
            yield e
    if opened or not (calls or cut):  # a cut reply with neither text nor calls has no message item
        if not opened:
            opened = True
            for e in open_message():
                yield e
        part = {"type": "output_text", "text": sent, "annotations": [], "logprobs": []}
        yield ev("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=sent, logprobs=[])
        yield ev("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        item = message_item(msg_id, sent)
        yield ev("response.output_item.done", output_index=0, item=item)
        output.append(item)
    for call in calls:
        k = len(output)
        item = call_item(call, "in_progress")
        yield ev("response.output_item.added", output_index=k, item=item)
        args = call["function"]["arguments"]
        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=k, delta=args)
        yield ev(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=k,
            arguments=args,
            name=call["function"]["name"],
        )
        done = call_item(call)
        yield ev("response.output_item.done", output_index=k, item=done)
        output.append(done)
    counts = usage(num_prompt, len(final.token_ids))
    status = "incomplete" if cut else "completed"
    response = shell.build(status, output, counts, "max_output_tokens" if cut else None)
    yield ev(f"response.{status}", response=response)


__all__ = ["create_response", "to_chat"]
