"""``EnvPool``: environment instances in worker processes, one per episode, each call with a timeout.

The mechanism of ``polyrl.algorithms.rewards.RewardPool`` for stateful calls: ``workers`` processes (forkserver or
spawn), each holding the environments of the episodes pinned to it (round robin at ``reset``) and answering one
call at a time over a pipe. ``reset(items)`` / ``step(items)`` take ``[(episode_id, payload)]`` and return one
``Outcome`` per episode: ``ok`` with the value, or a failure kind: ``error`` (the environment raised), ``invalid``
(it returned something that is not messages / an ``EnvStep``, or a message whose content is not text: a string,
None or OpenAI text parts, which are joined), ``timeout`` (no answer within ``timeout`` seconds: the worker is killed
and replaced), ``crash`` (the worker died), ``lost`` (the episode lived in a worker killed for another episode's
timeout). Failures are counted in ``totals``; none raises. ``workers=0`` runs the environments in
this process (no timeout; for debugging). Not here: the episode loop (``rollout``), the environment API (``env``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import wait
from numbers import Real
from typing import Any

from polyrl.agents.env import BUILTIN_ENVS, EnvStep, env_tools, resolve_env
from polyrl.agents.formats import to_format
from polyrl.algorithms.workers import (
    REIMPORT_EXIT_CODE,
    REIMPORT_MESSAGE,
    WorkerProcess,
    absolute_spec,
    close_workers,
    serve,
    start_context,
)
from polyrl.errors import ConfigError, UserError

FAILURE_KINDS = ("error", "invalid", "timeout", "crash", "lost")
STARTUP_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    kind: str  # "ok" or a failure kind
    value: Any = None  # reset: messages; step: EnvStep; failure: a message

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def _messages(value: Any, what: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must return messages (a list of dicts), got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TypeError(f"{what} returned a message without a 'role': {str(m)[:80]!r}")
        out.append({**m, "content": _content(m.get("content"), f"{what} message {i} (role {m['role']!r})")})
    return out


def _content(content: Any, where: str) -> str | None:
    """A message's content as the chat template renders it: text, None, or OpenAI text parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise TypeError(
        f"{where} has content of type {type(content).__name__} ({str(content)[:40]!r}); content must be a string "
        '(or {"type": "text", "text": ...} parts): return str(...) or json.dumps(...) of it'
    )


def normalise_step(value: Any) -> Any:
    """An ``EnvStep`` from what ``step`` returned: an ``EnvStep`` or ``(messages, reward, done[, metrics])``."""

    if isinstance(value, tuple) and len(value) in (3, 4):
        value = EnvStep(value[0] or [], value[1], value[2], dict(value[3]) if len(value) == 4 else {})
    if not isinstance(value, EnvStep):
        raise TypeError(f"step() must return an EnvStep or (messages, reward, done), got {type(value).__name__}")
    if not isinstance(value.reward, Real) or not math.isfinite(float(value.reward)):
        raise TypeError(f"step() returned reward {value.reward!r}, not a finite number")
    metrics = {str(k): float(v) for k, v in (value.metrics or {}).items() if isinstance(v, Real)}
    try:
        fmt = to_format(value.response_format, "step() response_format")
    except UserError as exc:
        raise ValueError(str(exc)) from None
    return EnvStep(_messages(value.messages or [], "step()"), float(value.reward), bool(value.done), metrics, fmt)


class LocalEnvs:
    """Environments of ``cls`` in this process, by episode id: the body of a worker (and of ``workers=0``)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.envs: dict[Any, Any] = {}

    def call(self, op: str, eid: Any, payload: Any) -> tuple[str, Any]:
        try:
            if op == "reset":
                env = self.cls()
                self.envs[eid] = env
                value = env.reset(payload)
            else:
                value = self.envs[eid].step(payload)
        except Exception as exc:  # noqa: BLE001 - the user's environment: a counted failure
            return "error", f"{type(exc).__name__}: {exc}"[:300]
        try:
            return "ok", (_messages(value, "reset()") if op == "reset" else normalise_step(value))
        except (TypeError, ValueError) as exc:
            return "invalid", str(exc)[:300]

    def close(self, eid: Any) -> None:
        self.envs.pop(eid, None)


def _worker_main(conn: Any, spec: str) -> None:
    """Worker process: the environments of the episodes pinned here, answering ``(op, episode, payload)`` jobs
    (Ctrl-C: a quiet exit 130, ``workers.quiet_on_interrupt``)."""

    def handle(envs: LocalEnvs, job: tuple) -> tuple | None:
        op, eid, payload = job
        if op == "close":
            envs.close(eid)
            return None
        return (eid, *envs.call(op, eid, payload))

    serve(conn, lambda: LocalEnvs(resolve_env(spec)), handle, lambda job, tb: (job[1], "invalid", tb))


class _Worker(WorkerProcess):
    def __init__(self, ctx: Any, spec: str) -> None:
        super().__init__(ctx, _worker_main, spec, STARTUP_TIMEOUT_S)
        self.queue: deque = deque()  # calls waiting for this worker
        self.episodes: set = set()  # the episodes whose environments live here


@dataclass
class EnvInfo:
    """What the trainer needs of environment ``spec`` without running it: the absolute spec a worker process
    resolves, the class, its tools, its turn format and ``parallel_tool_calls``. ``EnvInfo.of`` resolves the class
    here, so a bad spec fails early, in the parent (a process that runs no episode, e.g. a torchrun rank other than
    0 with the process producer, builds only this, no ``EnvPool``)."""

    spec: str
    cls: type
    tools: list
    response_format: Any
    parallel_tool_calls: bool

    @classmethod
    def of(cls, spec: str) -> EnvInfo:
        # registered names resolve here: a worker process does not see runtime registrations
        full = absolute_spec(BUILTIN_ENVS.get(spec.strip(), spec) if isinstance(spec, str) else spec)
        env = resolve_env(full)
        fmt = to_format(getattr(env, "response_format", None), f"{spec}: response_format")
        return cls(full, env, env_tools(env), fmt, getattr(env, "parallel_tool_calls", True) is not False)


class EnvPool:
    """Environment ``spec`` (see ``env.resolve_env``) in ``workers`` processes, ``timeout`` seconds per call."""

    def __init__(self, spec: str, workers: int = 2, timeout: float = 30.0, start_method: str | None = None) -> None:
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"environment workers must be >= 0, got {workers!r}")
        if not timeout > 0:
            raise ConfigError(f"environment timeout must be > 0 seconds, got {timeout}")
        self.name = spec
        info = EnvInfo.of(spec)
        self.spec, self.cls, self.tools = info.spec, info.cls, info.tools
        self.response_format, self.parallel_tool_calls = info.response_format, info.parallel_tool_calls
        self.num_workers, self.timeout = workers, float(timeout)
        self.totals = dict.fromkeys(FAILURE_KINDS, 0)
        self.local = LocalEnvs(self.cls) if workers == 0 else None
        self._ctx = start_context(start_method) if workers else None
        self._workers: list[_Worker] = []
        self._home: dict[Any, _Worker] = {}
        self._lost: set = set()
        self._next = 0

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        close_workers(self._workers)
        self._workers, self._home = [], {}

    # ---- calls --------------------------------------------------------------------------------------
    def reset(self, items: list[tuple[Any, dict]]) -> dict[Any, Outcome]:
        return self._call("reset", items)

    def step(self, items: list[tuple[Any, dict]]) -> dict[Any, Outcome]:
        return self._call("step", items)

    def release(self, eid: Any) -> None:
        """Forget episode ``eid``'s environment (it ended)."""
        self._lost.discard(eid)
        if self.local is not None:
            self.local.close(eid)
            return
        w = self._home.pop(eid, None)
        if w is not None and w in self._workers:
            w.episodes.discard(eid)
            try:
                w.conn.send(("close", eid, None))
            except (OSError, BrokenPipeError):
                pass

    def _call(self, op: str, items: list[tuple[Any, Any]]) -> dict[Any, Outcome]:
        if self.local is not None:
            out = {eid: Outcome(*self.local.call(op, eid, payload)) for eid, payload in items}
        else:
            out = self._run_workers(op, items)
        for o in out.values():
            if not o.ok:
                self.totals[o.kind] += 1
        return out

    def _run_workers(self, op: str, items: list[tuple[Any, Any]]) -> dict[Any, Outcome]:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.spec))
        out: dict[Any, Outcome] = {}
        for eid, payload in items:
            if op == "reset":
                w = self._workers[self._next % len(self._workers)]
                self._next += 1
                self._home[eid] = w
                w.episodes.add(eid)
            w = self._home.get(eid)
            if eid in self._lost or w is None:
                out[eid] = Outcome("lost", "its environment was lost with a worker killed for another episode")
                continue
            w.queue.append((op, eid, payload))
        while any(w.queue or w.job is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.job is None and w.queue:
                    w.job = w.queue.popleft()
                    w.deadline = now + self.timeout
                    w.conn.send(w.job)
            waiting = [w for w in self._workers if w.job is not None or (not w.ready and w.queue)]
            if not waiting:
                continue
            ready = wait([w.conn for w in waiting], timeout=max(0.0, min(w.deadline for w in waiting) - now))
            for w in waiting:
                if w.conn in ready:
                    self._receive(w, out)
                elif time.monotonic() >= w.deadline:
                    self._replace(w, out, "timeout", f"no answer within {self.timeout:g}s; worker killed")
        return out

    def _receive(self, w: _Worker, out: dict[Any, Outcome]) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._replace(w, out, "crash", f"environment worker died (exit code {w.proc.exitcode})")
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "init_error":
            self.close()
            raise UserError(f"the environment {self.spec!r} failed to load in a worker: {msg[1]}")
        else:
            eid, kind, value = msg
            out[eid] = Outcome(kind, value)
            w.job = None

    def _replace(self, w: _Worker, out: dict[Any, Outcome], kind: str, message: str) -> None:
        if w.job is None and not w.ready:
            code = w.proc.exitcode
            self.close()
            if code == REIMPORT_EXIT_CODE:  # the worker re-ran the user's unguarded main script
                raise UserError(REIMPORT_MESSAGE)
            if kind == "crash":
                raise UserError(f"an environment worker exited before it started: {message}")
            raise UserError(f"an environment worker did not start within {STARTUP_TIMEOUT_S:g}s ({message})")
        culprit = w.job[1] if w.job is not None else None
        if culprit is not None:
            out[culprit] = Outcome(kind, message)
        for _op, eid, _ in w.queue:  # queued calls of this worker's other episodes
            out[eid] = Outcome("lost", "its environment was lost with a worker killed for another episode")
        self._lost |= w.episodes - {culprit}
        w.kill()
        fresh = _Worker(self._ctx, self.spec)
        self._workers[self._workers.index(w)] = fresh
        for eid in w.episodes:
            self._home.pop(eid, None)


__all__ = ["FAILURE_KINDS", "EnvInfo", "EnvPool", "LocalEnvs", "Outcome", "normalise_step"]
