"""OpenAI-style API errors: the exception handlers raise and the JSON body clients expect.

Body: ``{"error": {"message", "type", "param", "code"}}``. Bad requests are 400 (never 422 or 500),
an unknown model 404, a missing or wrong API key 401, a body too large 413 or too slow 408, a full queue
429 (with ``Retry-After``), a stopped engine 503. This
module builds bodies only; ``app.py`` turns them into responses.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


def model_not_found(name: str, served: list[str] | None = None) -> APIError:
    """OpenAI's 404 for an unknown ``model``; ``served``: the names this server answers to, listed after it (so a
    client's guess such as ``polyrl`` says what to send instead)."""
    hint = f" This server serves: {', '.join(f'`{n}`' for n in served)}." if served else ""
    return APIError(
        f"The model `{name}` does not exist or you do not have access to it.{hint}",
        404,
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def invalid_api_key() -> APIError:
    return APIError(
        "Incorrect or missing API key. Pass it as `Authorization: Bearer <key>` (the key given to "
        "`polyrl serve --api-key` or POLYRL_API_KEY).",
        401,
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def queue_full(limit: int) -> APIError:
    return APIError(
        f"The server is busy: {limit} requests are already waiting. Retry later.",
        429,
        "rate_limit_exceeded",
        None,
        "rate_limit_exceeded",
        headers={"Retry-After": "1"},
    )


def body_too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    got = f"more than {limit}" if at_least else str(size)
    return APIError(
        f"The request body is {got} bytes; this server accepts at most {limit} (--max-request-bytes).",
        413,
        "invalid_request_error",
        None,
        "request_too_large",
    )


def body_timeout(timeout_s: float) -> APIError:
    return APIError(
        f"The request body did not arrive within {timeout_s:g}s; send the whole body promptly.",
        408,
        "invalid_request_error",
        None,
        "request_timeout",
    )


def unavailable(message: str) -> APIError:
    return APIError(message, 503, "server_error", None, "service_unavailable")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before"}


def _param_path(loc: tuple | list) -> str:
    """``body.stop.list[str].0`` -> ``stop.0``: drop the body prefix and pydantic's union-member tags."""
    keep = []
    for x in loc:
        s = str(x)
        if s == "body" and not keep:
            continue
        if isinstance(x, str) and (s in _TYPE_TAGS or "[" in s or s[:1].isupper()):
            continue
        keep.append(s)
    return ".".join(keep)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence and the offending parameter from pydantic's error list."""
    if not errors:
        return "invalid request body", None
    if errors[0].get("type") == "json_invalid":
        return f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', 'parse error')}", None
    seen: dict[str, str] = {}
    for e in errors:
        where = _param_path(e.get("loc", ())) or "body"
        seen.setdefault(where, e.get("msg", "invalid value"))
    parts = [f"{where}: {msg}" for where, msg in list(seen.items())[:3]]
    first = next(iter(seen))
    return "; ".join(parts), (None if first == "body" else first)
