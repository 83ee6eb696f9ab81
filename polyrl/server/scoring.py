"""Direct scoring of ``/v1/completions`` echo requests: lm-eval-harness's log-likelihood request (``echo: true``,
``logprobs: 1``, ``max_tokens`` 1 and greedy, or ``max_tokens`` 0) scored in one call on the engine thread instead
of one engine request per prompt.

``infer.scoring.score_prompts`` runs every prompt of the HTTP request through the model in a few batched forwards
between engine steps (``AsyncEngine.score``) and returns, per prompt position, the token's log-prob and the argmax
(id, log-prob); this module turns that into the ``RequestOutput`` the completions handler formats, equal to what the
request path gives: prompt log-probs with the top-1 alternative (the token's own entry carries its own log-prob, so a
greedy check is exact), and the one generated token = the argmax after the prompt (greedy), finishing ``stop`` when
it is an EOS id, else ``length``. Only requests whose answer cannot differ are taken (no sampling, stop strings or
ids, min_tokens, grammar, adapter, vLLM ``prompt_logprobs`` with ranks, streaming, n > 1, more than 1 alternative);
everything else takes the request path, and so does a batch the engine cannot score now (a ``UserError``: too few
free KV blocks while other requests run). Not here: HTTP, formatting (``completions.py``, ``logprobs.py``).
"""

from __future__ import annotations

from typing import Any

from polyrl.errors import UserError
from polyrl.infer.scoring import supports_scoring
from polyrl.infer.sequence import CompletionOutput, PromptLogprobs, RequestOutput
from polyrl.server.streaming import final_outputs


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


async def scored_outputs(engine: Any, rids: list[str], prompts: list[tuple[str, list[int]]], params: Any) -> dict:
    """request id -> ``RequestOutput`` of each prompt, scored in one engine-thread call."""
    llm = engine.llm
    try:
        res = await engine.score([ids for _, ids in prompts])
    except UserError:  # e.g. running requests hold the KV blocks a batch needs: the request path waits for them
        return await _request_path(engine, rids, prompts, params)
    k = params.prompt_logprobs or 0  # alternatives per prompt token: 0 or 1 (``direct_scoring``)
    done = {}
    for i, (rid, (text, ids)) in enumerate(zip(rids, prompts)):
        lps, tops, top_lps = res.token_logprobs[i], res.top_ids[i], res.top_logprobs[i]
        alts: list[dict[int, float] | None] = [None]
        for target, lp, top, top_lp in zip(ids[1:], lps, tops, top_lps):
            alts.append({top: lp if top == target else top_lp} if k else {})
        pl = PromptLogprobs([None, *lps], alts, [None] * len(ids))
        tok, tok_lp = tops[-1], top_lps[-1]
        eos = tok in llm.eos_token_ids and not params.ignore_eos
        skip = params.skip_special_tokens
        out_text = "" if eos or llm.tokenizer is None else llm.tokenizer.decode([tok], skip_special_tokens=skip)
        completion = CompletionOutput(
            index=0,
            token_ids=[tok],
            text=out_text,
            logprobs=[tok_lp],
            cumulative_logprob=tok_lp,
            finish_reason="stop" if eos else "length",
            top_logprobs=[{tok: tok_lp}] if params.logprobs is not None else None,
        )
        done[rid] = RequestOutput(rid, list(ids), [completion], True, text, pl)
    return done


async def _request_path(engine: Any, rids: list[str], prompts: list[tuple[str, list[int]]], params: Any) -> dict:
    """The same prompts as one engine request each (what ``completions.py`` does for every other request)."""
    group = engine.new_group()
    try:
        for rid, (_, ids) in zip(rids, prompts):
            engine.submit(group, ids, params, stream=False, request_id=rid, admitted=True)
    except Exception:
        group.abort()
        raise
    return await final_outputs(group, None)
