"""``POST /v1/chat/completions``: messages -> chat template -> engine -> OpenAI ``chat.completion`` (or
``chat.completion.chunk`` SSE stream).

Every parameter is checked before the prompt is built; the template is rendered and the prompt tokenised in
the server's prep pool (off the event loop), with early refusal once it exceeds the context minus
``max_tokens``. Without ``max_tokens`` a reply is at most ``ServeConfig.default_max_tokens`` tokens (and the
context left).

Streams send, per choice, a first chunk with ``delta.role``, one chunk per engine step that produced tokens
(``delta.content`` may be "" while text is held back for a possible stop string; ``logprobs`` cover exactly
that chunk's tokens), then a chunk with ``finish_reason``; with ``stream_options.include_usage`` every chunk
carries ``usage: null`` and a last chunk with no choices carries the usage. Not here: the HTTP app, auth.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from polyrl.errors import UserError
from polyrl.infer.sampling_params import MAX_TOP_LOGPROBS
from polyrl.server.api_errors import APIError, bad_request
from polyrl.server.logprobs import chat_logprobs
from polyrl.server.params import (
    check_max_tokens,
    check_n,
    check_ranges,
    default_max_tokens,
    prompt_budget,
    prompt_too_long,
    reject_unsupported,
    sampling_params,
)
from polyrl.server.prompts import PromptTooLong, render_request_template, template_kwargs, tokenize_capped
from polyrl.server.protocol import ChatCompletionRequest
from polyrl.server.streaming import DONE, final_outputs, guarded_stream, sse


def render_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content as one string (text parts joined)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}]: content parts of type {part.type!r} are not supported; send text",
                        f"messages.{i}.content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def prompt_ids(
    state: Any, messages: list[dict[str, Any]], template: str | None, kwargs: dict[str, Any], limit: int
) -> list[int]:
    """The chat prompt's token ids, at most ``limit`` of them (``PromptTooLong`` otherwise). Runs in the prep
    pool: templating and tokenising a large conversation must not hold the event loop."""
    tok = state.llm.tokenizer
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
    model = state.resolve_model(req.model)
    ctx = state.llm.max_model_len
    reject_unsupported(req)
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
    sampling_params(req, max_tokens, k)  # every value checked before any templating or tokenising
    template, kwargs = template_kwargs(req, state.config.allow_request_chat_template)
    messages = render_messages(req)
    try:
        ids = await state.prep(prompt_ids, state, messages, template, kwargs, prompt_budget(max_tokens, ctx))
    except PromptTooLong as exc:
        raise prompt_too_long(exc, max_tokens, ctx, "messages") from None
    check_max_tokens(max_tokens, param, len(ids), ctx, "messages")
    max_tokens = default_max_tokens(max_tokens, state.config.default_max_tokens, len(ids), ctx)
    params = sampling_params(req, max_tokens, k)
    params = state.with_adapter(params, model)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    group = state.engine.new_group()
    state.engine.submit(group, ids, params, stream=req.stream, request_id=rid)
    state.metrics.prompt_tokens.inc(len(ids))
    created = int(time.time())
    head = {"id": rid, "created": created, "model": model, "system_fingerprint": state.fingerprint}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return guarded_stream(group, _stream(state, group, req, head, len(ids), include_usage))
    out = (await final_outputs(group, request))[rid]
    choices = []
    for c in out.outputs:
        lp = None
        if req.logprobs:
            lp = chat_logprobs(state.token_text, c.token_ids, c.logprobs, c.top_logprobs, req.top_logprobs or 0)
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": lp,
                "finish_reason": _finish(c.finish_reason),
            }
        )
    return {"object": "chat.completion", **head, "choices": choices, "usage": _usage(len(ids), out.outputs)}


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _usage(num_prompt: int, outputs: list[Any]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion}


async def _stream(state: Any, group: Any, req: ChatCompletionRequest, head: dict, num_prompt: int, usage: bool):
    base = {"object": "chat.completion.chunk", **head}
    extra = {"usage": None} if usage else {}

    def chunk(index: int, delta: dict, logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    for i in range(req.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    finished: set[int] = set()
    last = None
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
                yield chunk(c.index, {"content": c.new_text}, lp)
            if c.finish_reason is not None:
                finished.add(c.index)
                yield chunk(c.index, {}, None, _finish(c.finish_reason))
    if usage and last is not None:
        yield sse({**base, "choices": [], "usage": _usage(num_prompt, last.outputs)})
    yield DONE
