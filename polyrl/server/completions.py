"""``POST /v1/completions``: prompt(s) as text or token ids -> engine -> OpenAI ``text_completion`` (or its
SSE stream).

``prompt`` may be a string, a list of strings, a list of token ids or a list of id lists; choice ``i * n + j``
is sample ``j`` of prompt ``i``. ``echo`` prepends the prompt text; with ``logprobs: k`` the log-probs block starts
with the prompt's tokens (the first one's log-prob ``null``), as OpenAI's legacy API and lm-eval-harness expect, and
``max_tokens: 0`` with ``echo`` scores the prompt without generating. vLLM's ``prompt_logprobs: k`` adds a
``prompt_logprobs`` list to each choice. Prompt log-probs come from the engine's prefill
(``polyrl/infer/prompt_logprobs.py``) and are not streamed (a 400 says so). ``prompt: ""`` is accepted, as the
OpenAI API accepts it: it is generated from the tokenizer's BOS token (EOS when it has none, like OpenAI's
<|endoftext|>). Prompts are tokenised in the server's prep pool, refused early once over the context minus
``max_tokens``; a batch with more prompts than ``--max-queue`` is a 400 (it could never be admitted). Structured
outputs: vLLM's ``guided_*`` / ``structured_outputs``, or ``response_format`` as on chat (vLLM takes it here too).
Not here: chat templates (``chat.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from polyrl.errors import UserError
from polyrl.server.api_errors import APIError, bad_request
from polyrl.server.logprobs import completion_logprobs, echo_logprobs, join_logprobs, vllm_prompt_logprobs
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
from polyrl.server.prompts import PromptTooLong, decode_prompts, tokenize_capped
from polyrl.server.protocol import CompletionRequest
from polyrl.server.scoring import direct_scoring, request_path, scored_body, scored_prompts
from polyrl.server.streaming import DONE, final_outputs, guarded_stream, sse
from polyrl.server.tool_calls import ToolPlan, compile_plan, extra_structured, response_format_output


def split_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty; give a string, a list of strings or token ids", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def start_token(tokenizer: Any) -> int | None:
    """What an empty text prompt is generated from: BOS, else EOS (OpenAI's models read "" as <|endoftext|>)."""
    for name in ("bos_token_id", "eos_token_id"):
        t = getattr(tokenizer, name, None)
        if isinstance(t, int):
            return t
    return None


def encode(llm: Any, prompts: list[str | list[int]], limit: int) -> list[tuple[str, list[int]]]:
    """(text, ids) of each prompt, at most ``limit`` tokens each (``PromptTooLong`` otherwise). Runs in the prep
    pool: tokenising a large prompt must not hold the event loop."""
    out = []
    vocab = llm.vocab_size
    for p in prompts:
        if isinstance(p, list) and p and min(p) >= 0 and max(p) < vocab:
            # token ids (ints: the request model is strict), in the vocabulary: what encode_prompt checks, at C speed
            out.append((None, list(p)))
            continue
        try:
            if isinstance(p, str) and llm.tokenizer is not None:
                text, ids = p, tokenize_capped(llm.tokenizer, p, limit, add_special_tokens=True)
            else:
                text, ids = llm.encode_prompt(p)
        except UserError as exc:
            raise bad_request(str(exc), "prompt") from exc
        if not ids and p == "" and start_token(llm.tokenizer) is not None:
            # Like the OpenAI API, an empty prompt is valid: the model continues from the start of a text.
            ids = [start_token(llm.tokenizer)]
        if not ids:
            raise bad_request("the prompt is empty; give at least one token", "prompt")
        out.append((text, ids))
    todo = [i for i, (text, _) in enumerate(out) if text is None]  # token-id prompts: their text, decoded at once
    if todo:
        texts = decode_prompts(llm.tokenizer, [out[i][1] for i in todo]) if llm.tokenizer is not None else None
        for j, i in enumerate(todo):
            out[i] = (texts[j] if texts is not None else "", out[i][1])
    return out


def completion_format(req: CompletionRequest) -> tuple[Any, str | None]:
    """(the grammar, its field): ``response_format`` (as vLLM takes it on completions) or vLLM's ``guided_*`` /
    ``structured_outputs`` (``tool_calls.py``); both is a 400."""
    extra, param = extra_structured(req)
    fmt = response_format_output(req.response_format) if req.response_format is not None else None
    if fmt is not None and extra is not None:
        raise bad_request(f"give either response_format or {param}, not both", param, "invalid_value")
    return (fmt, "response_format") if fmt is not None else (extra, param)


def prompt_logprobs_k(req: CompletionRequest) -> int | None:
    """Top-k the engine computes per prompt token (None: no prompt log-probs); a 400 when out of range."""
    k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        k = max(k or 0, req.logprobs)
    check_prompt_logprobs(k, req.stream)
    return k


def engine_max_tokens(req: CompletionRequest) -> int | None:
    """``max_tokens`` for the engine: ``max_tokens: 0`` (score the prompt only) runs one step and drops its token."""
    if req.max_tokens != 0:
        return req.max_tokens
    if not req.echo and req.prompt_logprobs is None:
        raise bad_request(
            "max_tokens 0 only scores the prompt: set echo: true (with logprobs) or prompt_logprobs, or ask for at "
            "least 1 token",
            "max_tokens",
            "invalid_value",
        )
    return 1


async def create_completion(state: Any, req: CompletionRequest, request: Any) -> Any:
    t_start = time.perf_counter()
    model = state.resolve_model(req.model)
    ctx = state.llm.max_model_len
    reject_unsupported(req)
    check_stream_options(req)
    check_n(req.n, state.config.max_n)
    check_ranges(req, state.llm.vocab_size, ctx)
    score_only = req.max_tokens == 0
    req_max_tokens = engine_max_tokens(req)
    prompt_k = prompt_logprobs_k(req)
    check_max_tokens(req_max_tokens, "max_tokens", 0, ctx, "prompt")
    sampling_params(req, req_max_tokens, req.logprobs)  # every value checked before any tokenising
    structured, structured_param = completion_format(req)
    await compile_plan(state, ToolPlan(None, None, True, structured, structured_param))
    items = split_prompts(req.prompt)
    max_queue = state.config.max_queue
    if max_queue is not None and len(items) > max_queue:
        # Never admissible, however idle the server: a 400, not a 429 that a client would retry forever.
        raise bad_request(
            f"this request has {len(items)} prompts but the server queues at most {max_queue} requests "
            f"(--max-queue {max_queue}); send at most {max_queue} prompts per request",
            "prompt",
            "invalid_value",
        )
    limit = prompt_budget(req_max_tokens, ctx)
    for p in items:
        if isinstance(p, list) and len(p) > limit:  # token ids: counted before any other work
            raise prompt_too_long(PromptTooLong(len(p), exact=True), req_max_tokens, ctx, "prompt")
    try:
        prompts = await state.prep(encode, state.llm, items, limit)
    except PromptTooLong as exc:
        raise prompt_too_long(exc, req_max_tokens, ctx, "prompt") from None
    for _, ids in prompts:
        check_max_tokens(req_max_tokens, "max_tokens", len(ids), ctx, "prompt")
    longest = max(len(ids) for _, ids in prompts)
    max_tokens = default_max_tokens(req_max_tokens, state.config.default_max_tokens, longest, ctx)
    params = sampling_params(req, max_tokens, req.logprobs)
    params = params.clone(structured=structured) if structured is not None else params
    if prompt_k is not None:
        params = params.clone(prompt_logprobs=prompt_k)
    params = state.with_adapter(params, model)
    state.engine.admit(len(prompts))  # the whole batch or none of it: 429 (Retry-After) when the queue is full
    base_id = f"cmpl-{uuid.uuid4().hex}"
    direct = direct_scoring(state.llm, req, params)  # lm-eval's scoring request: one engine-thread call (scoring.py)
    group = None if direct else state.engine.new_group()
    rids = []
    try:
        for i, (_, ids) in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            if not direct:
                state.engine.submit(group, ids, params, stream=req.stream, request_id=rid, admitted=True)
            rids.append(rid)
    except Exception:
        group.abort()
        raise
    num_prompt = sum(len(ids) for _, ids in prompts)
    state.metrics.prompt_tokens.inc(num_prompt)
    head = {"id": base_id, "created": int(time.time()), "model": model, "system_fingerprint": state.fingerprint}
    order = {rid: i for i, rid in enumerate(rids)}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return guarded_stream(group, _stream(state, group, req, head, prompts, order, num_prompt, include_usage))
    if direct:
        res = await scored_prompts(state.engine, prompts)
        if res is not None:  # the response written at once (scoring.py), off the event loop
            t1 = time.perf_counter()
            lp = req.logprobs
            body = await state.prep(
                scored_body, state.token_text, state.llm.eos_token_ids, prompts, res, params, lp, score_only, head
            )
            t2 = time.perf_counter()
            state.metrics.scoring_seconds.inc(t2 - t1, "format")
            state.metrics.scoring_seconds.inc(t2 - t_start, "request")
            return body
        done = await request_path(state.engine, rids, prompts, params)
    else:
        done = await final_outputs(group, request)
    choices = []
    completion_tokens = 0
    for rid in rids:
        pi = order[rid]
        prefix = prompts[pi][0] if req.echo else ""
        out = done[rid]
        echoed = None
        if prompt_k is not None and out.prompt_logprobs is None:
            raise APIError("the engine returned no prompt log-probs for this request", 500, "server_error")
        if req.echo and req.logprobs is not None:
            echoed = echo_logprobs(state.token_text, out.prompt_token_ids, out.prompt_logprobs, req.logprobs)
        for c in out.outputs:
            ids, text, lps, tops = c.token_ids, c.text, c.logprobs, c.top_logprobs
            if score_only:  # the one token the engine had to sample is not part of the answer
                ids, text, lps, tops = [], "", [], []
            completion_tokens += len(ids)
            lp = None
            if req.logprobs is not None:
                start = sum(len(t) for t in echoed["tokens"]) if echoed is not None else 0
                lp = completion_logprobs(state.token_text, ids, lps, tops, req.logprobs, start)
                lp = join_logprobs(echoed, lp) if echoed is not None else lp
            choice = {
                "index": pi * req.n + c.index,
                "text": prefix + text,
                "logprobs": lp,
                "finish_reason": "length" if score_only else _finish(c.finish_reason),
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    state.token_text, out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs
                )
            choices.append(choice)
    usage = {"prompt_tokens": num_prompt, "completion_tokens": completion_tokens}
    usage["total_tokens"] = num_prompt + completion_tokens
    return {"object": "text_completion", **head, "choices": choices, "usage": usage}


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


async def _stream(state, group, req, head, prompts, order, num_prompt: int, usage: bool):
    base = {"object": "text_completion", **head}
    extra = {"usage": None} if usage else {}

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    if req.echo:
        for pi, (text, _) in enumerate(prompts):
            for j in range(req.n):
                yield chunk(pi * req.n + j, text)
    finished: set[int] = set()
    offsets: dict[int, int] = {}
    completion_tokens = 0
    async for rs, out in group:
        pi = order[rs.request_id]
        for c in out.outputs:
            index = pi * req.n + c.index
            if index in finished:
                continue
            new = c.new_token_ids
            if new or c.new_text:
                lp = None
                if req.logprobs is not None:
                    n = len(new)
                    tops = c.top_logprobs[-n:] if (c.top_logprobs is not None and n) else None
                    start = offsets.get(index, 0)
                    lp = completion_logprobs(
                        state.token_text, new, c.logprobs[-n:] if n else [], tops, req.logprobs, start
                    )
                    offsets[index] = start + sum(len(t) for t in lp["tokens"])
                yield chunk(index, c.new_text, lp)
            if c.finish_reason is not None:
                finished.add(index)
                completion_tokens += len(c.token_ids)
                yield chunk(index, "", None, "stop" if c.finish_reason == "abort" else c.finish_reason)
    if usage:
        total = {"prompt_tokens": num_prompt, "completion_tokens": completion_tokens}
        total["total_tokens"] = num_prompt + completion_tokens
        yield sse({**base, "choices": [], "usage": total})
    yield DONE
