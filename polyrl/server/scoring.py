"""Direct scoring of ``/v1/completions`` echo requests: lm-eval-harness's log-likelihood request (``echo: true``,
``logprobs: 1``, ``max_tokens`` 1 and greedy, or ``max_tokens`` 0) scored in one call on the engine thread instead
of one engine request per prompt, and its response written as JSON text at once.

``infer.scoring.score_prompts`` runs every prompt of the HTTP request through the model in a few batched forwards
between engine steps (``AsyncEngine.score``, which also merges the prompts of concurrent scoring requests into one call)
and returns, per prompt position, the token's log-prob and the argmax (id, log-prob). Prompts sharing a prefix of at
least one KV block and a token (lm-eval's choices of one document: the same context, a different choice) feed its whole
blocks once, through the model and the LM head, and identical prompts are scored once. ``scored_body`` turns that into
the response the request path gives, byte for byte as ``json.dumps`` writes it: prompt log-probs with the top-1
alternative (the token's own entry carries its own log-prob, so a greedy check is exact), and the one generated token =
the argmax after the prompt (greedy), finishing ``stop`` when it is an EOS id, else ``length``. The legacy log-probs
blocks of the prompts are written from the scorer's lists and per-token-id caches of the token's JSON string and length
(``logprobs.scored_echo_blocks``): no ``RequestOutput``, no dict per token, no generic JSON encoding of ~10^4 small
objects per request (those were ~85% of the event loop's time on lm-eval's requests); a prompt sharing its context with
the previous one reuses its texts.

Only requests whose answer cannot differ are taken (no sampling, stop strings or ids, min_tokens, grammar, adapter,
vLLM ``prompt_logprobs`` with ranks, streaming, n > 1, more than 1 alternative); everything else takes the request
path, and so does a batch the engine cannot score now (a ``UserError``: too few free KV blocks while other requests
run). Not here: HTTP, the general formatting (``completions.py``, ``logprobs.py``).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

from polyrl.errors import UserError
from polyrl.infer.scoring import supports_scoring
from polyrl.server.logprobs import scored_echo_blocks
from polyrl.server.streaming import final_outputs


class JSONText:
    """A response body already encoded as JSON (``app.respond`` sends it as ``application/json``)."""

    def __init__(self, body: bytes) -> None:
        self.body = body


def direct_scoring(llm: Any, req: Any, params: Any) -> bool:
    """Whether this completions request can be scored directly (its response cannot differ from the request path)."""
    return (
        bool(req.echo)
        and not req.stream
        and req.prompt_logprobs is None
        and params.n == 1
        and params.max_tokens == 1
        and (params.temperature == 0.0 or req.max_tokens == 0)  # max_tokens 0: the drawn token is dropped
        and (params.logprobs or 0) <= 1
        and (params.prompt_logprobs or 0) <= 1
        and not params.stop
        and not params.stop_token_ids
        and params.min_tokens == 0
        and params.structured is None
        and params.adapter is None
        and supports_scoring(llm)
    )


async def scored_prompts(engine: Any, prompts: list[tuple[str, list[int]]]) -> Any | None:
    """The engine's ``ScoreResult`` for every prompt (one engine-thread call), or None when the engine cannot score
    this batch now (e.g. running requests hold the KV blocks it needs: the request path waits for them)."""
    try:
        return await engine.score([ids for _, ids in prompts])
    except UserError:
        return None


def scored_body(
    text_of: Any,
    eos_ids: Any,
    prompts: list[tuple[str, list[int]]],
    res: Any,
    params: Any,
    logprobs: int | None,
    score_only: bool,
    head: dict[str, Any],
) -> JSONText:
    """The ``text_completion`` response of a directly scored request (``echo``; ``logprobs`` 0, 1 or None), as the
    request path would write it (``completions.create_completion``, Starlette's ``json.dumps``)."""
    k = params.prompt_logprobs or 0  # alternatives per prompt token: 0 or 1 (``direct_scoring``)
    eos_ids = set(eos_ids)
    tokenizer = text_of.tokenizer
    prompt_ids = [ids for _, ids in prompts]
    blocks = ["null"] * len(prompts)
    if logprobs is not None:
        blocks = scored_echo_blocks(
            text_of, prompt_ids, res.token_logprobs, res.top_ids, res.top_logprobs, k, not score_only
        )
    choices = []
    for i, (text, _) in enumerate(prompts):
        tok = res.top_ids[i][-1]
        eos = tok in eos_ids and not params.ignore_eos
        out_text = ""
        if not score_only and not eos and tokenizer is not None:
            out_text = text_of.generated(tok, params.skip_special_tokens)
        finish = "length" if score_only or not eos else "stop"
        choices.append(
            f'{{"index":{i},"text":{encode_basestring(text + out_text)},"logprobs":{blocks[i]},'
            f'"finish_reason":"{finish}"}}'
        )
    num_prompt = sum(map(len, prompt_ids))
    completion_tokens = 0 if score_only else len(prompts)
    usage = {"prompt_tokens": num_prompt, "completion_tokens": completion_tokens}
    usage["total_tokens"] = num_prompt + completion_tokens
    top = _dumps({"object": "text_completion", **head})
    body = f'{top[:-1]},"choices":[{",".join(choices)}],"usage":{_dumps(usage)}}}'
    return JSONText(body.encode("utf-8"))


def _dumps(value: Any) -> str:
    # Starlette's JSONResponse.render
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


async def request_path(engine: Any, rids: list[str], prompts: list[tuple[str, list[int]]], params: Any) -> dict:
    """The same prompts as one engine request each (what ``completions.py`` does for every other request)."""
    group = engine.new_group()
    try:
        for rid, (_, ids) in zip(rids, prompts):
            engine.submit(group, ids, params, stream=False, request_id=rid, admitted=True)
    except Exception:
        group.abort()
        raise
    return await final_outputs(group, None)
