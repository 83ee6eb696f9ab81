"""Log-probs in the two OpenAI shapes, from the engine's per-token values.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": None}``
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``; with ``echo``
  the prompt's tokens come first, the first of them with log-prob and top-logprobs ``None`` (``echo_logprobs``)
- vLLM's ``prompt_logprobs``: ``[None, {token id: {"logprob", "rank", "decoded_token"}}, ...]``

A token's string is ``tokenizer.decode([id])`` with special tokens kept (cached per id, with its JSON encoding and its
length); ``bytes`` are its UTF-8 bytes. ``scored_echo_json`` writes the legacy block of a directly scored prompt
(``server/scoring.py``) as JSON text at once, from the scorer's flat lists and those caches: the bytes
``json.dumps`` gives for what ``echo_logprobs`` + ``completion_logprobs`` build, without a dict per token.
The engine's log-probs are ``log_softmax(logits / T)`` before top-k/top-p truncation (see ``polyrl.infer``).
This module only formats; it does not compute log-probs.
"""

from __future__ import annotations

import json
from itertools import accumulate
from typing import Any


class _Derived(dict):
    """token id -> ``fn(token string)``, filled on first use (``TokenText.json`` and ``TokenText.length``)."""

    def __init__(self, text_of: Any, fn: Any) -> None:
        super().__init__()
        self.text_of, self.fn = text_of, fn

    def __missing__(self, token_id: int) -> Any:
        value = self[token_id] = self.fn(self.text_of(token_id))
        return value


def _json_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # as the responses are encoded (Starlette's JSONResponse)


class TokenText:
    """Token id -> the string OpenAI clients see for it (cached: the same ids come back all the time).
    ``json[id]``: that string JSON-encoded; ``length[id]``: its length (a text offset step)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.json: dict[int, str] = _Derived(self, _json_str)
        self.length: dict[int, int] = _Derived(self, len)
        self._skipped: dict[int, str] = {}  # ``generated`` with special tokens skipped

    def generated(self, token_id: int, skip_special_tokens: bool) -> str:
        """A generated token's text: ``tokenizer.decode([id], skip_special_tokens=...)`` (cached)."""
        if not skip_special_tokens:
            return self(token_id)
        s = self._skipped.get(token_id)
        if s is None:
            s = self._skipped[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=True)
        return s

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            if self.tokenizer is None:
                s = f"token_id:{token_id}"
            else:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = s
        return s


def _safe(lp: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is what OpenAI itself returns for "never".
    return lp if lp > -9999.0 else -9999.0


def chat_logprobs(
    text_of: TokenText, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]] | None, k: int
) -> dict[str, Any]:
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        s = text_of(tid)
        alts = []
        if k and tops is not None and i < len(tops):
            for aid, alp in sorted(tops[i].items(), key=lambda kv: -kv[1])[:k]:
                a = text_of(aid)
                alts.append({"token": a, "logprob": _safe(alp), "bytes": list(a.encode("utf-8"))})
        content.append({"token": s, "logprob": _safe(lp), "bytes": list(s.encode("utf-8")), "top_logprobs": alts})
    return {"content": content, "refusal": None}


def completion_logprobs(
    text_of: TokenText,
    token_ids: list[int],
    logprobs: list[float],
    tops: list[dict[int, float]] | None,
    k: int,
    offset: int = 0,
) -> dict[str, Any]:
    tokens, offsets, top_list = [], [], []
    for i, tid in enumerate(token_ids):
        s = text_of(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top: dict[str, float] = {}
        if tops is not None and i < len(tops):
            for aid, alp in sorted(tops[i].items(), key=lambda kv: -kv[1])[:k]:
                top.setdefault(text_of(aid), _safe(alp))
        top.setdefault(s, _safe(logprobs[i]))
        top_list.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [_safe(lp) for lp in logprobs[: len(token_ids)]],
        "top_logprobs": top_list,
        "text_offset": offsets,
    }


def echo_logprobs(text_of: TokenText, prompt_ids: list[int], prompt_lps: Any, k: int) -> dict[str, Any]:
    """The prompt's part of an ``echo`` + ``logprobs`` completion (OpenAI's legacy shape): every prompt token, its
    log-prob (``None`` for the first, which nothing predicts) and its top-``k`` alternatives (``None`` there too).
    ``prompt_lps`` is the engine's ``PromptLogprobs``."""
    tokens, offsets, top_list, values = [], [], [], []
    offset = 0
    for i, tid in enumerate(prompt_ids):
        s = text_of(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        lp = prompt_lps.logprobs[i]
        if lp is None:
            values.append(None)
            top_list.append(None)
            continue
        values.append(_safe(lp))
        top: dict[str, float] = {}
        for aid, alp in sorted((prompt_lps.top_logprobs[i] or {}).items(), key=lambda kv: -kv[1])[:k]:
            top.setdefault(text_of(aid), _safe(alp))
        top.setdefault(s, _safe(lp))
        top_list.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_list, "text_offset": offsets}


def scored_echo_json(
    text_of: TokenText,
    ids: list[int],
    lps: list[float],
    top_ids: list[int],
    top_lps: list[float],
    k: int,
    generated: bool,
) -> tuple[str, int]:
    """(JSON text of the legacy log-probs block, the echoed prompt's text length) of one directly scored prompt:
    ``json.dumps(join_logprobs(echo_logprobs(...), completion_logprobs(...)))`` for its values, built without a dict
    per token.

    ``ids``: the prompt (n tokens); ``lps``: the log-probs of tokens 1 .. n - 1; ``top_ids`` / ``top_lps``: the argmax
    (id, log-prob) after each of the n positions (``infer.scoring.score_prompts``). ``k`` (0 or 1) alternatives per
    prompt token: with 1, the argmax where it is not the token (its string first, as ``echo_logprobs`` orders them;
    one entry when both decode to the same string). ``generated``: the greedy next token (``top_ids[-1]``) follows
    as the completion's one token, its own entry its only alternative."""
    enc, length = text_of.json, text_of.length
    n = len(ids)
    vals = [v if v > -9999.0 else -9999.0 for v in lps]  # _safe, NaN included
    strs = [enc[t] for t in ids]
    offsets = list(accumulate([length[t] for t in ids], initial=0))
    fr = float.__repr__  # what json.dumps writes for a float; the costliest step: once per value
    values = [fr(v) for v in vals]
    if k:
        tops = []
        for t, s, r, a, av in zip(ids[1:], strs[1:], values, top_ids, top_lps):
            if a == t:
                tops.append(f"{{{s}:{r}}}")
                continue
            sa = enc[a]
            ra = fr(av if av > -9999.0 else -9999.0)
            # another token that decodes as this one keeps its own log-prob (the string is the key)
            tops.append(f"{{{sa}:{ra}}}" if sa == s else f"{{{sa}:{ra},{s}:{r}}}")
    else:
        tops = [f"{{{s}:{r}}}" for s, r in zip(strs[1:], values)]
    if n:
        values.insert(0, "null")
        tops.insert(0, "null")
    if generated:
        g = top_lps[-1] if top_lps[-1] > -9999.0 else -9999.0
        sg = enc[top_ids[-1]]
        strs.append(sg)
        values.append(fr(g))
        tops.append(f"{{{sg}:{fr(g)}}}")
    total = offsets[-1]
    if not generated:
        offsets.pop()
    body = (
        f'{{"tokens":[{",".join(strs)}],"token_logprobs":[{",".join(values)}],'
        f'"top_logprobs":[{",".join(tops)}],"text_offset":[{",".join(map(str, offsets))}]}}'
    )
    return body, total


def join_logprobs(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy log-prob blocks as one (the echoed prompt's, then the completion's, whose offsets were counted
    from the end of the first's text)."""
    if second is None:
        return first
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(text_of: TokenText, prompt_ids: list[int], prompt_lps: Any, k: int) -> list[Any]:
    """vLLM's ``prompt_logprobs`` field: per prompt token ``None`` (the first) or ``{token id: {"logprob", "rank",
    "decoded_token"}}`` holding the prompt token and its top-k alternatives (JSON keys are strings). A rank is the
    token's place in the distribution (1 = likeliest); the prompt token's own rank is known when k > 0."""
    out: list[Any] = []
    for i, tid in enumerate(prompt_ids):
        lp = prompt_lps.logprobs[i]
        if lp is None:
            out.append(None)
            continue
        entry: dict[str, Any] = {}
        ranks = prompt_lps.ranks
        entry[str(tid)] = {
            "logprob": _safe(lp),
            "rank": ranks[i] if i < len(ranks) else None,
            "decoded_token": text_of(tid),
        }
        alts = sorted((prompt_lps.top_logprobs[i] or {}).items(), key=lambda kv: -kv[1])[:k]
        for r, (aid, alp) in enumerate(alts, start=1):
            if str(aid) not in entry:
                entry[str(aid)] = {"logprob": _safe(alp), "rank": r, "decoded_token": text_of(aid)}
        out.append(entry)
    return out
