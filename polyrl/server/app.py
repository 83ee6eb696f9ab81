"""The FastAPI application: routes, auth, OpenAI error bodies, request metrics and the engine's lifespan.

``build_app(llm, config)`` returns an app whose lifespan starts the engine thread and, on shutdown (after
uvicorn has let in-flight HTTP requests finish), drains the engine and stops the thread. In front of the
routes, ``_Guard`` checks the API key from the headers (401 before a byte of the body is read), refuses a
body over ``max_request_bytes`` (413, from Content-Length when it says so) and one that does not arrive
within ``body_timeout_s`` (408). Prompt building runs in the prep thread pool (``ServerState.prep``), so
the event loop keeps answering (``/health`` included) while a large prompt is templated or tokenised. Imports FastAPI at
module level: import this module only through ``polyrl.server.build_app`` (which explains a missing
install). Not here: the OpenAI endpoint logic (``chat.py``, ``completions.py``), running uvicorn
(``launch.py``).
"""

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyrl import __version__
from polyrl.server.api_errors import (
    APIError,
    bad_request,
    body_timeout,
    body_too_large,
    error_body,
    invalid_api_key,
    model_not_found,
    validation_message,
)
from polyrl.server.async_engine import AsyncEngine
from polyrl.server.chat import create_chat_completion
from polyrl.server.completions import create_completion
from polyrl.server.config import ServeConfig
from polyrl.server.logprobs import TokenText
from polyrl.server.metrics import ServerMetrics
from polyrl.server.protocol import (
    SURROGATE_ESCAPE,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ResponsesRequest,
    unpaired_surrogate,
)
from polyrl.server.responses import create_response
from polyrl.server.scoring import JSONText
from polyrl.server.streaming import ClientGone

log = logging.getLogger("polyrl.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics")


class ServerState:
    """What the endpoints share: the engine, its bridge, config, metrics and the model's public name."""

    def __init__(self, llm: Any, config: ServeConfig) -> None:
        self.llm = llm
        self.config = config
        self.metrics = ServerMetrics()
        self.engine = AsyncEngine(llm, config.max_queue, self.metrics)
        self.token_text = TokenText(llm.tokenizer)
        self.fingerprint = f"polyrl-{__version__}"
        self.created = int(time.time())
        # Chat templating and tokenisation: a few threads, so one huge prompt delays neither the event loop nor
        # the other requests' prompts (fast tokenizers release the GIL while they encode).
        self.prep_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="polyrl-prep")

    async def prep(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the prep pool (off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.prep_pool, fn, *args)

    @property
    def adapter_names(self) -> list[str]:
        """LoRA adapters served on the base (``LLM.load_adapters``); a request's ``model`` picks one."""
        bank = getattr(self.llm.model, "lora_bank", None)
        return list(bank.names) if bank is not None else []

    def resolve_model(self, name: str | None) -> str:
        served = self.config.served_model_name
        if name is None or name == served or name in self.adapter_names:
            return name or served
        raise model_not_found(name, [served, *self.adapter_names])

    def with_adapter(self, params: Any, model: str) -> Any:
        """``params`` running the adapter named ``model`` (unchanged for the base model)."""
        return params.clone(adapter=model) if model in self.adapter_names else params

    def model_cards(self) -> list[dict[str, Any]]:
        return [self.model_card()] + [self.model_card(name) for name in self.adapter_names]

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        card = {
            "id": name or self.config.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "polyrl",
            "max_model_len": self.llm.max_model_len,
        }
        if name is not None:
            card["parent"] = self.config.served_model_name  # a LoRA adapter on the served base
        return card


class _RequestMetrics:
    """Pure ASGI middleware counting requests by endpoint and status (works with streaming responses)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS or path.startswith("/v1/models/") else "other"
        endpoint = "/v1/models" if endpoint.startswith("/v1/models/") else endpoint
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.inc(1, endpoint, str(status["code"]))


def _key_ok(config: ServeConfig, headers: list[tuple[bytes, bytes]]) -> bool:
    auth = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), "")
    scheme, _, token = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode())


async def _send_error(send: Any, exc: APIError, close: bool = False) -> None:
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
    if close:  # the body was not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """Pure ASGI middleware: API key (from the headers, before the body), body size cap and body read deadline.

    The body is read here, whole, within ``body_timeout_s`` and ``max_request_bytes``, and replayed to the app;
    later ``receive`` calls (a client hanging up mid-stream) go to the server as before."""

    def __init__(self, app: Any, config: ServeConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.config
        headers = scope.get("headers", [])
        path = scope.get("path", "")
        if cfg.api_key is not None and (path == "/v1" or path.startswith("/v1/")) and not _key_ok(cfg, headers):
            await _send_error(send, invalid_api_key(), close=True)
            return
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if length is not None:
            if not length.strip().isdigit():
                await _send_error(send, APIError("the Content-Length header is not a number", 400), close=True)
                return
            if int(length) > cfg.max_request_bytes:
                await _send_error(send, body_too_large(int(length), cfg.max_request_bytes), close=True)
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await _send_error(send, body_timeout(cfg.body_timeout_s), close=True)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cfg.max_request_bytes:
                await _send_error(send, body_too_large(size, cfg.max_request_bytes, at_least=True), close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


# The answers the API gives besides 200, as the OpenAPI schema lists them (all with OpenAI's error body).
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "description": "Invalid request: a bad parameter (`param` names it), a prompt over the context, an "
        "unsupported option, a body that is not JSON"
    },
    401: {"description": "Missing or wrong API key (`Authorization: Bearer <key>`); checked before the body is read"},
    404: {"description": "Unknown model (`param`: model)"},
    408: {"description": "The request body did not arrive within the server's body timeout"},
    413: {"description": "The request body is larger than the server's limit (`--max-request-bytes`)"},
    429: {
        "description": "The queue is full for now (`--max-queue`); retry after `Retry-After` seconds",
        "headers": {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}},
    },
    500: {"description": "Internal error (a bug), or the engine failed while running the request"},
    503: {"description": "The engine stopped after an error, or the server is shutting down"},
}
_V1_ERRORS = {code: {"model": ErrorResponse, **spec} for code, spec in _ERRORS.items()}


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def check_text(state: ServerState, request: Request, body: Any) -> None:
    """400 naming the field when the body spelled a lone UTF-16 surrogate (``"\\ud800"``): no tokenizer takes it and
    no reply could carry it (UTF-8 cannot encode it). Only bodies with such an escape are walked."""
    if not SURROGATE_ESCAPE.search(await request.body()):
        return
    where = await state.prep(unpaired_surrogate, body)  # off the event loop: the body may be megabytes
    if where is not None:
        raise bad_request(
            f"{where} holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape), which is not text; send "
            "valid Unicode (a character outside the BMP as a surrogate pair, or as UTF-8)",
            where,
            "invalid_value",
        )


def build_app(llm: Any, config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig()
    state = ServerState(llm, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            # uvicorn has already waited for in-flight HTTP requests; finish whatever the engine still holds.
            drained = await state.engine.drain(config.drain_timeout_s)
            if not drained:
                log.warning(
                    "shutdown: %d requests still running after %.0fs; aborting them",
                    state.engine.num_in_flight,
                    config.drain_timeout_s,
                )
            state.engine.stop()
            state.prep_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="polyrl", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.polyrl = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        # keeps the exception's headers: a 405 carries `Allow`
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    @app.get("/health", responses={503: {"description": "The engine is not running (`detail` says why)"}})
    async def health() -> Response:
        if not state.engine.alive:
            reason = f"engine failed: {state.engine.error}" if state.engine.error else "engine not running"
            return JSONResponse({"status": "error", "detail": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses=_V1_ERRORS)
    async def list_models() -> dict:
        return {"object": "list", "data": state.model_cards()}

    @app.get("/v1/models/{model:path}", responses=_V1_ERRORS)
    async def get_model(model: str) -> dict:
        name = state.resolve_model(model)
        return state.model_card(name if name in state.adapter_names else None)

    def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        if isinstance(result, JSONText):  # a directly scored completion, encoded already (scoring.py)
            return Response(result.body, media_type="application/json")
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(result, media_type="text/event-stream", headers=headers)

    ok_chat = "A chat.completion object; with stream: true a text/event-stream of chat.completion.chunk events"
    ok_text = "A text_completion object; with stream: true a text/event-stream of text_completion events"

    @app.post("/v1/chat/completions", responses={200: {"description": ok_chat}, **_V1_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        await check_text(state, request, body)
        return respond(await create_chat_completion(state, body, request))

    @app.post("/v1/completions", responses={200: {"description": ok_text}, **_V1_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        await check_text(state, request, body)
        return respond(await create_completion(state, body, request))

    ok_resp = "A response object; with stream: true a text/event-stream of typed response.* events"

    @app.post("/v1/responses", responses={200: {"description": ok_resp}, **_V1_ERRORS})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        await check_text(state, request, body)
        return respond(await create_response(state, body, request))

    def openapi() -> dict[str, Any]:
        """FastAPI's schema without the 422 it adds to every route with a body: this server answers 400."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=__version__, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for op in operations.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(_Guard, config=config)
    app.add_middleware(_RequestMetrics, metrics=state.metrics)  # outermost: counts the guard's answers too
    return app
