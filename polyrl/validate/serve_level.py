"""The ``serve`` validation level: the OpenAI-compatible server on a free port, driven by the ``openai`` client.

Starts ``polyrl.server.start_server`` over the chosen model in a background thread (it waits for
``/health``), then: ``GET /v1/models`` lists the served name; a chat completion returns a non-empty
assistant message with usage that adds up; a streaming chat completion delivers chunks whose concatenated
deltas equal a non-streamed greedy reply to the same request; the server then stops cleanly (its thread ends
within the timeout). Skipped with the reason when fastapi, uvicorn or openai is not installed, or when
``polyrl.server`` is not part of this build. Not here: load testing (``polyrl bench``), the HTTP routes
themselves (``tests/server``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import time
from typing import Any

from polyrl.validate import model_source
from polyrl.validate.result import LevelSkipped, check, level_result

NEEDS = ("fastapi", "uvicorn", "openai")
MAX_TOKENS = 12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own (the model comes from --model / --preset)."""


def missing_dependency() -> str | None:
    """The reason this level cannot run here, or None."""
    absent = []
    for name in NEEDS:
        try:
            importlib.import_module(name)
        except ImportError:
            absent.append(name)
    if absent:
        return f"{', '.join(absent)} not installed (pip install -e '.[serve]' openai in the polyrl clone)"
    if importlib.util.find_spec("polyrl.server.launch") is None:
        return "polyrl.server is not part of this build"
    return None


def _exchange(base_url: str, name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    # lazy: openai is optional (the level is skipped without it)
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="validate", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    req = dict(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    models = [m.id for m in client.models.list().data]
    t0 = time.perf_counter()
    reply = client.chat.completions.create(**req)
    chat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    chunks, first_s = [], None
    for chunk in client.chat.completions.create(**req, stream=True):
        if first_s is None:
            first_s = time.perf_counter() - t0
        chunks.append(chunk)
    stream_s = time.perf_counter() - t0
    streamed = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    text = reply.choices[0].message.content or ""
    usage = reply.usage
    checks = [
        check("/v1/models lists the served model", name in models, ", ".join(models), name),
        check(
            "chat completion: assistant reply with usage",
            reply.choices[0].message.role == "assistant"
            and usage is not None
            and usage.completion_tokens > 0
            and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens,
            usage.completion_tokens if usage else None,
            "> 0 tokens, total = prompt + completion",
            f"finish_reason {reply.choices[0].finish_reason}",
        ),
        check(
            "streaming chat: deltas equal the non-streamed greedy reply",
            streamed == text and len(chunks) > 1,
            len(chunks),
            "> 1 chunk, same text",
            f"{len(streamed)} characters streamed",
        ),
    ]
    metrics = {"chat_latency_s": chat_s, "stream_first_chunk_s": first_s, "stream_total_s": stream_s}
    return checks, metrics


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    reason = missing_dependency()
    if reason:
        raise LevelSkipped(reason)
    # lazy: the server needs the optional fastapi/uvicorn, checked just above
    from polyrl.infer import RolloutConfig
    from polyrl.server import ServeConfig
    from polyrl.server.launch import load_llm, start_server

    name = "polyrl-validate"
    llm = load_llm(str(model_source.model_dir(args)), RolloutConfig(num_blocks=256, max_graph_batch_size=8))
    t0 = time.perf_counter()
    handle = start_server(llm, ServeConfig(port=0, served_model_name=name, log_level="warning"))
    startup_s = time.perf_counter() - t0
    try:
        checks, metrics = _exchange(handle.base_url, name)
    finally:
        t0 = time.perf_counter()
        handle.stop(timeout_s=60.0)
        stop_s = time.perf_counter() - t0
    checks.append(check("clean shutdown", not handle.running, round(stop_s, 3), "server thread ends within 60 s"))
    metrics = {"model": model_source.describe(args), "startup_s": startup_s, **metrics, "shutdown_s": stop_s}
    return level_result("serve", checks, metrics)
