"""polyrl.server: an OpenAI-compatible HTTP server over the rollout engine (``polyrl.infer.LLM``).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE and not; usage, logprobs,
n, stop, seed, max_tokens / max_completion_tokens, temperature, top_p, and the extras top_k, min_p,
min_tokens, ignore_eos, stop_token_ids), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus
text). Bad requests get OpenAI error bodies with 400, an unknown model 404, a wrong API key 401, a full
queue 429.

API::

    from polyrl.server import ServeConfig, build_app, start_server, run_server
    app = build_app(llm, ServeConfig(served_model_name="tiny"))         # a FastAPI app (lifespan runs the engine)
    with start_server(llm, ServeConfig(port=0)) as h:                     # background thread, free port
        client = openai.OpenAI(base_url=h.base_url, api_key="x")
    run_server("path/to/model", ServeConfig(port=8000), engine_config=RolloutConfig(...))   # foreground

One engine thread drives ``llm.step()``; do not call ``llm.generate`` on the same engine while it serves.
FastAPI and uvicorn are imported only when an app is built (``pip install -e '.[serve]'`` in the clone). Not here:
the engine (``polyrl.infer``), argument parsing (``polyrl.cli.serve``).
"""

from __future__ import annotations

from typing import Any

from polyrl.server import launch
from polyrl.server.config import ServeConfig
from polyrl.server.launch import ServerHandle, require_serve_deps

__all__ = ["ServeConfig", "build_app", "start_server", "run_server", "ServerHandle"]


def build_app(llm: Any, config: ServeConfig | None = None) -> Any:
    """The FastAPI app serving ``llm`` (its lifespan starts and stops the engine thread)."""
    require_serve_deps()
    # lazy: app.py imports fastapi (the [serve] extra), checked just above
    from polyrl.server.app import build_app as _build

    return _build(llm, config)


def start_server(llm: Any, config: ServeConfig | None = None, wait_s: float = 60.0) -> Any:
    """Run the server in a background thread (port 0 = a free one); returns a ``ServerHandle`` once healthy."""
    require_serve_deps()
    return launch.start_server(llm, config, wait_s)


def run_server(llm_or_dir: Any, config: ServeConfig | None = None, **load_kwargs: Any) -> None:
    """Serve in the foreground until interrupted (graceful shutdown)."""
    require_serve_deps()
    launch.run_server(llm_or_dir, config, **load_kwargs)
