"""A ``polyrl serve`` for a benchmark: started (in a process of its own, as a user runs it, or in this process over an
engine already built), warmed up with one untimed scoring request, stopped; and its direct-scoring counters read from
``GET /metrics``. ``polyrl bench eval``'s serve row uses it (``bench/eval.py``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from polyrl.platform import device


def scoring_metrics(base_url: str) -> dict[str, float]:
    """The server's direct-scoring counters (``polyrl_scoring_*`` of ``GET /metrics``): seconds by stage
    (engine, format, request), prompts, engine calls; {} when they cannot be read."""
    names = {"polyrl_scoring_prompts_total": "prompts", "polyrl_scoring_calls_total": "calls"}
    try:
        with urllib.request.urlopen(base_url.rsplit("/v1", 1)[0] + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith('polyrl_scoring_seconds_total{stage="'):
            out[name.split('"')[1]] = float(value)
        elif name in names:
            out[names[name]] = float(value)
    return out


def start_server_for_bench(llm: Any, model_dir: Path, mode: str, dtype: str) -> tuple[Any, str, float]:
    """(stop function, base URL ``http://host:port/v1``, seconds to start and warm up) of a ``polyrl serve``."""
    t0 = time.perf_counter()
    if mode == "thread":
        # lazy: the server is the `serve` extra
        from polyrl.server import ServeConfig, start_server

        handle = start_server(llm, ServeConfig(port=0, served_model_name="bench", log_level="warning"))
        post_warm_up(handle.base_url)
        return handle.stop, handle.base_url, time.perf_counter() - t0
    with socket.socket() as sock:  # a free port (the server binds it right after)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    llm.release()  # the server process sizes its own KV cache from the memory this frees
    device.empty_cache()
    cmd = [sys.executable, "-m", "polyrl.cli.main", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--dtype", dtype, "--device", str(device.torch_device())]
    cmd += ["--log-level", "warning", "--max-num-batched-tokens", str(llm.config.max_num_batched_tokens)]
    proc = subprocess.Popen(cmd)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        llm.reallocate()
        llm.capture_graphs()  # release() dropped them; the generation rows must not capture inside their phase

    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"polyrl serve did not come up (exit code {proc.poll()}): {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    try:
        post_warm_up(base)
    except Exception:
        stop()
        raise
    return stop, base, time.perf_counter() - t0


def post_warm_up(base_url: str) -> None:
    """One untimed scoring request (echo + logprobs over 64 token-id prompts): the server's first-use compilation."""
    body = {"model": "bench", "prompt": [[1 + (i * 7 + j) % 200 for j in range(40 + i)] for i in range(64)]}
    body.update(max_tokens=1, logprobs=1, echo=True, temperature=0)
    req = urllib.request.Request(
        f"{base_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
