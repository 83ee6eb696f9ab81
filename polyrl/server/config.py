"""ServeConfig: how the OpenAI-compatible server listens and admits requests, validated on construction.

Only numbers and names; the engine's own sizing (KV cache, batch limits) lives in
``polyrl.infer.RolloutConfig``. Nothing here imports FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.errors import ConfigError

MAX_N = 128  # OpenAI's limit on choices per request


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    served_model_name: str = "polyrl"  # the name clients pass as `model` (and /v1/models lists)
    api_key: str | None = None  # when set, /v1/* need `Authorization: Bearer <key>`
    max_queue: int | None = None  # requests allowed to wait for an engine slot; more get 429 (None = no limit)
    max_n: int = MAX_N
    log_level: str = "info"
    drain_timeout_s: float = 600.0  # on shutdown, how long to let in-flight requests finish

    def __post_init__(self) -> None:
        if not 0 <= int(self.port) <= 65535:
            raise ConfigError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")
        if not self.served_model_name or not isinstance(self.served_model_name, str):
            raise ConfigError("served_model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty; give a key or leave it unset to serve without one")
        if self.max_queue is not None and self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0 (or unset for no limit), got {self.max_queue}")
        if not 1 <= self.max_n <= 4096:
            raise ConfigError(f"max_n must be in [1, 4096], got {self.max_n}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
