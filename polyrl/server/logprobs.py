"""Log-probs in the two OpenAI shapes, from the engine's per-token values.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": None}``
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``; with ``echo``
  the prompt's tokens come first, the first of them with log-prob and top-logprobs ``None`` (``echo_logprobs``)
- vLLM's ``prompt_logprobs``: ``[None, {token id: {"logprob", "rank", "decoded_token"}}, ...]``

A token's string is ``tokenizer.decode([id])`` with special tokens kept (cached per id, with its JSON encoding and its
length; ``TokenText.fill`` decodes a request's unseen ids in one batch call); ``bytes`` are its UTF-8 bytes.
``scored_echo_blocks`` writes the legacy blocks of a directly scored request's prompts (``server/scoring.py``) as JSON
text at once, from the scorer's lists and those caches: the bytes ``json.dumps`` gives for what ``echo_logprobs`` +
``completion_logprobs`` build, without a dict per token. Its cost is mostly ``repr`` of each written log-prob (the
shortest round-trip digits, ~0.6 us a value); a prompt's leading positions that equal the previous prompt's
(lm-eval sends a document's choices as sorted neighbours) reuse that prompt's texts instead.
The engine's log-probs are ``log_softmax(logits / T)`` before top-k/top-p truncation (see ``polyrl.infer``).
This module only formats; it does not compute log-probs.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate, chain
from json.encoder import encode_basestring
from typing import Any

from polyrl.server.prompts import decode_prompts


class TokenText:
    """Token id -> the string OpenAI clients see for it (cached: the same ids come back all the time).

    ``fill(ids)`` decodes the ids not seen yet in one tokenizer call and caches, per id, the string, its JSON
    encoding (``json[id]``) and its length (``length[id]``, a text offset step); the direct scoring path reads
    those two dicts after a ``fill``. They are written length first, JSON last, so that a thread that finds an id
    in ``json`` finds it in ``length`` (``scored_body`` runs in the prep pool's threads)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.json: dict[int, str] = {}
        self.length: dict[int, int] = {}
        self._skipped: dict[int, str] = {}  # ``generated`` with special tokens skipped

    def fill(self, ids: Iterable[int]) -> None:
        """Cache the string, JSON text and length of every id in ``ids``: the new ones decoded at once (a fast
        tokenizer's Rust ``decode_batch`` where it computes what ``decode([id])`` does, ``prompts.decode_prompts``)."""
        new = sorted(set(ids).difference(self.json))
        if not new:
            return
        if self.tokenizer is None:
            texts = [f"token_id:{t}" for t in new]
        else:
            texts = decode_prompts(self.tokenizer, [[t] for t in new])
        cache, length, enc = self._cache, self.length, self.json
        for t, s in zip(new, texts):
            s = cache.setdefault(t, s)
            length[t] = len(s)
            enc[t] = encode_basestring(s)  # what json.dumps(s, ensure_ascii=False) writes, as Starlette encodes

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


def _clamped(values: list[float]) -> list[float]:
    """``[_safe(v) for v in values]``, the list itself when no value needs it (checked at C speed)."""
    if not values:
        return values
    total = sum(values)  # NaN when a value is
    if min(values) > -9999.0 and total == total:
        return values
    return [v if v > -9999.0 else -9999.0 for v in values]


_DECIMALS = [str(i) for i in range(1 << 12)]


def _decimals(upto: int) -> list[str] | None:
    """A list whose item ``i`` is ``str(i)`` for every ``i <= upto`` (a look-up is ~4x cheaper than formatting a
    small int: text offsets), grown by replacing it (other threads may be reading it); None past 2**20."""
    global _DECIMALS
    table = _DECIMALS
    if upto < len(table):
        return table
    if upto >= 1 << 20:
        return None
    table = _DECIMALS = [str(i) for i in range(1 << upto.bit_length())]
    return table


def _shared_positions(prompts: list[list[int]], lps: Any, tids: Any, tlps: Any, i: int) -> int:
    """How many leading scored positions of prompt ``i`` are those of prompt ``i - 1``: the positions inside their
    common token prefix, when every value there is the same (a batched forward need not give equal bits; a zero is
    not shared: 0.0 == -0.0, but they are written differently). lm-eval sorts its requests by tokens, so a
    document's choices of one length are neighbours that share the context."""
    n = 0
    for x, y in zip(prompts[i - 1], prompts[i]):
        if x != y:
            break
        n += 1
    n -= 1  # scored position j predicts token j + 1: both inside the common prefix
    if n <= 0:
        return 0
    own, alt = lps[i][:n], tlps[i][:n]
    if own == lps[i - 1][:n] and alt == tlps[i - 1][:n] and tids[i][:n] == tids[i - 1][:n]:
        if 0.0 not in own and 0.0 not in alt:
            return n
    return 0


def scored_echo_blocks(
    text_of: TokenText,
    prompts: list[list[int]],
    lps: list[list[float]],
    top_ids: list[list[int]],
    top_lps: list[list[float]],
    k: int,
    generated: bool,
) -> list[str]:
    """The JSON text of the legacy log-probs block of each directly scored prompt: the bytes of
    ``json.dumps(join_logprobs(echo_logprobs(...), completion_logprobs(...)))`` for its values, for all the prompts
    of a request at once.

    Per prompt ``i``: ``prompts[i]`` (n tokens); ``lps[i]``: the log-probs of tokens 1 .. n - 1; ``top_ids[i]`` /
    ``top_lps[i]``: the argmax (id, log-prob) after each of the n positions (``infer.scoring.score_prompts``). ``k``
    (0 or 1) alternatives per prompt token: with 1, the argmax where it is not the token (its string first, as
    ``echo_logprobs`` orders them; one entry, the argmax's value, when both decode to the same string).
    ``generated``: the greedy next token (``top_ids[i][-1]``) follows as the completion's one token, its own entry
    its only alternative.

    Cost: one ``repr`` per written log-prob (the shortest round-trip digits, ~0.6 us each: most of the time) and a
    short loop step per position; a prompt's leading positions that equal the previous prompt's
    (``_shared_positions``: lm-eval's choices of one document, neighbours in its sorted requests) reuse its texts,
    and text offsets come from a table of decimals."""
    text_of.fill(chain(chain.from_iterable(prompts), chain.from_iterable(top_ids)))
    enc, length = text_of.json, text_of.length
    fr = float.__repr__  # what json.dumps writes for a float
    lens = [list(map(length.__getitem__, ids)) for ids in prompts]
    decimals = _decimals(max(map(sum, lens), default=0))
    as_text = str if decimals is None else decimals.__getitem__
    out = []
    values: list[str] = []
    tops: list[str] = []
    for i, ids in enumerate(prompts):
        s = _shared_positions(prompts, lps, top_ids, top_lps, i) if i else 0
        strs = list(map(enc.__getitem__, ids))
        new_values = list(map(fr, _clamped(lps[i][s:])))
        if k:
            new_tops = []
            for t, st, r, a, av in zip(ids[s + 1 :], strs[s + 1 :], new_values, top_ids[i][s:], top_lps[i][s:]):
                if a == t:
                    new_tops.append(f"{{{st}:{r}}}")
                    continue
                sa = enc[a]
                ra = fr(av if av > -9999.0 else -9999.0)
                # another token that decodes as this one: one key, the argmax's value (echo_logprobs' setdefault)
                new_tops.append(f"{{{sa}:{ra}}}" if sa == st else f"{{{sa}:{ra},{st}:{r}}}")
        else:
            new_tops = [f"{{{st}:{r}}}" for st, r in zip(strs[s + 1 :], new_values)]
        values = values[:s] + new_values
        tops = tops[:s] + new_tops
        offsets = list(accumulate(lens[i], initial=0))
        last_values, last_tops = values, tops
        if generated:
            g = top_lps[i][-1]
            rg = fr(g if g > -9999.0 else -9999.0)
            sg = enc[top_ids[i][-1]]
            strs.append(sg)
            last_values, last_tops = [*values, rg], [*tops, f"{{{sg}:{rg}}}"]
        else:
            offsets.pop()
        head = "null," if ids else ""
        value_text = head + ",".join(last_values) if last_values else head[:-1]
        top_text = head + ",".join(last_tops) if last_tops else head[:-1]
        out.append(
            f'{{"tokens":[{",".join(strs)}],"token_logprobs":[{value_text}],"top_logprobs":[{top_text}],'
            f'"text_offset":[{",".join(map(as_text, offsets))}]}}'
        )
    return out


def scored_echo_json(
    text_of: TokenText,
    ids: list[int],
    lps: list[float],
    top_ids: list[int],
    top_lps: list[float],
    k: int,
    generated: bool,
) -> tuple[str, int]:
    """(JSON text of the legacy log-probs block, the echoed prompt's text length) of one directly scored prompt
    (``scored_echo_blocks`` of one prompt)."""
    (body,) = scored_echo_blocks(text_of, [ids], [lps], [top_ids], [top_lps], k, generated)
    return body, sum(map(text_of.length.__getitem__, ids))


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
