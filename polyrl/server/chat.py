"""``POST /v1/chat/completions``: messages -> chat template -> engine -> OpenAI ``chat.completion`` (or
``chat.completion.chunk`` SSE stream).

Every parameter is checked before the prompt is built; the template is rendered and the prompt tokenised in
the server's prep pool (off the event loop), with early refusal once it exceeds the context minus
``max_tokens``. Without ``max_tokens`` a reply is at most ``ServeConfig.default_max_tokens`` tokens (and the
context left).

Streams send, per choice, a first chunk with ``delta.role``, one chunk per engine step that produced tokens
(``delta.content`` may be "" while text is held back for a possible stop string; ``logprobs`` cover exactly
that chunk's tokens), then a chunk with ``finish_reason``; with ``stream_options.include_usage`` every chunk
carries ``usage: null`` and a last chunk with no choices carries the usage.

Tools (``tool_calls.py`` checks them): rendered by the chat template's own ``tools`` argument, or described in the
system prompt when the template has no tool support (``polyrl.agents.render.prepare_messages``, the agent proxy's
renderer too); assistant ``tool_calls`` and ``tool`` messages (``tool_call_id``) are passed to the template. The
reply is parsed by the model family's parser (``polyrl.agents.tool_parsers``): ``message.tool_calls`` and
``finish_reason: "tool_calls"`` when it called any; a reply cut by the token limit drops the call it left half
written (``tool_parsers.finished_text``: neither a call nor content) and keeps ``finish_reason: "length"``
(``tool_parsers.finish_reason``; the agent proxy answers alike). Streams send the
content before a call as it comes and each call, once complete, as two ``delta.tool_calls`` chunks (``{index, id,
type, function: {name, arguments: ""}}``, then ``{index, function: {arguments}}``). Not here: the HTTP app, auth.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from polyrl.agents.render import prepare_messages
from polyrl.agents.tool_parsers import ToolCallStream, finish_reason, finished_text
from polyrl.errors import UserError
from polyrl.infer.sampling_params import MAX_TOP_LOGPROBS
from polyrl.server.api_errors import APIError, bad_request
from polyrl.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from polyrl.server.params import (
    check_max_tokens,
    check_n,
    check_prompt_logprobs,
    check_ranges,
    check_stream_options,
    default_max_tokens,
    prompt_budget,
    prompt_too_long,
    reject_unsupported,
    sampling_params,
)
from polyrl.server.prompts import PromptTooLong, render_request_template, template_kwargs, tokenize_capped
from polyrl.server.protocol import ChatCompletionRequest
from polyrl.server.streaming import DONE, final_outputs, guarded_stream, sse
from polyrl.server.tool_calls import ToolPlan, compile_plan, plan_tools


def render_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content as one string (text parts, and an assistant's refusal
    parts, joined); any other part is a 400 naming it (``messages.N.content.M``)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(_part_text(part, i, j, m.role) for j, part in enumerate(content))
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name:
            msg["name"] = m.name
        extra = m.model_extra or {}
        if m.role == "assistant" and extra.get("tool_calls"):
            msg["tool_calls"] = _check_calls(extra["tool_calls"], i)
        if m.role == "tool":
            call_id = extra.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad_request(f"messages[{i}].tool_call_id must be a string", f"messages.{i}.tool_call_id")
            msg["tool_call_id"] = call_id or ""
        out.append(msg)
    return out


def _part_text(part: Any, i: int, j: int, role: str) -> str:
    """The text of content part ``j`` of message ``i``: a text part's ``text``, or an assistant's ``refusal``."""
    where = f"messages.{i}.content.{j}"
    if part.type == "refusal" and role == "assistant":
        refusal = (part.model_extra or {}).get("refusal")
        if not isinstance(refusal, str):
            raise bad_request(f"{where}.refusal must be a string", f"{where}.refusal", "invalid_value")
        return refusal
    if part.type != "text":
        raise bad_request(
            f"messages[{i}].content[{j}]: content parts of type {part.type!r} are not supported (this server serves "
            "a text model); send text parts",
            where,
            "unsupported",
        )
    if part.text is None:
        raise bad_request(
            f'{where}.text is required: a text part is {{"type": "text", "text": ...}}',
            f"{where}.text",
            "invalid_value",
        )
    return part.text


def _check_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` in the OpenAI shape (or a 400 naming the message)."""
    where = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", where, "invalid_value")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"messages[{i}].tool_calls[{k}] must be {{id, type: function, function: {{name, arguments}}}}",
                f"{where}.{k}",
                "invalid_value",
            )
        args = fn.get("arguments", "")
        if not isinstance(args, (str, dict)):
            raise bad_request(f"messages[{i}].tool_calls[{k}].function.arguments must be a JSON string", f"{where}.{k}")
        out.append(
            {"id": c.get("id") or f"call_{k}", "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def prompt_ids(
    state: Any,
    messages: list[dict[str, Any]],
    template: str | None,
    kwargs: dict[str, Any],
    limit: int,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat prompt's token ids, at most ``limit`` of them (``PromptTooLong`` otherwise). Runs in the prep
    pool: templating and tokenising a large conversation must not hold the event loop. ``tools`` are rendered
    by the template's ``tools`` argument, or into the system message when it has none (``prepare_messages``)."""
    tok = state.llm.tokenizer
    if tools:
        messages, native = prepare_messages(messages, tools, template or getattr(tok, "chat_template", None))
        kwargs = {**kwargs, "tools": native} if native else kwargs
    else:
        messages, _ = prepare_messages(messages, None, template or getattr(tok, "chat_template", None))
    try:
        if template is not None:
            cfg = state.config
            text = render_request_template(
                template, messages, kwargs, tok, cfg.chat_template_timeout_s, cfg.max_request_bytes
            )
        else:
            if tok is None or getattr(tok, "chat_template", None) is None:
                raise UserError("this tokenizer has no chat template; use generate() with plain prompts")
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except APIError:
        raise
    except UserError as exc:
        raise bad_request(f"{exc} (or call /v1/completions)", "messages") from exc
    except Exception as exc:  # jinja TemplateError: the template refused these messages
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    return tokenize_capped(tok, text, limit, add_special_tokens=False)


async def create_chat_completion(state: Any, req: ChatCompletionRequest, request: Any) -> Any:
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    model, ids, plan, group = await submit_chat(state, req, rid)
    created = int(time.time())
    head = {"id": rid, "created": created, "model": model, "system_fingerprint": state.fingerprint}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return guarded_stream(group, _stream(state, group, req, head, len(ids), include_usage, plan))
    out = (await final_outputs(group, request))[rid]
    choices = []
    for c in out.outputs:
        lp = None
        if req.logprobs:
            lp = chat_logprobs(state.token_text, c.token_ids, c.logprobs, c.top_logprobs, req.top_logprobs or 0)
        message, finish = reply_message(plan, c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
    body = {"object": "chat.completion", **head, "choices": choices, "usage": _usage(len(ids), out.outputs)}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(state.token_text, ids, out.prompt_logprobs, req.prompt_logprobs)
    return body


async def submit_chat(
    state: Any, req: ChatCompletionRequest, rid: str, format_param: str = "response_format"
) -> tuple[str, list[int], ToolPlan, Any]:
    """Check ``req``, build its prompt and submit it to the engine as request ``rid``: (model name, prompt ids, tool
    plan, stream group). Shared with the Responses API (``responses.py``)."""
    model = state.resolve_model(req.model)
    ctx = state.llm.max_model_len
    reject_unsupported(req)
    check_stream_options(req)
    check_n(req.n, state.config.max_n)
    check_ranges(req, state.llm.vocab_size, ctx)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
            "top_logprobs",
            "invalid_value",
        )
    use_mct = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if use_mct else req.max_tokens
    param = "max_completion_tokens" if use_mct else "max_tokens"
    check_max_tokens(max_tokens, param, 0, ctx, "messages")
    k = (req.top_logprobs or 0) if req.logprobs else None
    check_prompt_logprobs(getattr(req, "prompt_logprobs", None), req.stream)
    sampling_params(req, max_tokens, k)  # every value checked before any templating or tokenising
    template, kwargs = template_kwargs(req, state.config.allow_request_chat_template)
    tok = state.llm.tokenizer
    template_text = template or getattr(tok, "chat_template", None)
    plan = plan_tools(req, state.config.tool_call_parser, template_text, tok, req.response_format, format_param)
    messages = render_messages(req)
    await compile_plan(state, plan)
    try:
        budget = prompt_budget(max_tokens, ctx)
        ids = await state.prep(prompt_ids, state, messages, template, kwargs, budget, plan.tools)
    except PromptTooLong as exc:
        raise prompt_too_long(exc, max_tokens, ctx, "messages") from None
    check_max_tokens(max_tokens, param, len(ids), ctx, "messages")
    max_tokens = default_max_tokens(max_tokens, state.config.default_max_tokens, len(ids), ctx)
    params = apply_plan(sampling_params(req, max_tokens, k), plan)
    if getattr(req, "prompt_logprobs", None) is not None:  # vLLM's extra: the templated prompt's log-probs
        params = params.clone(prompt_logprobs=req.prompt_logprobs)
    params = state.with_adapter(params, model)
    group = state.engine.new_group()
    state.engine.submit(group, ids, params, stream=req.stream, request_id=rid)
    state.metrics.prompt_tokens.inc(len(ids))
    return model, ids, plan, group


def apply_plan(params: Any, plan: ToolPlan) -> Any:
    """``params`` with the plan's grammar, keeping special tokens in the text where the call marker is one."""
    changes: dict[str, Any] = {}
    if plan.structured is not None:
        changes["structured"] = plan.structured
    if plan.parser is not None and plan.parser.keep_special_tokens:
        changes["skip_special_tokens"] = False
    return params.clone(**changes) if changes else params


def call_prefix() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(plan: ToolPlan, text: str) -> dict[str, Any]:
    """The reply as an assistant message dict with ``content`` and (when any) ``tool_calls``; malformed call blocks
    stay in the content, so the client sees what the model wrote."""
    msg = plan.parser.parse(text, call_prefix())
    calls = msg.get("tool_calls") or []
    if not plan.parallel:
        calls = calls[:1]
    content = msg.get("content")
    if msg.get("invalid_tool_calls"):
        bad = "\n".join(x["text"] for x in msg["invalid_tool_calls"])
        content = f"{content}\n{bad}" if content else bad
    if not calls:
        content = text
    return {"content": content, "tool_calls": calls}


def reply_message(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """(the chat ``message``, the ``finish_reason``) of one choice."""
    if plan.parser is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason(reason, False)
    parsed = parse_calls(plan, finished_text(plan.parser, text, reason))
    message = {"role": "assistant", "content": parsed["content"], "refusal": None}
    if parsed["tool_calls"]:
        message["tool_calls"] = parsed["tool_calls"]
    return message, finish_reason(reason, bool(parsed["tool_calls"]))


def _usage(num_prompt: int, outputs: list[Any]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion}


async def _stream(
    state: Any, group: Any, req: ChatCompletionRequest, head: dict, num_prompt: int, usage: bool, plan: ToolPlan
):
    base = {"object": "chat.completion.chunk", **head}
    extra = {"usage": None} if usage else {}

    def chunk(index: int, delta: dict, logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    for i in range(req.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    finished: set[int] = set()
    last = None
    texts = [""] * req.n
    parsers = [ToolCallStream(plan.parser, call_prefix(), plan.parallel) for _ in range(req.n)] if plan.parser else None
    async for _, out in group:
        last = out
        for c in out.outputs:
            if c.index in finished:
                continue
            new = c.new_token_ids
            if new or c.new_text:
                lp = None
                if req.logprobs:
                    n = len(new)
                    tops = c.top_logprobs[-n:] if (c.top_logprobs is not None and n) else None
                    lp = chat_logprobs(state.token_text, new, c.logprobs[-n:] if n else [], tops, req.top_logprobs or 0)
                delta = c.new_text
                if parsers is not None:
                    texts[c.index] += c.new_text
                    delta = parsers[c.index].feed(texts[c.index])
                if parsers is None or delta or lp is not None:
                    yield chunk(c.index, {"content": delta}, lp)
            if c.finish_reason is not None:
                finished.add(c.index)
                called = False
                if parsers is not None:
                    rest, msg = parsers[c.index].finish(finished_text(plan.parser, c.text, c.finish_reason))
                    if rest:
                        yield chunk(c.index, {"content": rest})
                    for k, call in enumerate(msg.get("tool_calls") or []):
                        fn = call["function"]
                        head_call = {"index": k, "id": call["id"], "type": "function"}
                        yield chunk(
                            c.index, {"tool_calls": [{**head_call, "function": {"name": fn["name"], "arguments": ""}}]}
                        )
                        yield chunk(c.index, {"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
                    called = bool(msg.get("tool_calls"))
                yield chunk(c.index, {}, None, finish_reason(c.finish_reason, called))
    if usage and last is not None:
        yield sse({**base, "choices": [], "usage": _usage(num_prompt, last.outputs)})
    yield DONE
