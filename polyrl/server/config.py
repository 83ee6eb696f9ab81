"""ServeConfig: how the OpenAI-compatible server listens and admits requests, validated on construction.

Only numbers and names; the engine's own sizing (KV cache, batch limits) lives in
``polyrl.infer.RolloutConfig``. Nothing here imports FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.errors import ConfigError

MAX_N = 128  # OpenAI's limit on choices per request
MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a request body larger than this is a 413 (read neither whole nor parsed)
DEFAULT_MAX_TOKENS = 1024  # a chat completion without max_tokens generates at most this (and the context left)


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    served_model_name: str = "polyrl"  # the name clients pass as `model` (and /v1/models lists)
    api_key: str | None = None  # when set, /v1/* need `Authorization: Bearer <key>`
    max_queue: int | None = None  # requests allowed to wait for an engine slot; more get 429 (None = no limit)
    max_request_bytes: int = MAX_REQUEST_BYTES  # body size cap: a larger body (or Content-Length) is a 413
    body_timeout_s: float = 30.0  # the whole body must arrive within this many seconds, else 408
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # chat completion length when the request gives none
    allow_request_chat_template: bool = False  # render a request's own chat_template (sandboxed, time-limited)
    chat_template_timeout_s: float = 2.0  # time limit of one request-supplied chat template render
    max_n: int = MAX_N
    log_level: str = "info"
    drain_timeout_s: float = 600.0  # on shutdown, how long to let in-flight requests finish
    # tool-call format (polyrl.agents.tool_parsers: hermes/qwen, llama3_json, mistral); None = from the chat template
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= int(self.port) <= 65535:
            raise ConfigError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")
        if not self.served_model_name or not isinstance(self.served_model_name, str):
            raise ConfigError("served_model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty; give a key or leave it unset to serve without one")
        if self.max_queue is not None and self.max_queue < 1:
            # 0 would refuse every request: a request waits, however briefly, before the engine takes it
            raise ConfigError(f"max_queue must be >= 1 (or unset for no limit), got {self.max_queue}")
        if not 1024 <= self.max_request_bytes <= 1 << 31:
            raise ConfigError(f"max_request_bytes must be in [1024, 2 GiB], got {self.max_request_bytes}")
        if not self.body_timeout_s > 0:
            raise ConfigError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not self.chat_template_timeout_s > 0:
            raise ConfigError(f"chat_template_timeout_s must be > 0, got {self.chat_template_timeout_s}")
        if not 1 <= self.max_n <= 4096:
            raise ConfigError(f"max_n must be in [1, 4096], got {self.max_n}")
        if self.tool_call_parser is not None:
            # lazy: the parser registry lives in polyrl.agents (a higher layer than this config's users need)
            from polyrl.agents.tool_parsers import TOOL_PARSERS

            if self.tool_call_parser not in TOOL_PARSERS:
                raise ConfigError(
                    f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))} (or unset to detect it "
                    f"from the chat template), got {self.tool_call_parser!r}"
                )
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
