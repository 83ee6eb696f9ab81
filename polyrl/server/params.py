"""From an OpenAI request body to the engine's ``SamplingParams``, with the checks that make bad requests 400s.

Checks here: fields polyrl cannot honour (non-neutral penalties, logit_bias, tools, structured output,
best_of != n, suffix), ``n`` and ``max_tokens`` ranges, and the context check (prompt + max_tokens must fit
the engine's ``max_model_len``, OpenAI's ``context_length_exceeded``). Value checks of the sampling knobs
themselves stay in ``SamplingParams`` (its ``UserError`` becomes a 400 naming the parameter). Prompt
building (chat template, tokenisation) is the endpoints' job.
"""

from __future__ import annotations

from typing import Any

from polyrl.errors import UserError
from polyrl.infer.sampling_params import SamplingParams
from polyrl.server.api_errors import APIError, bad_request


def reject_unsupported(req: Any) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name, None)
        if value not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported by polyrl serve; leave it unset or 0", name, "unsupported")
    if getattr(req, "logit_bias", None):
        raise bad_request("logit_bias is not supported by polyrl serve; leave it unset", "logit_bias", "unsupported")
    if getattr(req, "tools", None):
        raise bad_request("tool calling is not supported by polyrl serve; leave tools unset", "tools", "unsupported")
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type", "text") != "text":
        raise bad_request(
            f"response_format {fmt.get('type')!r} is not supported; only 'text'", "response_format", "unsupported"
        )
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise bad_request("best_of other than n is not supported; leave it unset", "best_of", "unsupported")
    if getattr(req, "suffix", None):
        raise bad_request("suffix (insertion) is not supported; leave it unset", "suffix", "unsupported")


def check_n(n: int, max_n: int) -> None:
    if not 1 <= n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {n}", "n", "invalid_value")


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
