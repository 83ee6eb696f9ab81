"""``POST /v1/completions``: prompt(s) as text or token ids -> engine -> OpenAI ``text_completion`` (or its
SSE stream).

``prompt`` may be a string, a list of strings, a list of token ids or a list of id lists; choice ``i * n + j``
is sample ``j`` of prompt ``i``. ``echo`` prepends the prompt text (without prompt log-probs, which the
engine does not compute: ``echo`` with ``logprobs`` is a 400). Not here: chat templates (``chat.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from polyrl.errors import UserError
from polyrl.server.api_errors import bad_request
from polyrl.server.logprobs import completion_logprobs
from polyrl.server.params import check_max_tokens, check_n, reject_unsupported, sampling_params
from polyrl.server.protocol import CompletionRequest
from polyrl.server.streaming import DONE, final_outputs, guarded_stream, sse


def split_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty; give a string, a list of strings or token ids", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def encode(llm: Any, prompts: list[str | list[int]]) -> list[tuple[str, list[int]]]:
    out = []
    for p in prompts:
        try:
            text, ids = llm.encode_prompt(p)
        except UserError as exc:
            raise bad_request(str(exc), "prompt") from exc
        if not ids:
            raise bad_request("the prompt is empty; give at least one token", "prompt")
        if text is None:
            text = llm.tokenizer.decode(ids) if llm.tokenizer is not None else ""
        out.append((text, ids))
    return out


async def create_completion(state: Any, req: CompletionRequest, request: Any) -> Any:
    model = state.resolve_model(req.model)
    reject_unsupported(req)
    check_n(req.n, state.config.max_n)
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (no prompt log-probs); drop one", "echo", "unsupported")
    prompts = encode(state.llm, split_prompts(req.prompt))
    for _, ids in prompts:
        check_max_tokens(req.max_tokens, "max_tokens", len(ids), state.llm.max_model_len, "prompt")
    params = sampling_params(req, req.max_tokens, req.logprobs)
    params = state.with_adapter(params, model)
    base_id = f"cmpl-{uuid.uuid4().hex}"
    group = state.engine.new_group()
    rids = []
    try:
        for i, (_, ids) in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            state.engine.submit(group, ids, params, stream=req.stream, request_id=rid)
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
    done = await final_outputs(group, request)
    choices = []
    completion_tokens = 0
    for rid in rids:
        pi = order[rid]
        prefix = prompts[pi][0] if req.echo else ""
        for c in done[rid].outputs:
            completion_tokens += len(c.token_ids)
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(state.token_text, c.token_ids, c.logprobs, c.top_logprobs, req.logprobs)
            choices.append(
                {
                    "index": pi * req.n + c.index,
                    "text": prefix + c.text,
                    "logprobs": lp,
                    "finish_reason": "stop" if c.finish_reason == "abort" else c.finish_reason,
                }
            )
    usage = {"prompt_tokens": num_prompt, "completion_tokens": completion_tokens}
    usage["total_tokens"] = num_prompt + completion_tokens
    return {"object": "text_completion", **head, "choices": choices, "usage": usage}


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
