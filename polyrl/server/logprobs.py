"""Log-probs in the two OpenAI shapes, from the engine's per-token values.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": None}``
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``; with ``echo``
  the prompt's tokens come first, the first of them with log-prob and top-logprobs ``None`` (``echo_logprobs``)
- vLLM's ``prompt_logprobs``: ``[None, {token id: {"logprob", "rank", "decoded_token"}}, ...]``

A token's string is ``tokenizer.decode([id])`` with special tokens kept (cached per id); ``bytes`` are its
UTF-8 bytes. The engine's log-probs are ``log_softmax(logits / T)`` before top-k/top-p truncation (see
``polyrl.infer``). This module only formats; it does not compute log-probs.
"""

from __future__ import annotations

from typing import Any


class TokenText:
    """Token id -> the string OpenAI clients see for it (cached: the same ids come back all the time)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

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
