"""Builtin datasets ``builtin:<name>[?k=v&...][@split]``, generated deterministically from a seed.

Every task yields rows ``{"prompt", "completion", "answer", "task"}`` (``<name>-pref`` variants yield DPO rows
``{"prompt", "chosen", "rejected", "answer", "task"}``) and has a checker used by demos and rewards:
``check(completion_text, example)``. Common parameters: ``n`` (rows, default 2000 train / 200 test),
``seed`` (default 0), ``test`` (held-out fraction of the problem space, default 0.1). The test split holds
distinct problems (fewer than 200 by default when the space is small); the train split may repeat problems. The
train and test splits are disjoint by construction: a problem belongs to the test split when a hash of its prompt falls
in the held-out fraction, so no seed or ``n`` can leak test prompts into training.
Tasks: ``arithmetic``, ``reverse``, ``count``, ``copy`` (exact answers) and ``markov`` (text from a fixed random
Markov chain over words, with a known entropy floor, for loss-curve studies; its checker only checks well-formedness:
there is no single right continuation).
This module generates and checks; it does not tokenise (see ``polyrl.data.chat``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from polyrl.data.builtin import arithmetic, markov, strings
from polyrl.data.builtin.check import check_string, extract_answer
from polyrl.errors import ConfigError, did_you_mean

COMMON_DEFAULTS = {"seed": 0, "test": 0.1}
STALL_ATTEMPTS = 20_000  # consecutive draws without a new usable problem: the space is exhausted
SPLIT_ALIASES = {"train": "train", "test": "test", "validation": "test", "eval": "test", "heldout": "test"}


@dataclass(frozen=True)
class BuiltinTask:
    name: str
    defaults: Mapping[str, Any]
    generate: Callable[[random.Random, dict], dict]
    wrong_answer: Callable[[random.Random, dict], str]
    check: Callable[[str, str], bool]
    validate: Callable[[dict], None]


TASKS: dict[str, BuiltinTask] = {}


def register_task(task: BuiltinTask) -> None:
    TASKS[task.name] = task


register_task(
    BuiltinTask(
        "arithmetic",
        arithmetic.DEFAULTS,
        arithmetic.generate,
        arithmetic.wrong_answer,
        arithmetic.check,
        arithmetic.validate,
    )
)
register_task(
    BuiltinTask("markov", markov.DEFAULTS, markov.generate, markov.wrong_answer, markov.check, markov.validate)
)
for _name, _cls in (("reverse", strings.Reverse), ("count", strings.Count), ("copy", strings.Copy)):
    register_task(BuiltinTask(_name, _cls.defaults, _cls.generate, _cls.wrong_answer, _cls.check, _cls.validate))


def names() -> list[str]:
    """Every builtin dataset name, including the ``-pref`` preference variants."""
    return sorted(TASKS) + sorted(f"{n}-pref" for n in TASKS)


def parse_spec(spec: str) -> tuple[str, dict[str, str], str | None]:
    """``"arithmetic?max=50@test"`` -> ("arithmetic", {"max": "50"}, "test"). The ``builtin:`` prefix is optional."""
    body = spec.removeprefix("builtin:")
    split = None
    if "@" in body:
        body, split = body.rsplit("@", 1)
    name, _, query = body.partition("?")
    params: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"builtin dataset {spec!r}: parameter {item!r} must look like key=value")
        if key in params:
            raise ConfigError(f"builtin dataset {spec!r}: parameter {key!r} is given twice; keep one")
        params[key] = value
    return name, params, split


def _resolve(name: str, params: Mapping[str, Any]) -> tuple[BuiltinTask, bool, dict]:
    base, pref = (name[: -len("-pref")], True) if name.endswith("-pref") else (name, False)
    if base not in TASKS:
        hint = did_you_mean(name, names())
        raise ConfigError(f"unknown builtin dataset {name!r}{hint}; choose one of: {', '.join(names())}")
    task = TASKS[base]
    merged: dict[str, Any] = {**COMMON_DEFAULTS, "n": None, **task.defaults}
    unknown = sorted(set(params) - set(merged))
    if unknown:
        hint = did_you_mean(unknown, list(merged))
        raise ConfigError(
            f"builtin:{name} has no parameter(s) {unknown}{hint}; it accepts: {', '.join(sorted(merged))}"
        )
    for key, value in params.items():
        example = merged[key] if merged[key] is not None else 8
        merged[key] = _typed(name, key, value, PARAM_TYPES.get(key) or type(merged[key]), example)
    if not 0.0 < merged["test"] < 1.0:
        raise ConfigError(f"builtin:{name} test={merged['test']} must be a fraction in (0, 1), e.g. test=0.1")
    task.validate(merged)
    return task, pref, merged


# parameters whose default (None, or an int for a number) does not give their type
PARAM_TYPES = {"n": int, "max_b": int, "mean_len": float}


def _typed(name: str, key: str, value: Any, kind: type, example: Any) -> Any:
    """``value`` (text from the spec, or a value given in code) as the parameter's type (its default's), or a
    ConfigError naming the parameter."""
    if kind not in (int, float) or isinstance(value, kind) and not isinstance(value, bool):
        return value
    try:
        return kind(value) if kind is float else int(str(value))
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"builtin:{name} {key}={value!r} must be {what}, e.g. {key}={example}") from None


def _is_test(prompt: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return (h % 1_000_000) < fraction * 1_000_000


def generate(spec: str, split: str | None = None, **overrides: Any) -> list[dict]:
    """Rows of a builtin dataset. ``split`` (train/test) overrides the spec's ``@split``; default train."""
    name, params, spec_split = parse_spec(spec)
    params = {**params, **overrides}
    split_name = SPLIT_ALIASES.get(split or spec_split or "train")
    if split_name is None:
        raise ConfigError(f"builtin:{name}: unknown split {split or spec_split!r}; use @train or @test")
    task, pref, p = _resolve(name, params)
    explicit_n = p["n"] is not None
    n = p["n"] if explicit_n else (2000 if split_name == "train" else 200)
    if n < 1:
        raise ConfigError(f"builtin:{name} n={n} must be >= 1")
    rng = random.Random(f"polyrl-builtin:{task.name}:{p['seed']}:{split_name}")
    want_test = split_name == "test"
    rows: list[dict] = []
    seen: set[str] = set()  # the test split holds distinct problems; train may repeat them
    misses = 0
    while len(rows) < n:
        if misses > STALL_ATTEMPTS:
            if not explicit_n and rows:
                break  # a small problem space simply yields fewer default test problems
            raise ConfigError(
                f"builtin:{name}: found only {len(rows)} distinct {split_name} problems, fewer than n={n}; the problem "
                f"space is too small for test={p['test']}: lower n, or raise max / max_len"
            )
        ex = task.generate(rng, p)
        if _is_test(ex["prompt"], p["test"]) != want_test or (want_test and ex["prompt"] in seen):
            misses += 1
            continue
        misses = 0
        seen.add(ex["prompt"])
        row = {"prompt": ex["prompt"], "answer": ex["answer"], "task": task.name}
        if pref:
            row["chosen"] = ex["answer"]
            row["rejected"] = task.wrong_answer(rng, ex)
        else:  # a task may demonstrate a flawed completion in training rows (arithmetic's noise); tests stay exact
            row["completion"] = ex.get("completion", ex["answer"]) if not want_test else ex["answer"]
        rows.append(row)
    return rows


def _field(example: Any, key: str) -> Any:
    if isinstance(example, Mapping):
        return example.get(key)
    return getattr(example, key, None)


def check(completion_text: str, example: Any) -> bool:
    """Exact-match check of a completion against ``example``'s answer (a row dict or a PromptExample).

    Uses the task's checker when ``example`` names a builtin task, else a string match of the extracted answer.
    """
    answer = _field(example, "answer")
    if answer is None:
        raise ConfigError("check() needs an example with an 'answer' field")
    task = TASKS.get(str(_field(example, "task") or "").removesuffix("-pref"))
    fn = task.check if task is not None else check_string
    return bool(fn(completion_text, str(answer)))


__all__ = ["TASKS", "BuiltinTask", "check", "extract_answer", "generate", "names", "parse_spec", "register_task"]
