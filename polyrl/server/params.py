"""From an OpenAI request body to the engine's ``SamplingParams``, with the checks that make bad requests 400s.

Checks here: fields polyrl cannot honour (non-neutral penalties, logit_bias, best_of != n, suffix; tools and
structured outputs: ``tool_calls.py``), the ranges of ``n``, ``max_tokens``, ``top_k``, ``seed``, ``min_tokens`` and
``stop_token_ids``, the number of ``stop`` strings (non-finite floats never get here: ``protocol.py`` refuses them),
the prompt's token budget and the context check (prompt + max_tokens must fit the engine's ``max_model_len``,
OpenAI's ``context_length_exceeded``), and the default completion length. Value checks of the sampling knobs
themselves stay in ``SamplingParams`` (its ``UserError`` becomes a 400 naming the parameter). Prompt
building (chat template, tokenisation) is the endpoints' job.
"""

from __future__ import annotations

from typing import Any

from polyrl.errors import UserError
from polyrl.infer.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from polyrl.server.api_errors import APIError, bad_request


def reject_unsupported(req: Any) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name, None)
        if value not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported by polyrl serve; leave it unset or 0", name, "unsupported")
    if getattr(req, "logit_bias", None):
        raise bad_request("logit_bias is not supported by polyrl serve; leave it unset", "logit_bias", "unsupported")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise bad_request("best_of other than n is not supported; leave it unset", "best_of", "unsupported")
    if getattr(req, "suffix", None):
        raise bad_request("suffix (insertion) is not supported; leave it unset", "suffix", "unsupported")


def check_stream_options(req: Any) -> None:
    """``stream_options`` shapes a stream: on a request that does not stream it is a 400, as OpenAI and vLLM answer
    (it would otherwise be ignored, and a client counting on ``include_usage`` chunks would never see them)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "stream_options is only allowed when stream is true; set stream: true or leave stream_options unset",
            "stream_options",
            "invalid_value",
        )


def check_n(n: int, max_n: int) -> None:
    if not 1 <= n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {n}", "n", "invalid_value")


INT32_MAX = 2**31 - 1
# Stop strings per request (OpenAI allows 4): each one is checked against every new piece of text on the engine
# thread, so a request with thousands of them slows every other request's steps.
MAX_STOP_STRINGS = 64


def check_ranges(req: Any, vocab_size: int, max_model_len: int) -> None:
    """Integer knobs within what the engine can hold (a JSON integer has no size limit)."""
    if req.top_k is not None and not -1 <= req.top_k <= INT32_MAX:
        raise bad_request(f"top_k must be -1, 0 (off) or a positive integer, got {req.top_k}", "top_k", "invalid_value")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise bad_request(f"seed must fit in 64 bits, got {req.seed}", "seed", "invalid_value")
    if not 0 <= req.min_tokens <= max_model_len:
        raise bad_request(
            f"min_tokens must be between 0 and the context length {max_model_len}, got {req.min_tokens}",
            "min_tokens",
            "invalid_value",
        )
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(
            f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed (OpenAI allows 4)",
            "stop",
            "invalid_value",
        )
    for i, t in enumerate(req.stop_token_ids or []):
        if not 0 <= t < vocab_size:
            raise bad_request(
                f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})",
                f"stop_token_ids.{i}",
                "invalid_value",
            )


def prompt_budget(max_tokens: int | None, max_model_len: int) -> int:
    """The most prompt tokens a request may have: the context minus its completion (at least one token)."""
    return max_model_len - (max_tokens or 1)


def prompt_too_long(exc: Any, max_tokens: int | None, max_model_len: int, param: str) -> APIError:
    """The 400 for a prompt over ``prompt_budget`` (``exc``: a ``prompts.PromptTooLong``), naming the numbers."""
    limit = prompt_budget(max_tokens, max_model_len)
    has = f"{exc.at_least}" if exc.exact else f"more than {exc.at_least}"
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens and the completion needs "
        f"{max_tokens or 1}, so the prompt may have at most {limit} tokens; it has {has}. "
        f"Please reduce the length of the {param} or the completion.",
        param,
        "context_length_exceeded",
    )


def default_max_tokens(max_tokens: int | None, default: int, prompt_len: int, max_model_len: int) -> int:
    """``max_tokens`` or, when the request gave none, the server default bounded by the context left."""
    if max_tokens is not None:
        return max_tokens
    return max(1, min(default, max_model_len - prompt_len))


def check_max_tokens(max_tokens: int | None, param: str, prompt_len: int, max_model_len: int, what: str) -> None:
    """400 when ``max_tokens`` is out of range or prompt + max_tokens does not fit the context."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", param, "invalid_value")
    if max_tokens is not None and max_tokens > max_model_len:
        raise bad_request(
            f"{param} is too large: {max_tokens}. This model's maximum context length is {max_model_len} tokens.",
            param,
            "invalid_value",
        )
    need = prompt_len + (max_tokens or 1)
    if need > max_model_len:
        asked = f"{need} tokens ({prompt_len} in the {what}, {max_tokens or 1} in the completion)"
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {asked}. "
            f"Please reduce the length of the {what} or the completion.",
            "messages" if what == "messages" else "prompt",
            "context_length_exceeded",
        )


def check_prompt_logprobs(k: int | None, stream: bool) -> None:
    """400 unless ``prompt_logprobs`` (vLLM's extra) is unset or in [0, MAX_TOP_LOGPROBS] on a non-streaming request
    (prompt log-probs are computed in the prefill and returned with the whole response)."""
    if k is None:
        return
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", "prompt_logprobs", "invalid_value"
        )
    if stream:
        raise bad_request(
            "prompt log-probs (echo with logprobs, or prompt_logprobs) are not streamed; set stream: false",
            "stream",
            "unsupported",
        )


def sampling_params(req: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for ``req``; invalid values become a 400 naming the parameter."""
    kw: dict[str, Any] = dict(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids or [],
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )
    try:
        return SamplingParams(**kw)
    except UserError as exc:
        msg = str(exc)
        detail = msg.split(": ", 1)[-1]
        param = detail.split(" ", 1)[0]
        raise APIError(msg, 400, "invalid_request_error", param if param in kw else None, "invalid_value") from exc
