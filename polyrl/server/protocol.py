"""Request bodies of the OpenAI API the server speaks, as strict pydantic models.

Strict: a string where a number belongs is a 400, not a silent conversion, and so is a number that is not
finite (Python's JSON parser reads ``NaN``, ``Infinity`` and ``1e400`` as floats; they stop here). Fields the
OpenAI API defines but polyrl cannot honour (penalties, logit_bias, tools, ...) are accepted only at their
neutral value, and ``params.py`` says so in a 400 otherwise. Unknown fields are ignored (as vLLM does), so
clients that send newer OpenAI fields keep working. Responses are built as plain dicts in ``chat.py`` /
``completions.py``.
"""

from __future__ import annotations

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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless the server allows request templates (see prompts.py)


class CompletionRequest(_Sampling):
    # "" is accepted, as the OpenAI API does: it is generated from the start-of-text token (completions.py)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every non-200 answer of the API (400, 401, 404, 405, 408, 413, 429, 500, 503): OpenAI's error body."""

    error: ErrorDetail
