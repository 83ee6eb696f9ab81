"""AsyncEngine: the rollout engine driven by ONE background thread, bridged to asyncio for the server.

The engine thread loops on ``llm.step()`` while requests are unfinished and sleeps on an event otherwise.
Requests are submitted from the event loop (``llm.add_request`` is thread-safe and validates in the
caller); each gets a ``RequestStream`` whose asyncio queue the engine thread fills through
``loop.call_soon_threadsafe``. Aborts (client gone) go through ``llm.abort_request``. After each step the
thread publishes a stats snapshot (running / waiting requests, KV-cache use) that admission control and
``/metrics`` read without touching the engine.

If ``step()`` raises, the engine is considered broken: every open stream receives the error, new requests
get 503 and ``/health`` reports it. Direct scoring calls (``score``: ``server/scoring.py``) run on the engine
thread between steps; the calls queued together (concurrent scoring requests) run as one ``score_prompts`` call.
Not here: HTTP, OpenAI schemas (``chat.py``, ``completions.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Any

from polyrl.errors import UserError
from polyrl.infer.scoring import ScoreResult, score_prompts
from polyrl.platform import device
from polyrl.server.api_errors import bad_request, queue_full, unavailable

log = logging.getLogger("polyrl.server")

# Concurrent scoring calls merged into one ``score_prompts`` call: at most this many scoring batches of tokens
# (``max_num_batched_tokens`` each), so that running generations wait at most a few forwards.
MERGE_BATCHES = 4


class EngineDeadError(RuntimeError):
    pass


class RequestStream:
    """One engine request of an HTTP request: its timing and whether it finished."""

    def __init__(self, request_id: str, group: StreamGroup, stream: bool) -> None:
        self.request_id = request_id
        self.group = group
        self.stream = stream
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.finished = False

    def _put(self, item: Any) -> None:  # engine thread
        try:
            self.group.loop.call_soon_threadsafe(self.group.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class StreamGroup:
    """The engine requests of one HTTP request (a completions call may carry several prompts), sharing one
    asyncio queue. ``async for rs, out in group`` yields each ``RequestOutput`` until all finished."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams: dict[str, RequestStream] = {}

    @property
    def finished(self) -> bool:
        return all(rs.finished for rs in self.streams.values())

    def abort(self) -> None:
        for rs in self.streams.values():
            if not rs.finished:
                self.engine.abort(rs.request_id)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        metrics = self.engine.metrics
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                for rs in self.streams.values():
                    rs.finished = True
                raise item
            rs = self.streams[item.request_id]
            now = time.monotonic()
            if rs.first_token_time is None and any(c.token_ids for c in item.outputs):
                rs.first_token_time = now
                if rs.stream and metrics is not None:
                    metrics.ttft.observe(now - rs.arrival)
            if item.finished:
                rs.finished = True
                if metrics is not None:
                    metrics.latency.observe(now - rs.arrival)
                    metrics.generation_tokens.inc(item.num_generated_tokens)
            yield rs, item


class AsyncEngine:
    def __init__(self, llm: Any, max_queue: int | None = None, metrics: Any = None, id_prefix: str = "") -> None:
        self.llm = llm
        self.max_queue = max_queue
        self.metrics = metrics
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._prefix = id_prefix
        self.error: BaseException | None = None
        self.snapshot: dict[str, float] = {"running_requests": 0, "waiting_requests": 0}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # direct scoring calls (``score``) for the engine thread
        self._pending: tuple | None = None  # a scoring call taken from ``_jobs`` for the next round (``_run_jobs``)
        self._publish_stats()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="polyrl-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every admitted request finished (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self._streams and self.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self._streams

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread once it has no work (aborting what is left after ``timeout_s``)."""
        self._stopping = True
        self._wake.set()
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            for rid in list(self._streams):
                self.llm.abort_request(rid)
            self._wake.set()
            self._thread.join(timeout_s)

    # ---- requests (event-loop thread) -----------------------------------------------------------
    def new_group(self) -> StreamGroup:
        return StreamGroup(self)

    def admit(self, count: int = 1) -> None:
        """503 when the engine is down or stopping; 429 (with Retry-After) when ``count`` more waiting requests
        would exceed ``max_queue``. A batch calls this once, then ``submit(..., admitted=True)`` per prompt."""
        if self.error is not None:
            raise unavailable(f"the engine stopped after an error: {self.error}; restart the server")
        if self._stopping or self._thread is None:
            raise unavailable("the server is shutting down")
        waiting = self.snapshot["waiting_requests"] + self._unseen()
        if self.max_queue is not None and waiting + count > self.max_queue:
            raise queue_full(self.max_queue)

    def submit(
        self,
        group: StreamGroup,
        prompt: str | list[int],
        params: Any,
        stream: bool,
        request_id: str | None = None,
        admitted: bool = False,
    ) -> RequestStream:
        """Admit one request into the engine (event-loop thread). 503 when the engine is down or stopping,
        429 when ``max_queue`` requests already wait (unless ``admitted`` by ``admit``), 400 when the engine
        rejects the prompt."""
        if not admitted:
            self.admit(1)
        rid = request_id or f"{self._prefix}{next(self._ids)}"
        rs = RequestStream(rid, group, stream)
        with self._lock:
            self._streams[rid] = rs
        try:
            self.llm.add_request(prompt, params, request_id=rid, stream=stream)
        except UserError as exc:
            with self._lock:
                self._streams.pop(rid, None)
            raise bad_request(str(exc), "prompt") from exc
        group.streams[rid] = rs
        self._wake.set()
        return rs

    async def score(self, prompts: list[list[int]]) -> Any:
        """Every position of ``prompts`` scored in one call on the engine thread, between steps
        (``infer.scoring.score_prompts``; ``server/scoring.py``). 503 when the engine is down or stopping."""
        if self.error is not None or self._stopping or self._thread is None:
            raise unavailable("the engine is not running; restart the server")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((prompts, fut, loop))
        self._wake.set()
        return await fut

    def _has_jobs(self) -> bool:
        return self._pending is not None or not self._jobs.empty()

    def _run_jobs(self) -> None:  # engine thread
        """Run one round of queued scoring calls: those queued together (concurrent HTTP requests) as ONE
        ``score_prompts`` call (fewer, fuller forwards, one device sync), up to ``MERGE_BATCHES`` scoring batches
        of tokens; each caller gets its own prompts' part. A merged call that fails is retried per caller, so that
        an error (e.g. too few free KV blocks) reaches only the request it belongs to. One round per call: running
        generations get a step between rounds however fast scoring requests arrive."""
        budget = MERGE_BATCHES * self.llm.config.max_num_batched_tokens
        jobs, tokens = [], 0
        while self._has_jobs():
            job = self._pending if self._pending is not None else self._jobs.get_nowait()
            self._pending = None
            size = sum(len(p) for p in job[0])
            if jobs and tokens + size > budget:
                self._pending = job  # the next round starts with it
                break
            jobs.append(job)
            tokens += size
        if jobs:
            self._score_jobs(jobs)

    def _score_jobs(self, jobs: list[tuple[Any, asyncio.Future, Any]]) -> None:  # engine thread
        if len(jobs) > 1:
            try:
                merged = self._score([p for job in jobs for p in job[0]])
            except Exception:  # noqa: BLE001 - retried per caller below, where the error belongs to one
                merged = None
            if merged is not None:
                start = 0
                for prompts, fut, loop in jobs:
                    part = _slice(merged, start, start + len(prompts))
                    start += len(prompts)
                    _answer(fut, loop, fut.set_result, part)
                return
        for prompts, fut, loop in jobs:
            try:
                outcome = (fut.set_result, self._score(prompts))
            except Exception as exc:  # noqa: BLE001 - this call's error goes to its caller; the engine goes on
                outcome = (fut.set_exception, exc)
            _answer(fut, loop, *outcome)

    def _score(self, prompts: list[list[int]]) -> ScoreResult:  # engine thread
        t0 = time.perf_counter()
        res = score_prompts(self.llm, prompts, require_idle=False)
        if self.metrics is not None:
            self.metrics.scoring_seconds.inc(time.perf_counter() - t0, "engine")
            self.metrics.scoring_calls.inc(1)
            self.metrics.scoring_prompts.inc(len(prompts))
        return res

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self.llm.abort_request(request_id)
            self._wake.set()

    def _unseen(self) -> int:
        """Requests admitted since the engine thread last published its snapshot (they wait too)."""
        return max(0, len(self._streams) - int(self.snapshot["in_flight"]))

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        try:
            _use_engine_device(llm)
            while not (self._stopping and not llm.has_unfinished_requests()):
                self._run_jobs()
                if not llm.has_unfinished_requests():
                    if not self._has_jobs():
                        self._wake.wait(0.5)
                        self._wake.clear()
                    continue
                outputs = llm.step()
                with self._lock:
                    targets = [(self._streams.get(o.request_id), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
                self._publish_stats()
                for rs, out in targets:
                    if rs is not None:
                        rs._put(out)
                # Let the event loop thread take the GIL between steps: without this a CPU-bound step loop
                # starves HTTP handling (GIL convoy), and new requests wait seconds to be admitted.
                time.sleep(0)
            while self._has_jobs():
                self._run_jobs()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine; report it everywhere
            log.exception("polyrl engine thread failed")
            self.error = exc
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            err = EngineDeadError(f"the engine failed: {exc!r}")
            for rs in streams:
                rs._put(err)
            while self._has_jobs():  # scoring calls still waiting get the error too
                _, fut, loop = self._pending if self._pending is not None else self._jobs.get_nowait()
                self._pending = None
                try:
                    loop.call_soon_threadsafe(_settle, fut, fut.set_exception, err)
                except RuntimeError:
                    pass
            self._publish_stats()

    def _publish_stats(self) -> None:
        stats = dict(self.llm.stats())
        running = getattr(self.llm.scheduler, "running", None)
        if running is not None:
            running_requests = len({s.request_id for s in running})
        else:
            running_requests = int(stats.get("num_running", 0))
        with self._lock:
            in_flight = len(self._streams)
        running_requests = min(running_requests, in_flight)
        stats.update(
            running_requests=running_requests, waiting_requests=in_flight - running_requests, in_flight=in_flight
        )
        self.snapshot = stats
        if self.metrics is not None:
            self.metrics.update_engine(stats)


def _settle(fut: asyncio.Future, setter: Any, value: Any) -> None:
    if not fut.done():  # the awaiting handler may have been cancelled (client gone)
        setter(value)


def _answer(fut: asyncio.Future, loop: Any, setter: Any, value: Any) -> None:  # engine thread
    try:
        loop.call_soon_threadsafe(_settle, fut, setter, value)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _slice(res: ScoreResult, lo: int, hi: int) -> ScoreResult:
    """Prompts ``lo:hi`` of a merged ``score_prompts`` result."""

    def part(values: list | None) -> list | None:
        return None if values is None else values[lo:hi]

    return ScoreResult(
        res.logprobs[lo:hi],
        res.greedy[lo:hi],
        dict(res.stats),
        part(res.token_logprobs),
        part(res.top_ids),
        part(res.top_logprobs),
    )


def _use_engine_device(llm: Any) -> None:
    """A new thread starts on device 0; kernels must launch on the device that holds the engine's weights."""
    param = next(llm.model.parameters(), None)
    if param is not None and param.device.type != "cpu" and param.device.index is not None:
        device.set_device(param.device.index)


__all__ = ["AsyncEngine", "StreamGroup", "RequestStream", "EngineDeadError"]
