"""Server metrics in the Prometheus text exposition format (0.0.4), written by hand.

Counters, gauges and histograms with labels, enough for ``GET /metrics``; no dependency on
``prometheus_client``. Every update takes a lock, so the event loop and the engine thread may both
write. Metric names are ``polyrl_*``; the set the server keeps is built by ``ServerMetrics``.
"""

from __future__ import annotations

import bisect
import math
import threading

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help, labels
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help, labels)
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self.values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self.values[labels] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        super().__init__(name, help)
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last = above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        lines = self.header()
        running = 0
        for bound, c in zip(self.bounds + (math.inf,), counts):
            running += c
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        lines += [f"{self.name}_sum {_num(total)}", f"{self.name}_count {n}"]
        return lines


class ServerMetrics:
    """The metrics ``GET /metrics`` shows. Engine gauges are refreshed from the engine thread's snapshot."""

    def __init__(self) -> None:
        self.requests = Counter(
            "polyrl_requests_total", "HTTP requests by endpoint and status code.", ("endpoint", "status")
        )
        self.prompt_tokens = Counter("polyrl_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("polyrl_generation_tokens_total", "Tokens generated for finished requests.")
        self.queue_depth = Gauge("polyrl_queue_depth", "Requests waiting for an engine slot.")
        self.running = Gauge("polyrl_running_requests", "Requests with at least one sequence running in the engine.")
        self.kv_usage = Gauge("polyrl_kv_cache_usage", "Fraction of KV-cache blocks in use (0..1).")
        self.prefix_hit = Gauge("polyrl_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0..1).")
        self.preemptions = Gauge("polyrl_num_preemptions", "Sequences preempted (recomputed) since start.")
        self.latency = Histogram(
            "polyrl_request_latency_seconds", "Time from admission to the last token.", LATENCY_BUCKETS
        )
        self.ttft = Histogram(
            "polyrl_time_to_first_token_seconds", "Time from admission to the first token (streaming).", TTFT_BUCKETS
        )
        self.scoring_seconds = Counter(
            "polyrl_scoring_seconds_total",
            "Directly scored completions (echo + logprobs): seconds in the engine's scoring calls (stage engine, on "
            "the engine thread, device wait included), writing their responses (format) and whole requests from "
            "parsed body to response (request; concurrent requests overlap).",
            ("stage",),
        )
        self.scoring_prompts = Counter("polyrl_scoring_prompts_total", "Prompts scored directly.")
        self.scoring_calls = Counter(
            "polyrl_scoring_calls_total", "Engine scoring calls (concurrent scoring requests share one)."
        )
        self.all = [
            self.requests,
            self.prompt_tokens,
            self.generation_tokens,
            self.queue_depth,
            self.running,
            self.kv_usage,
            self.prefix_hit,
            self.preemptions,
            self.latency,
            self.ttft,
            self.scoring_seconds,
            self.scoring_prompts,
            self.scoring_calls,
        ]

    def update_engine(self, snapshot: dict[str, float]) -> None:
        self.queue_depth.set(snapshot.get("waiting_requests", 0))
        self.running.set(snapshot.get("running_requests", 0))
        self.kv_usage.set(snapshot.get("kv_cache_usage", 0.0))
        self.prefix_hit.set(snapshot.get("prefix_cache_hit_rate", 0.0))
        self.preemptions.set(snapshot.get("num_preemptions", 0))

    def render(self) -> str:
        lines: list[str] = []
        for m in self.all:
            lines += m.render()
        return "\n".join(lines) + "\n"
