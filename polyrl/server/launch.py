"""Running the server: in the foreground (``polyrl serve``) or in a background thread on a free port (tests,
``polyrl validate``'s serve level).

``start_server(llm, config)`` binds the socket itself (port 0 = a free port, no race), runs uvicorn in a
daemon thread, waits for ``GET /health`` and returns a ``ServerHandle`` (``url``, ``base_url`` for OpenAI
clients, ``stop()`` = graceful shutdown: uvicorn finishes in-flight requests, then the engine drains and
its thread stops). Not here: routes (``app.py``), argument parsing (``polyrl.cli.serve``).
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from polyrl.errors import UserError
from polyrl.server.config import ServeConfig

log = logging.getLogger("polyrl.server")


def require_serve_deps() -> None:
    """Raise a ``UserError`` naming the install command when a [serve] extra is missing."""
    for name in ("fastapi", "uvicorn", "pydantic"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise UserError(
                f"serving needs {name}, which is not installed ({exc}); run `pip install -e '.[serve]'` in the polyrl "
                "clone"
            ) from exc


def load_llm(model_dir: str, engine_config: Any = None, dtype: Any = None, device: Any = None) -> Any:
    """The engine over an HF checkpoint folder (weights + tokenizer)."""
    # lazy: the engine (torch) loads only when a model is served; `import polyrl.server` stays torch-free
    from polyrl.infer import LLM

    return LLM.from_pretrained(model_dir, engine_config, dtype=dtype, device=device)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or --host") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(llm: Any, config: ServeConfig) -> Any:
    require_serve_deps()
    # lazy: uvicorn and the FastAPI app (the [serve] extra) load only when a server starts, after the check above
    import uvicorn

    from polyrl.server.app import build_app

    app = build_app(llm, config)
    ucfg = uvicorn.Config(
        app, log_level=config.log_level, lifespan="on", timeout_graceful_shutdown=None, access_log=False
    )
    return uvicorn.Server(ucfg)


class ServerHandle:
    """A server running in a background thread. ``with start_server(...) as h:`` stops it on exit."""

    def __init__(self, server: Any, thread: threading.Thread, host: str, port: int, app: Any) -> None:
        self.server, self.thread, self.host, self.port, self.app = server, thread, host, port, app

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Graceful shutdown: stop accepting, finish in-flight requests, drain and stop the engine."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(10)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server(llm: Any, config: ServeConfig | None = None, wait_s: float = 60.0) -> ServerHandle:
    """Start the server in a daemon thread and return once ``/health`` answers 200."""
    config = config or ServeConfig(port=0, log_level="warning")
    server = _uvicorn_server(llm, config)
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="polyrl-uvicorn", daemon=True)
    thread.start()
    handle = ServerHandle(
        server, thread, config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1", port, server.config.app
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise UserError("the server thread exited during startup; see the log above")
        if _healthy(handle.url):
            return handle
        time.sleep(0.05)
    handle.stop(5)
    raise UserError(f"the server did not become healthy within {wait_s:.0f}s at {handle.url}/health")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200 and json.loads(r.read()).get("status") == "ok"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def run_server(llm_or_dir: Any, config: ServeConfig | None = None, **load_kwargs: Any) -> None:
    """Serve in the foreground until Ctrl-C / SIGTERM (then shut down gracefully). ``llm_or_dir``: an ``LLM``
    or an HF checkpoint folder (``load_kwargs``: ``engine_config``, ``dtype``, ``device``)."""
    config = config or ServeConfig()
    llm = (
        load_llm(str(llm_or_dir), **load_kwargs)
        if isinstance(llm_or_dir, str) or hasattr(llm_or_dir, "__fspath__")
        else llm_or_dir
    )
    server = _uvicorn_server(llm, config)
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    print(f"polyrl serve: model {config.served_model_name!r} at http://{config.host}:{port}/v1", file=sys.stderr)
    server.run(sockets=[sock])
