"""Request bodies of the OpenAI API the server speaks, as strict pydantic models.

Strict: a string where a number belongs is a 400, not a silent conversion, and so is a number that is not
finite (Python's JSON parser reads ``NaN``, ``Infinity`` and ``1e400`` as floats; they stop here). Fields the
OpenAI API defines but polyrl cannot honour (penalties, logit_bias, ...) are accepted only at their
neutral value, and ``params.py`` says so in a 400 otherwise; tools and structured outputs are checked by
``tool_calls.py``. Unknown fields are ignored (as vLLM does), so
clients that send newer OpenAI fields keep working. Responses are built as plain dicts in ``chat.py`` /
``completions.py`` / ``responses.py``.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), which Python's parser reads into a ``str`` that no tokenizer
takes and no response can encode as UTF-8; ``unpaired_surrogate`` finds one (the app makes it a 400 naming the field).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # tool_calls, refusal, ... pass through
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(_Strict):
    """Fields shared by both endpoints: OpenAI's, then the extras vLLM users pass (via ``extra_body``)."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # structured outputs, vLLM's names (polyrl/server/tool_calls.py): the legacy guided_* and structured_outputs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless the server allows request templates (see prompts.py)
    prompt_logprobs: int | None = None  # vLLM's extra: the prompt tokens' log-probs with top-k alternatives


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (``responses.py``). ``input``: a string or a list of items (messages, function_call,
    function_call_output); ``text.format`` is the structured-output field; ``previous_response_id`` is refused
    (the server keeps no state)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    # vLLM-style extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None


class CompletionRequest(_Sampling):
    # "" is accepted, as the OpenAI API does: it is generated from the start-of-text token (completions.py)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: the prompt tokens' log-probs with top-k alternatives
    response_format: dict[str, Any] | None = None  # vLLM's extra here (OpenAI's completions have none): json_object ...


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every non-200 answer of the API (400, 401, 404, 405, 408, 413, 429, 500, 503): OpenAI's error body."""

    error: ErrorDetail


# A JSON body can hold a lone surrogate only as a \uD800-\uDFFF escape: bodies without one skip the walk.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _bad_text(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def unpaired_surrogate(value: Any, path: tuple[str, ...] = ()) -> str | None:
    """The dotted path (``messages.0.content``) of the first string in a parsed request (models, dicts, lists) that
    holds an unpaired UTF-16 surrogate, or None."""
    if isinstance(value, str):
        return ".".join(path) if _bad_text(value) else None
    if isinstance(value, BaseModel):
        items: Any = [*value.__dict__.items(), *(value.model_extra or {}).items()]
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = (*path, str(key).encode("utf-8", "backslashreplace").decode())  # the path is quoted in a reply
        if isinstance(key, str) and _bad_text(key):
            return ".".join(where)
        if isinstance(item, (str, BaseModel, dict, list)):
            found = unpaired_surrogate(item, where)
            if found is not None:
                return found
    return None
