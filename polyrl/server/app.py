"""The FastAPI application: routes, auth, OpenAI error bodies, request metrics and the engine's lifespan.

``build_app(llm, config)`` returns an app whose lifespan starts the engine thread and, on shutdown (after
uvicorn has let in-flight HTTP requests finish), drains the engine and stops the thread. Imports FastAPI at
module level: import this module only through ``polyrl.server.build_app`` (which explains a missing
install). Not here: the OpenAI endpoint logic (``chat.py``, ``completions.py``), running uvicorn
(``launch.py``).
"""

import contextlib
import hmac
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyrl import __version__
from polyrl.server.api_errors import APIError, error_body, invalid_api_key, model_not_found, validation_message
from polyrl.server.async_engine import AsyncEngine
from polyrl.server.chat import create_chat_completion
from polyrl.server.completions import create_completion
from polyrl.server.config import ServeConfig
from polyrl.server.logprobs import TokenText
from polyrl.server.metrics import ServerMetrics
from polyrl.server.protocol import ChatCompletionRequest, CompletionRequest
from polyrl.server.streaming import ClientGone

log = logging.getLogger("polyrl.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


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

    @property
    def adapter_names(self) -> list[str]:
        """LoRA adapters served on the base (``LLM.load_adapters``); a request's ``model`` picks one."""
        bank = getattr(self.llm.model, "lora_bank", None)
        return list(bank.names) if bank is not None else []

    def resolve_model(self, name: str | None) -> str:
        served = self.config.served_model_name
        if name is None or name == served or name in self.adapter_names:
            return name or served
        raise model_not_found(name)

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


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


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

    app = FastAPI(title="polyrl", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.polyrl = state

    async def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise invalid_api_key()

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
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            reason = f"engine failed: {state.engine.error}" if state.engine.error else "engine not running"
            return JSONResponse({"status": "error", "detail": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def list_models() -> dict:
        return {"object": "list", "data": state.model_cards()}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(require_key)])
    async def get_model(model: str) -> dict:
        name = state.resolve_model(model)
        return state.model_card(name if name in state.adapter_names else None)

    def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(result, media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return respond(await create_chat_completion(state, body, request))

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return respond(await create_completion(state, body, request))

    app.add_middleware(_RequestMetrics, metrics=state.metrics)
    return app
