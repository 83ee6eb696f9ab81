"""Reward functions for online RL: the builtin registry, user functions (``--reward path/to/file.py:fn``) and the
worker pool that runs them isolated, with a per-call timeout.

The signature every reward function has::

    def my_reward(completion: str, example: Mapping) -> float | dict:
        # example["prompt"]   the last user message (str);   example["messages"]: the whole prompt conversation
        # example["answer"]   the reference answer or None;  example["task"]: builtin task name or None
        # example["metadata"] any other fields of the data row (dict)
        return 1.0                                   # or {"reward": 1.0, "other_metric": 0.3}

The function may be ``async def`` (an awaitable result is run to completion in its worker). A dict result must
hold ``"reward"``; its other numeric keys are averaged into the step metrics as
``reward/<key>``. Booleans count as 0/1; numpy numbers, numpy booleans and 0-d arrays / tensors count as the number
they hold. Anything else (an exception, a timeout, None, a string, a list, NaN or inf) is a *failure*: the
completion gets ``failure_reward`` and the failure is counted by kind (``error``, ``timeout``, ``non_number``,
``crash``), its message saying what came back (an exception: the file, line and function that raised). The run
never stops because of a reward function: a worker that hangs past the timeout is killed and replaced, one that dies
(segfault, ``os._exit``) is replaced.

Specs (``resolve``): a builtin name (``BUILTINS``: ``exact_match``, ``numeric``, ``boxed``, ``think_format``,
``length_penalty``, ``code_exec``: the pass fraction of the row's tests run in a sandbox), ``path/to/file.py:fn``,
``package.module:fn``, or a weighted sum of builtins such as ``exact_match+0.2*think_format`` (one call returns the
sum and each term's value, logged as ``reward/<name>``). A sum with functions of your own, judges or reward models is
``polyrl.algorithms.reward_sources``'s (``open_rewards``): each function term gets a pool of its own; ``split_sum``
is the term syntax both share.
``resolve`` imports a file and checks that its function can be called as ``fn(completion, example)``; a run does so
when its config is checked, before any model loads, so a missing file, an import error, a misspelt name or weight
and a wrong signature are a ``ConfigError`` naming the file and function. ``register_reward(name, fn)`` adds a
builtin (in the parent process; workers started afterwards by forking see it, spawned ones only see module-level
registrations).

Workers are processes from the ``forkserver`` context (``spawn`` where there is none), preloaded with this module
and ``polyrl.data.builtin`` so a replacement worker starts in milliseconds. ``workers=0`` calls the function in
this process: no timeout, no crash isolation (for debugging). This module scores text; it knows nothing of
tokens, advantages or training.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from numbers import Real
from pathlib import Path
from typing import Any

from polyrl.algorithms.sandbox import example_tests, extract_code, run_tests
from polyrl.algorithms.workers import (
    REIMPORT_EXIT_CODE,
    REIMPORT_MESSAGE,
    JobInbox,
    WorkerProcess,
    absolute_spec,
    close_workers,
    load_user_module,
    serve,
    start_context,
)
from polyrl.data.builtin import check
from polyrl.data.builtin.check import check_number, check_string, last_boxed
from polyrl.errors import ConfigError, UserError, did_you_mean

RewardFn = Callable[[str, Mapping[str, Any]], Any]
FAILURE_KINDS = ("error", "timeout", "non_number", "crash")
STARTUP_TIMEOUT_S = 120.0


# ---- builtins -----------------------------------------------------------------------------------
def exact_match(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the completion's answer equals the reference (the builtin task's checker, else a string match
    of the extracted answer: last ``\\boxed{}``, else last ``Answer: X``, else the whole text)."""
    return float(check(completion, example))


def numeric(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the last number of the extracted answer (``\\boxed{}`` / ``Answer:`` / text) equals the reference."""
    return float(check_number(completion, str(example["answer"])))


def boxed(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the completion has a ``\\boxed{...}`` whose content matches the reference (as a number or string)."""
    inner = last_boxed(completion)
    if inner is None:
        return 0.0
    text, ans = f"\\boxed{{{inner}}}", str(example["answer"])
    return float(check_number(text, ans) or check_string(text, ans))


_THINK_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def think_format(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the completion is ``<think>...</think>`` followed by ``<answer>...</answer>`` and nothing else."""
    return float(bool(_THINK_RE.match(completion)))


CODE_EXEC = {"timeout": 5.0, "memory_mb": 512}  # sandbox limits per completion ([reward.code_exec], ``configure``)


def configure(options: Mapping[str, Any] | None) -> None:
    """Set the sandbox limits of ``code_exec`` in this process (``{"timeout": s, "memory_mb": n}``)."""
    for key, value in (options or {}).items():
        if key not in CODE_EXEC:
            raise ConfigError(f"unknown code_exec option {key!r}; known: {', '.join(CODE_EXEC)}")
        CODE_EXEC[key] = value


def code_exec(completion: str, example: Mapping[str, Any]) -> dict[str, float]:
    """The fraction of the row's tests that the completion's code passes, run in the sandbox of
    ``polyrl.algorithms.sandbox`` (code: the last fenced ``python`` block, else the whole completion; tests: the
    row's ``tests`` / ``test_list`` list or ``test`` program, see ``sandbox.example_tests``). Also reports
    ``code_timeout`` (1 when the time limit killed it) and ``code_error`` (1 when the code raised before any test)."""
    result = run_tests(
        extract_code(completion), example_tests(example), timeout=CODE_EXEC["timeout"], memory_mb=CODE_EXEC["memory_mb"]
    )
    return {
        "reward": result.fraction,
        "code_timeout": float(result.timed_out),
        "code_error": float(result.code_error is not None),
    }


def length_penalty(completion: str, example: Mapping[str, Any]) -> float:
    """``-len(completion) / 1000``: minus one per thousand characters (weight it, e.g. ``0.1*length_penalty``)."""
    return -len(completion) / 1000.0


BUILTINS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "boxed": boxed,
    "think_format": think_format,
    "length_penalty": length_penalty,
    "code_exec": code_exec,
}


def register_reward(name: str, fn: RewardFn) -> None:
    """Make ``fn`` available as the builtin reward ``name``."""
    BUILTINS[name] = fn


class _Weighted:
    """A weighted sum of builtin rewards (picklable, so spawned workers can rebuild it from the spec). Returns
    ``{"reward": the sum, name: each term's value before its weight, ...}`` (plus the extra keys of a builtin that
    returns a dict, ``code_exec``'s), so each term is logged as ``reward/<name>``."""

    def __init__(self, terms: list[tuple[float, str]]) -> None:
        self.terms = terms

    def __call__(self, completion: str, example: Mapping[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        total = 0.0
        for w, name in self.terms:
            value = BUILTINS[name](completion, example)
            out.update(_extras(value))
            out[name] = _number(value)
            total += w * out[name]
        return {"reward": total, **out}


@dataclass(frozen=True)
class SumTerm:
    """One ``[weight*]body`` term of a reward sum: ``text`` as written, ``body`` without its weight."""

    weight: float
    body: str
    text: str


_MANTISSA = re.compile(r"^\s*[+-]?(?:\d+\.?\d*|\.\d+)[eE]$")  # ``1e`` of ``1e+3*name``: the + is the exponent's


def split_sum(spec: str) -> list[SumTerm]:
    """The terms of ``w1*a+b+...``. ``+`` separates terms (except the sign of a weight's exponent, ``1e+3*a``) and the
    text before a term's first ``*`` is its weight, so neither can be part of a term's name, path or URL. A
    ConfigError names the term that is wrong: empty, a weight that is not a finite number, a term written twice."""
    pieces = spec.split("+")
    parts = []
    i = 0
    while i < len(pieces):
        part = pieces[i]
        while _MANTISSA.match(part) and i + 1 < len(pieces):
            i += 1
            part += "+" + pieces[i]
        parts.append(part.strip())
        i += 1
    terms: list[SumTerm] = []
    for text in parts:
        weight, star, body = text.partition("*")
        body = body.strip() if star else text
        if not text or not body:
            raise ConfigError(f"the reward sum {spec!r} has an empty term; write it as exact_match+0.2*think_format")
        try:
            w = float(weight) if star else 1.0
        except ValueError:
            raise ConfigError(
                f"reward term {text!r} of {spec!r}: the weight {weight.strip()!r} is not a number; write it as "
                f"0.2*{body}"
            ) from None
        if not math.isfinite(w):
            raise ConfigError(f"reward term {text!r} of {spec!r}: the weight must be a finite number")
        if any(t.body == body for t in terms):
            raise ConfigError(f"the reward sum {spec!r} names {body!r} twice; keep one term and weight it instead")
        terms.append(SumTerm(w, body, text))
    return terms


SUM_FORMS = (
    "a term of a sum is a builtin ({builtins}), path/to/file.py:function, package.module:function, judge[:URL] or "
    "model[:PATH], each optionally weighted as 0.2*term"
)


def check_builtin(name: str, spec: str) -> None:
    """ConfigError when the term ``name`` of the sum ``spec`` (no ``:``) is not a builtin reward."""
    if name in BUILTINS:
        return
    if name.endswith(".py") or "/" in name:
        raise ConfigError(
            f"reward term {name!r} of {spec!r} names a file but no function; add it: {name}:FUNCTION_NAME"
        )
    forms = SUM_FORMS.format(builtins=", ".join(sorted(BUILTINS)))
    raise ConfigError(f"unknown reward {name!r} in {spec!r}{did_you_mean(name, BUILTINS)}; {forms}")


def _parse_sum(spec: str) -> list[tuple[float, str]]:
    """The ``(weight, builtin name)`` terms of ``w1*name1+name2+...`` (``split_sum``); a ConfigError names the term
    that is wrong."""
    terms = split_sum(spec)
    for t in terms:
        if ":" in t.body:
            raise ConfigError(
                f"reward {spec!r} sums a function of your own (or a judge / model term): one reward pool runs one "
                "function or a sum of builtins; open the sum with polyrl.algorithms.reward_sources.open_rewards (as "
                "--reward does), which runs each function term in its own workers"
            )
        check_builtin(t.body, spec)
    return [(t.weight, t.body) for t in terms]


def resolve(spec: str) -> RewardFn:
    """The reward function of ``spec`` (see the module docstring); ConfigError says what is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("no reward given; pass --reward NAME or --reward path/to/file.py:function")
    spec = spec.strip()
    if spec in BUILTINS:
        return BUILTINS[spec]
    target, sep, name = spec.rpartition(":")
    if not sep:
        if "+" in spec or "*" in spec:
            return _Weighted(_parse_sum(spec))
        if spec.endswith(".py") or "/" in spec:
            raise ConfigError(f"reward {spec!r} names a file but no function; add it: --reward {spec}:FUNCTION_NAME")
        raise ConfigError(
            f"unknown reward {spec!r}{did_you_mean(spec, BUILTINS)}; use a builtin ({', '.join(sorted(BUILTINS))}), "
            "a sum such as exact_match+0.2*think_format, or path/to/file.py:function"
        )
    if not target or not name:
        raise ConfigError(f"reward {spec!r}: give both the file and the function, as path/to/file.py:function")
    in_sum = "+" in name or "*" in name  # ``a.py:f+exact_match``: the function name holds the sum's next term
    if in_sum or (("+" in target or "*" in target) and not Path(target).is_file()):
        _parse_sum(spec)  # a sum with a function term: the ConfigError says where sums of functions are scored
    module = load_user_module(target, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_")
        )
        listed = ", ".join(defined[:12]) + (", ..." if len(defined) > 12 else "")
        known = f"; it defines {listed}" if defined else "; it defines no function"
        raise ConfigError(f"reward {spec!r}: {target} has no function {name!r}{did_you_mean(name, defined)}{known}")
    _check_signature(fn, spec, name)
    return fn


def _check_signature(fn: Any, spec: str, name: str) -> None:
    """ConfigError when ``fn`` cannot be called as ``fn(completion, example)`` (every call would fail)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension callable without a signature: its calls will tell
        return
    try:
        sig.bind("completion", {})
    except TypeError as exc:
        raise ConfigError(
            f"reward {spec!r}: {name}{sig} cannot be called as {name}(completion, example) ({exc}); a reward "
            f"function takes the completion text and the example dict: def {name}(completion, example) -> float"
        ) from None


# ---- one call -----------------------------------------------------------------------------------
def _scalar(value: Any) -> Any:
    """A 0-d numpy / torch value (``np.bool_``, ``np.array(0.5)``, ``torch.tensor(0.5)``) as the Python number it
    holds; anything else as it is."""
    if not isinstance(value, Real) and getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()
    return value


def _number(value: Any) -> float:
    """The reward of a function's return value; raises TypeError/ValueError for a non-number."""
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise TypeError(f"a dict reward needs a 'reward' key, got keys {sorted(map(str, value))[:5]}")
        value = value["reward"]
    value = _scalar(value)
    if not isinstance(value, Real):
        several = isinstance(value, (list, tuple)) or bool(getattr(value, "ndim", 0))
        hint = (
            "; a reward function scores one completion: return one number, not one per sample"
            if several
            else "; return a float, an int, a bool or a dict with a 'reward' number"
        )
        raise TypeError(f"reward is {type(value).__name__} {str(value)[:60]!r}, not a number{hint}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward is {out}")
    return out


def _extras(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return {}
    out = {}
    for k, v in value.items():
        v = _scalar(v)
        if k != "reward" and isinstance(v, Real) and math.isfinite(float(v)):
            out[str(k)] = float(v)
    return out


def _raised(exc: BaseException) -> str:
    """``RuntimeError: boom (my_rewards.py:12 in score)``: the exception and the line that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    text = f"{type(exc).__name__}: {exc}"
    return (text[: 300 - len(where)] + where) if len(text) + len(where) > 300 else text + where


async def _awaited(value: Any) -> Any:
    return await value


def call_once(fn: RewardFn, completion: str, example: Mapping[str, Any]) -> tuple[str, Any, dict[str, float]]:
    """``("ok", reward, extras)`` or ``(failure kind, message, {})`` for one call, in this process."""
    try:
        value = fn(completion, example)
        if inspect.isawaitable(value):  # an ``async def`` reward: run to completion in this process
            value = asyncio.run(_awaited(value))
    except Exception as exc:  # noqa: BLE001 - any user exception is a counted failure
        return "error", _raised(exc), {}
    try:
        return "ok", _number(value), _extras(value)
    except (TypeError, ValueError) as exc:
        return "non_number", str(exc), {}


def _worker_main(conn: Any, spec: str, options: Mapping[str, Any] | None = None) -> None:
    """Worker process: apply ``options`` (``configure``), resolve ``spec``, say ready, then answer
    ``(index, completion, example)`` jobs forever."""

    def handle(fn: RewardFn, job: tuple) -> tuple:
        idx, completion, example = job
        return (idx, *call_once(fn, completion, example))

    def setup() -> RewardFn:
        configure(options)
        return resolve(spec)

    serve(conn, setup, handle, lambda job, tb: (job[0], "error", tb, {}))


# ---- the pool -----------------------------------------------------------------------------------
@dataclass
class RewardResult:
    """Rewards in input order, failures by kind, and the first few failure messages."""

    rewards: list[float]
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))
    messages: list[str] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # indices of the completions whose call failed

    @property
    def num_failures(self) -> int:
        return sum(self.failures.values())

    def metrics(self) -> dict[str, float]:
        """Flat step metrics: reward failures by kind and the means of extra dict keys."""
        out: dict[str, float] = {"reward_failures": float(self.num_failures)}
        for kind, n in self.failures.items():
            out[f"reward_failures_{kind}"] = float(n)
        for key, values in self.extras.items():
            out[f"reward/{key}"] = sum(values) / len(values)
        return out


class _Worker(WorkerProcess):
    def __init__(self, ctx: Any, spec: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, functools.partial(_worker_main, options=options), spec, STARTUP_TIMEOUT_S)


class RewardPool:
    """Scores completions with the reward ``spec`` in ``workers`` processes, ``timeout`` seconds per call.

    ``score(completions, examples) -> RewardResult``. Use as a context manager or call ``close()``. ``label``: the
    term of a larger sum this pool scores, named in its failure messages (``error: LABEL: ...``)."""

    def __init__(
        self,
        spec: str,
        workers: int = 2,
        timeout: float = 10.0,
        failure_reward: float = 0.0,
        start_method: str | None = None,
        options: Mapping[str, Any] | None = None,
        label: str | None = None,
    ) -> None:
        if workers < 0:
            raise ConfigError(f"reward workers must be >= 0, got {workers}")
        if not timeout > 0:
            raise ConfigError(f"reward timeout must be > 0 seconds, got {timeout}")
        self.spec = absolute_spec(spec)
        self.options = dict(options or {})  # builtin settings for the workers (code_exec's sandbox limits)
        if self.options:
            configure(self.options)  # this process too (workers=0) and a bad option fails here
        self.fn = resolve(self.spec)  # fails early, in the parent, for a bad spec
        self.num_workers = workers
        self.timeout = float(timeout)
        self.failure_reward = float(failure_reward)
        self.label = label
        self.totals = dict.fromkeys(FAILURE_KINDS, 0)
        self.replaced = 0
        self._ctx = start_context(start_method) if workers else None
        self._workers: list[_Worker] = []
        self._busy = threading.Lock()  # one score_jobs at a time (the workers and their pipes are not shared)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        close_workers(self._workers)
        self._workers = []

    def _start(self) -> _Worker:
        return _Worker(self._ctx, self.spec, self.options or None)

    def score(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> RewardResult:
        """One reward per completion (``examples[i]`` belongs to ``completions[i]``), failures replaced."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        outcomes = self.score_jobs(JobInbox(zip(range(len(completions)), completions, examples)))
        return self.assemble([outcomes.get(i) for i in range(len(completions))])

    def score_jobs(self, inbox: JobInbox) -> dict[int, tuple[str, Any, dict[str, float]]]:
        """The outcome (``call_once``'s triple) of every ``(index, completion, example)`` job of ``inbox``, by index,
        once the inbox is closed and every job is answered. Jobs may arrive while this runs (another thread puts
        them; ``polyrl.algorithms.reward_stream``): each goes to the next free worker as soon as it is taken. One
        caller at a time (a lock serialises callers)."""
        outcomes: dict[int, tuple[str, Any, dict[str, float]]] = {}
        with self._busy:
            if self.num_workers == 0:
                while True:
                    jobs, closed = inbox.take()
                    for idx, completion, example in jobs:
                        outcomes[idx] = call_once(self.fn, completion, example)
                    if closed:
                        return outcomes
                    if not jobs:
                        inbox.wait()
            self._run_pool(inbox, outcomes)
        return outcomes

    def assemble(self, outcomes: Sequence[tuple[str, Any, dict[str, float]] | None]) -> RewardResult:
        """The ``RewardResult`` of per-completion outcomes in input order (None: no result, a crash); failures
        counted into ``totals``."""
        result = RewardResult([self.failure_reward] * len(outcomes))
        for i, out in enumerate(outcomes):
            kind, value, extras = out if out is not None else ("crash", "no result", {})
            if kind == "ok":
                result.rewards[i] = value
                for k, v in extras.items():
                    result.extras.setdefault(k, []).append(v)
                continue
            result.failures[kind] += 1
            result.failed.add(i)
            self.totals[kind] += 1
            if len(result.messages) < 5:
                result.messages.append(f"{kind}: {self.label}: {value}" if self.label else f"{kind}: {value}")
        return result

    def _run_pool(self, inbox: JobInbox, outcomes: dict) -> None:
        """Dispatch the inbox's jobs to the workers until it is closed and every job is answered; while it is
        open, a new job wakes the wait (its ``waker`` pipe)."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start())
        pending: deque = deque()
        closed = False
        while True:
            if not closed:
                jobs, closed = inbox.take()
                pending.extend(jobs)
            if closed and not pending and all(w.job is None for w in self._workers):
                return
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.job is None and pending:
                    w.job, completion, example = pending.popleft()
                    w.deadline = now + self.timeout
                    w.conn.send((w.job, completion, dict(example)))
            waiting = [w for w in self._workers if w.job is not None or not w.ready]
            conns = [w.conn for w in waiting] + ([inbox.waker] if not closed else [])
            timeout = max(0.0, min(w.deadline for w in waiting) - time.monotonic()) if waiting else None
            ready = wait(conns, timeout=timeout)
            for w in list(waiting):
                if w.conn in ready:
                    self._receive(w, outcomes)
                elif time.monotonic() >= w.deadline:
                    self._replace(w, outcomes, "timeout", f"no answer within {self.timeout:g}s; worker killed")

    def _receive(self, w: _Worker, outcomes: list) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._replace(w, outcomes, "crash", f"the reward worker running {self.spec} died ({w.exit_status()})")
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "init_error":
            self.close()
            raise UserError(f"the reward function {self.spec!r} failed to load in a worker: {msg[1]}")
        else:
            idx, kind, value, extras = msg
            outcomes[idx] = (kind, value, extras)
            w.job = None

    def _replace(self, w: _Worker, outcomes: list, kind: str, message: str) -> None:
        if w.job is None and not w.ready:
            code = w.proc.exitcode
            self.close()
            if code == REIMPORT_EXIT_CODE:
                raise UserError(REIMPORT_MESSAGE)
            if kind == "crash":
                raise UserError(f"a reward worker exited before it started: {message}")
            raise UserError(f"a reward worker did not start within {STARTUP_TIMEOUT_S:g}s ({message})")
        if w.job is not None:
            outcomes[w.job] = (kind, message, {})
        w.kill()
        self._workers[self._workers.index(w)] = self._start()
        self.replaced += 1


def example_view(example: Any) -> dict[str, Any]:
    """The dict a reward function receives for a ``PromptExample`` (or a row dict): ``prompt`` (the last user
    message), ``messages``, ``answer``, ``task``, ``metadata`` and ``tools`` (the row's tool definitions, None
    without)."""
    if isinstance(example, Mapping):
        d = dict(example)
        d.setdefault("metadata", {})
        return d
    messages = list(getattr(example, "messages", []) or [])
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return {
        "prompt": users[-1] if users else "",
        "messages": messages,
        "answer": getattr(example, "answer", None),
        "task": getattr(example, "task", None),
        "metadata": dict(getattr(example, "meta", {}) or {}),
        "tools": getattr(example, "tools", None),
    }


__all__ = [
    "BUILTINS",
    "FAILURE_KINDS",
    "RewardPool",
    "RewardResult",
    "call_once",
    "code_exec",
    "configure",
    "example_view",
    "register_reward",
    "resolve",
    "split_sum",
]
