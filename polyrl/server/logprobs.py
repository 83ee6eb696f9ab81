"""Log-probs in the two OpenAI shapes, from the engine's per-token values.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": None}``
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``

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
