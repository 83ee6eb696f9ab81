"""Where an online run's rewards come from: reward functions (``polyrl.algorithms.rewards``, isolated workers; the
sandboxed ``code_exec`` among them), an LLM judge (``judge``) and a sequence-classification reward model
(``model``), alone or summed with weights.

The reward spec (``--reward`` / ``<algo>.reward``) is a ``+``-joined sum of terms, each ``[weight*]term``:

- a builtin reward (``exact_match``, ``code_exec``, ``0.2*think_format``, ...);
- a function of your own, ``path/to/file.py:fn`` or ``package.module:fn`` (``0.5*my_rewards.py:fmt``);
- ``judge`` or ``judge:URL``: the judge of the ``[reward.judge]`` table (``judge:URL`` sets its ``url``);
- ``model`` or ``model:PATH``: the reward model at ``reward.model`` (``--reward-model PATH`` sets it, and
  ``--reward model`` when no ``--reward`` is given).

Syntax (``rewards.split_sum``): ``+`` separates terms and the text before a term's first ``*`` is its weight, so a
path in a sum may hold dots, dashes, spaces and ``:`` (the function is after the last ``:``) but no ``+`` or ``*``
(rename or link such a file); a lone ``file.py:fn`` that exists is taken whole, whatever its path holds (a
function name holds no ``+`` or ``*``: ``file.py:fn+exact_match`` is a sum). A term may appear once (weight it
instead of repeating it).

A spec of builtins only, or one function of your own, is a plain ``RewardPool``. Otherwise ``RewardSources``
scores every term and sums: the builtins in one pool (one call per completion), each function of your own in a pool
of its own, run exactly as it would be alone (``reward_workers`` worker processes, ``reward_timeout`` seconds per
call, its failures counted by kind), the judge over HTTP, the reward model in this process. Every term scores every
completion; a completion whose any term failed gets ``failure_reward`` (not a partial sum), and each failing term is
counted by kind (``error``, ``timeout``, ``non_number``, ``crash``) with a message naming the term
(``error: my_rewards.py:fmt: KeyError: ...``). Each term's mean before its weight, over the completions it scored,
is logged as ``reward/<name>``: a builtin's name, ``judge``, ``model``, a function's name (``reward/fmt``; its file
spec as written, ``reward/a.py:score``, when two terms share a name). ``[reward]`` is a top-level table of the run
config (``RewardConfig``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl.algorithms.reward_sources.judge import JudgeConfig, JudgeScorer
from polyrl.algorithms.rewards import (
    BUILTINS,
    FAILURE_KINDS,
    RewardPool,
    RewardResult,
    check_builtin,
    resolve,
    split_sum,
)
from polyrl.errors import ConfigError


@dataclass
class CodeExecConfig:
    """The ``[reward.code_exec]`` table: the sandbox limits of the ``code_exec`` reward (per completion)."""

    timeout: float = 5.0  # wall-clock seconds (the CPU limit too); keep it below <algo>.reward_timeout
    memory_mb: int = 512  # RLIMIT_AS

    def __post_init__(self) -> None:
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"reward.code_exec.timeout must be > 0 seconds, got {self.timeout!r}")
        if not isinstance(self.memory_mb, int) or self.memory_mb < 64:
            raise ConfigError(f"reward.code_exec.memory_mb must be an integer >= 64, got {self.memory_mb!r}")


@dataclass
class RewardConfig:
    """The ``[reward]`` table: settings of the reward sources the spec names (see the module docstring).
    ``model``: a sequence-classification reward model folder; ``model_batch_size`` sequences per forward;
    ``model_max_len`` tokens kept per sequence (its end); ``model_dtype``: ``auto`` (the run's compute dtype) or
    fp32 / bf16 / fp16."""

    model: str | None = None
    model_batch_size: int = 16
    model_max_len: int = 4096
    model_dtype: str = "auto"
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    code_exec: CodeExecConfig = field(default_factory=CodeExecConfig)

    def __post_init__(self) -> None:
        for name, cls in (("judge", JudgeConfig), ("code_exec", CodeExecConfig)):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                known = {f.name for f in dataclasses.fields(cls)}
                unknown = sorted(set(value) - known)
                if unknown:
                    raise ConfigError(f"unknown reward.{name} setting(s) {unknown}; known: {', '.join(sorted(known))}")
                setattr(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise ConfigError(f"[reward.{name}] must be a table of settings, got {value!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ConfigError(f"reward.model must be a reward model folder, got {self.model!r}")
        for key in ("model_batch_size", "model_max_len"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"reward.{key} must be a positive integer, got {v!r}")
        if self.model_dtype not in ("auto", "fp32", "bf16", "fp16"):
            raise ConfigError(f"reward.model_dtype must be auto, fp32, bf16 or fp16, got {self.model_dtype!r}")


@dataclass
class Term:
    """One term of a reward spec: ``kind`` is ``functions`` (``arg``: a ``RewardPool`` spec, the builtins of a sum
    as written), ``user`` (``arg``: ``path/to/file.py:fn`` or ``module:fn`` as written), ``judge`` (``arg``: URL or
    None) or ``model`` (``arg``: path or None); ``name``: the ``reward/<name>`` a ``user`` term is logged as."""

    kind: str
    weight: float = 1.0
    arg: str | None = None
    name: str | None = None


def parse_spec(spec: str) -> list[Term]:
    """The terms of a reward spec (see the module docstring): the builtins gathered into one ``functions`` term
    placed first (weights kept in its ``arg``), then the other terms as written. A spec of builtins only, or one
    function of the user's (unweighted), is a single ``functions`` term whose ``arg`` is the spec itself
    (``rewards.resolve`` checks it and names what is wrong). ConfigError names a malformed term."""
    text = spec.strip() if isinstance(spec, str) else ""
    target, sep, fn = text.rpartition(":")
    # one file reward: its path may hold + and *, its function name cannot (``a.py:f+exact_match`` is a sum)
    in_sum = "+" in fn or "*" in fn
    lone_file = sep and not in_sum and text.partition(":")[0] not in ("judge", "model") and Path(target).is_file()
    if not text or lone_file:
        return [Term("functions", 1.0, text)]
    builtins, others = [], []
    for t in split_sum(text):
        head, colon, rest = t.body.partition(":")
        if head in ("judge", "model"):
            others.append(Term(head, t.weight, rest.strip() or None))
        elif colon:
            others.append(Term("user", t.weight, t.body))
        else:
            builtins.append(t)
    if not others or (len(others) == 1 and not builtins and others[0].kind == "user" and others[0].weight == 1.0):
        return [Term("functions", 1.0, others[0].arg if others else text)]
    for t in builtins:
        check_builtin(t.body, text)
    _name_user_terms(others, {t.body for t in builtins})
    return ([Term("functions", 1.0, "+".join(t.text for t in builtins))] if builtins else []) + others


def _name_user_terms(terms: list[Term], builtins: set[str]) -> None:
    """Each ``user`` term's metric name: its function's name, or its spec as written when that name is another
    term's too (two files' ``score``, a function named like a builtin, ``judge`` or ``model``)."""
    fns = [t.arg.rpartition(":")[2] for t in terms if t.kind == "user" and t.arg]
    taken = builtins | {t.kind for t in terms if t.kind != "user"}
    for t in terms:
        if t.kind == "user" and t.arg:
            fn = t.arg.rpartition(":")[2]
            t.name = fn if fn not in taken and fns.count(fn) == 1 else t.arg


def check_spec(spec: str, cfg: RewardConfig, reward_timeout: float | None = None) -> None:
    """ConfigError when the spec, the ``[reward]`` table and the reward timeout disagree (before any model loads)."""
    terms = parse_spec(spec)
    _check_code_exec_timeout(spec, cfg, reward_timeout)
    for t in terms:  # names, sums and file.py:fn resolve here: a misspelt name or a broken file fails before any load
        if t.kind in ("functions", "user") and t.arg is not None:
            resolve(t.arg)
    kinds = [t.kind for t in terms]
    for kind in ("judge", "model"):
        if kinds.count(kind) > 1:
            raise ConfigError(f"the reward spec {spec!r} names {kind!r} twice; keep one term (weight it instead)")
    for t in terms:
        if t.kind == "judge" and t.arg is None and not cfg.judge.url:
            raise ConfigError("the reward 'judge' needs a URL: --reward judge:http://HOST:PORT/v1 or reward.judge.url")
        if t.kind == "model" and t.arg is None and not cfg.model:
            raise ConfigError("the reward 'model' needs a reward model folder: --reward-model PATH (reward.model)")
    if cfg.model and "model" not in kinds:
        raise ConfigError(
            f"reward.model is set but the reward spec {spec!r} does not use it; add the term: --reward model (or "
            f'"{spec}+model")'
        )


def _uses_code_exec(spec: str) -> bool:
    """Whether the builtin ``code_exec`` is a term of ``spec`` (not a file or function whose name contains it)."""
    if "code_exec" not in spec:
        return False
    try:
        return any(t.body == "code_exec" for t in split_sum(spec.strip()))
    except ConfigError:  # a lone file whose path holds + or *: not the builtin
        return False


def _check_code_exec_timeout(spec: str, cfg: RewardConfig, reward_timeout: float | None) -> None:
    if reward_timeout is not None and _uses_code_exec(spec) and cfg.code_exec.timeout + 1.0 >= reward_timeout:
        raise ConfigError(
            f"reward.code_exec.timeout ({cfg.code_exec.timeout:g}s) must stay below the reward timeout "
            f"({reward_timeout:g}s) by a second or more; raise --reward-timeout or lower reward.code_exec.timeout"
        )


def _configure_pool(
    spec: str, workers: int, timeout: float, failure: float, cfg: RewardConfig, label: str | None = None
) -> RewardPool:
    """The pool of one function term. The whole spec was checked (``check_spec``); only the sandbox limits are
    checked against the timeout here: checking the term alone against ``cfg`` would refuse a ``reward.model`` that
    another term of the sum uses."""
    _check_code_exec_timeout(spec, cfg, timeout)
    return RewardPool(spec, workers, timeout, failure, options=dataclasses.asdict(cfg.code_exec), label=label)


class RewardSources:
    """The sum of a spec's terms (see the module docstring); ``score``, ``totals`` and ``close`` as a pool's."""

    def __init__(
        self,
        spec: str,
        cfg: RewardConfig,
        workers: int = 2,
        timeout: float = 10.0,
        failure_reward: float = 0.0,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        check_spec(spec, cfg, timeout)
        self.failure_reward = float(failure_reward)
        self.totals = dict.fromkeys(FAILURE_KINDS, 0)
        self.terms: list[tuple[Term, Any]] = []
        terms = parse_spec(spec)
        label = (lambda t: t.arg) if len(terms) > 1 else (lambda t: None)  # failure messages name the term
        try:
            for t in terms:
                if t.kind == "functions":
                    arg = t.arg or ""
                    # a lone builtin beside other terms still reports its value (reward/<name>): as a sum of one
                    pool_spec = f"1*{arg}" if len(terms) > 1 and arg in BUILTINS else arg
                    scorer: Any = _configure_pool(pool_spec, workers, timeout, failure_reward, cfg, label(t))
                elif t.kind == "user":
                    scorer = _configure_pool(t.arg or "", workers, timeout, failure_reward, cfg, label(t))
                elif t.kind == "judge":
                    jcfg = dataclasses.replace(cfg.judge, url=t.arg) if t.arg else cfg.judge
                    scorer = JudgeScorer(jcfg)
                else:
                    # lazy: the reward model needs torch and the decoder; runs without one never load them
                    from polyrl.algorithms.reward_sources.model import ModelScorer

                    scorer = ModelScorer(t.arg or cfg.model, cfg, device=device, dtype=dtype)
                self.terms.append((t, scorer))
        except BaseException:
            self.close()
            raise

    @property
    def streams(self) -> bool:
        """Whether completions may be scored while the rollout still generates (``reward_stream``): not with a
        reward model, whose forwards on the rollout's device would contend with the engine (its memory, its CUDA
        graph captures); then they are scored after the batch."""
        return all(t.kind != "model" for t, _ in self.terms)

    def __enter__(self) -> RewardSources:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for _, scorer in self.terms:
            scorer.close()

    def score(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> RewardResult:
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        n = len(completions)
        total = [0.0] * n
        failed = [False] * n
        result = RewardResult([self.failure_reward] * n)
        for term, scorer in self.terms:
            if term.kind in ("functions", "user"):  # a pool (its weights applied inside when it is the builtins')
                part = scorer.score(completions, examples)
                for i in range(n):
                    total[i] += term.weight * part.rewards[i]
                for kind, count in part.failures.items():
                    result.failures[kind] += count
                    self.totals[kind] += count
                result.messages += part.messages[: 5 - len(result.messages)]
                result.extras.update(part.extras)
                for i in part.failed:
                    failed[i] = True
                kept = [part.rewards[i] for i in range(n) if i not in part.failed]
                if term.kind == "user" and kept:
                    result.extras[term.name or term.arg or "user"] = kept
                continue
            values = []
            for i, (kind, value, _) in enumerate(scorer.outcomes(completions, examples)):
                if kind == "ok":
                    total[i] += term.weight * value
                    values.append(value)
                    continue
                failed[i] = True
                result.failures[kind] += 1
                self.totals[kind] += 1
                if len(result.messages) < 5:
                    result.messages.append(f"{kind}: {term.kind}: {value}")
            if values:
                result.extras[term.kind] = values
        for i in range(n):
            if failed[i]:
                result.failed.add(i)
            else:
                result.rewards[i] = total[i]
        return result


def open_rewards(
    spec: str,
    cfg: RewardConfig | None = None,
    workers: int = 2,
    timeout: float = 10.0,
    failure_reward: float = 0.0,
    device: Any = None,
    dtype: Any = None,
) -> RewardPool | RewardSources:
    """The scorer of ``spec`` (``score(completions, examples) -> RewardResult``, ``totals``, ``close``): a
    ``RewardPool`` when it names reward functions only, else ``RewardSources``."""
    cfg = cfg if cfg is not None else RewardConfig()
    terms = parse_spec(spec)
    if len(terms) == 1 and terms[0].kind == "functions":
        check_spec(spec, cfg, timeout)
        return _configure_pool(spec, workers, timeout, failure_reward, cfg)
    return RewardSources(spec, cfg, workers, timeout, failure_reward, device=device, dtype=dtype)


__all__ = ["CodeExecConfig", "JudgeConfig", "RewardConfig", "RewardSources", "Term", "open_rewards", "parse_spec"]
