"""Host time of lm-eval's log-likelihood request to ``polyrl serve`` (``/v1/completions`` with 64 token-id prompts of
~88 tokens, ``echo: true, logprobs: 1``, ``max_tokens`` 1 greedy as lm-eval 0.4 sends it, or 0), on the CPU with the
``tiny`` preset the script writes itself (real BPE tokenizer, vocab 2048; no hub access).

Two measurements:

- **in-process, ms per request**: the server's own per-request steps without HTTP: parsing + validating the body
  (``json.loads`` + ``CompletionRequest``), ``completions.encode`` (token-id checks, the echoed text), and
  ``scoring.scored_body`` (the whole response as JSON text), thread CPU time (min and median of ``--repeat``
  runs) on one scored result (``infer.scoring.score_prompts``); ``scored_body`` also with a cold token cache.
- **round trip**: ``polyrl serve`` in a subprocess (``--device cpu``), ``--requests`` sequential requests through
  ``httpx``; per request the client's wall time, the server process's CPU time by thread (``/proc``: the busiest
  thread is the engine's, which runs the tiny model's forward; the others are the event loop and the prep pool:
  HTTP, parsing, formatting) and its scoring counters (``/metrics``, wall time).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/serve_scoring_host_profile.py
    ... --max-tokens 0 --skip-round-trip --profile      # cProfile of scored_body

Measures; asserts nothing. Numbers in docs/performance.md (Eval, "server fast path").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def lm_eval_prompts(prompts: int, docs: int = 2000, seed: int = 0) -> list[list[int]]:
    """One request's ``prompts`` token-id prompts as lm-eval sends them: ``docs`` four-way multiple-choice documents
    (~85-token context of 20 "words", as ``bench eval``'s synthetic task, + a 1..4-token choice), every
    context + choice sorted as lm-eval's API models sort them (longest first, then by tokens: a document's choices
    of one length are neighbours), the chunk from the middle."""
    rng = random.Random(seed)
    words = [rng.randrange(10, 2048) for _ in range(20)]
    out = []
    for _ in range(docs):
        ctx = [rng.choice(words) for _ in range(85)]
        out += [ctx + [rng.choice(words) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    out.sort(key=lambda toks: (-len(toks), toks))
    mid = (len(out) - prompts) // 2
    return out[mid : mid + prompts]


def cpu_ms(fn: Any, repeat: int) -> tuple[float, float]:
    """(min, median) thread CPU milliseconds of ``fn()`` over ``repeat`` runs after one warm-up (CPU time, not wall:
    the machine may be shared)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times) * 1e3, statistics.median(times) * 1e3


def in_process(model_dir: Path, body: dict[str, Any], args: argparse.Namespace) -> None:
    from polyrl.infer import LLM, RolloutConfig
    from polyrl.infer.scoring import score_prompts
    from polyrl.server.completions import encode, engine_max_tokens
    from polyrl.server.logprobs import TokenText
    from polyrl.server.params import sampling_params
    from polyrl.server.protocol import CompletionRequest
    from polyrl.server.scoring import scored_body

    cfg = RolloutConfig(block_size=16, num_blocks=2048, max_num_seqs=64, max_model_len=256)
    llm = LLM.from_pretrained(str(model_dir), cfg, dtype="float32", device="cpu")
    raw = json.dumps(body).encode()
    req = CompletionRequest.model_validate(json.loads(raw))
    score_only = req.max_tokens == 0
    params = sampling_params(req, engine_max_tokens(req), req.logprobs).clone(prompt_logprobs=req.logprobs)
    items = [list(p) for p in req.prompt]
    prompts = encode(llm, items, 255)
    res = score_prompts(llm, [ids for _, ids in prompts])
    head = {"id": "cmpl-0", "created": 0, "model": "tiny", "system_fingerprint": "polyrl"}
    eos = llm.eos_token_ids

    def cold() -> None:
        scored_body(TokenText(llm.tokenizer), eos, prompts, res, params, req.logprobs, score_only, head)

    warm_text = TokenText(llm.tokenizer)
    out = scored_body(warm_text, eos, prompts, res, params, req.logprobs, score_only, head).body
    rows = {
        "parse (json.loads + CompletionRequest)": lambda: CompletionRequest.model_validate(json.loads(raw)),
        "encode (token-id checks, echoed text)": lambda: encode(llm, items, 255),
        "scored_body, cold token cache": cold,
        "scored_body": lambda: scored_body(warm_text, eos, prompts, res, params, req.logprobs, score_only, head),
        "score_prompts (engine, tiny model)": lambda: score_prompts(llm, [ids for _, ids in prompts]),
    }
    tokens = sum(len(ids) for _, ids in prompts)
    print(f"in-process: {len(prompts)} prompts, {tokens} tokens, request {len(raw)} B, response {len(out)} B")
    print(f"  {'thread CPU ms per request':42s} {'min':>8s} {'median':>8s}")
    for name, fn in rows.items():
        lo, mid = cpu_ms(fn, args.repeat)
        print(f"  {name:42s} {lo:8.2f} {mid:8.2f}")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeat):
            scored_body(warm_text, eos, prompts, res, params, req.logprobs, score_only, head)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of process ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _scoring(url: str, client: Any) -> dict[str, float]:
    out = {}
    for line in client.get(url + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith('polyrl_scoring_seconds_total{stage="'):
            out[name.split('"')[1]] = float(value)
    return out


def round_trip(model_dir: Path, body: dict[str, Any], args: argparse.Namespace) -> None:
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "polyrl.cli.main", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32", "--kv-cache-blocks", "2048"]
    cmd += ["--max-model-len", "256", "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=120) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.2)
            for _ in range(3):  # warm-up: token caches, first forwards
                client.post(url + "/v1/completions", json=body).raise_for_status()
            walls = []
            before, cpu0 = _scoring(url, client), _thread_cpu_s(proc.pid)
            for _ in range(args.requests):
                t0 = time.perf_counter()
                r = client.post(url + "/v1/completions", json=body)
                walls.append(time.perf_counter() - t0)
                r.raise_for_status()
            cpu1 = _thread_cpu_s(proc.pid)
            after = _scoring(url, client)
    finally:
        proc.terminate()
        proc.wait(30)
    n = args.requests
    stage = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / n * 1e3 for k in after}
    per_thread = sorted((cpu1[t] - cpu0.get(t, 0.0) for t in cpu1), reverse=True)
    print(f"round trip ({n} sequential requests, server in a subprocess), ms per request:")
    print(f"  client wall (median)             {statistics.median(walls) * 1e3:8.2f}")
    print(f"  server process CPU               {sum(per_thread) / n * 1e3:8.2f}")
    print(f"  its busiest thread (the engine)  {per_thread[0] / n * 1e3:8.2f}")
    print(f"  its other threads (HTTP, format) {sum(per_thread[1:]) / n * 1e3:8.2f}")
    for k in ("engine", "format", "request"):
        print(f"  /metrics {k:23s} {stage.get(k, 0.0):8.2f} (wall)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per request (lm-eval's batch; default 64)")
    parser.add_argument("--max-tokens", type=int, default=1, choices=(0, 1))
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--skip-round-trip", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile of scored_body")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from polyrl.models.presets import create_model_from_preset

    body = {"model": "tiny", "prompt": lm_eval_prompts(args.prompts), "temperature": 0, "max_tokens": args.max_tokens}
    body.update(logprobs=1, seed=1234, echo=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_model_from_preset("tiny", Path(tmp) / "tiny", seed=0)
        in_process(model_dir, body, args)
        if not args.skip_round_trip:
            round_trip(model_dir, body, args)


if __name__ == "__main__":
    main()
