"""Environment episodes in rollout worker processes (``async_producer = "process"``, ``polyrl.run.rollout_workers``):
each live replica runs the episode loop (``rollout.run_episodes``) on its own engine for its share of a call's
prompt examples, with environment instances of its own, and sends the finished ``Episode`` s back.

``remote_episodes(workers, env, examples, n, sampling, seeds, limits, failure_reward, local, totals)``: the examples
(each with its ``n`` episodes: one GRPO group, never cut) are split over the replicas by ``RolloutWorkers.call``,
each example costing ``replica_balance.episode_cost`` (the replicas' measured speeds then move the split as they
move a split of prompts). A replica runs ``worker_episodes``: on its first call it builds an ``EnvPool`` from the
run's environment spec (``EnvSpec``: the pool's resolved spec, ``env_workers`` processes, ``env_timeout``; the
pool is kept in the worker's ``WorkerContext.state`` for later calls and closed with the worker) and a
``ChatRenderer`` from the run's chat template over the worker's tokenizer (the model folder's, as the trainer's),
then ``run_episodes`` on its share: the examples keep their own seeds (``seeds[g]``, ``turn_seed`` per episode and
turn), so the tokens do not depend on which replica ran an example nor on what else it ran. Environments are built
exactly as in the trainer's pool: a fresh instance per episode, ``reset`` with the same example dict (polyrl gives
an environment no seed of its own; one that draws from an unseeded global RNG differs between any two pools, in
or out of worker processes). The reply: per example its episodes (``group`` renumbered to the example's index in
the call), and the failure counts of the replica's pool in this call, added to the trainer's pool's ``totals`` (so
``env_failures`` and the checkpointed totals count every failure wherever it happened).

A replica that dies or hangs in the call: its examples run in the trainer (``local``: the episode loop on the
trainer's rollout engine and environment pool) in the same call, and the replica restarts as for single
completions (``rollout_workers``).

Partial rollouts (``partial_rollouts``, ``polyrl.run.worker_partial``): the call's job carries the producer's
``(swap_step, takes)`` as a ``generate`` job does (every live replica gets one, an empty share too), the worker
hands its between-steps hook (``rollout_worker_process._PartialJob``) to ``worker_episodes`` as
``ctx.between_steps``, and the episode loop calls it between its engine steps, as the thread producer's loop calls
the source's: with ``swap_step`` N > 0 each replica's episodes take the batch's update at engine step N of its
loop (after its end, before it replies, when its loop is shorter), so with every opening prompt admitted in the
first step an episode's tokens and versions are those of the thread producer's loop over the whole batch. Each
episode records the engine's version per sampled token (``Episode.versions``), which travels back with the
episode. A dead replica's share runs in the trainer on one version (no swap inside it). Without partial rollouts
an episode has no per-token versions: the batch's version is stamped on its samples by the source, as for single
completions.

Agent programs through the proxy (``--agent``): ``remote_agent_episodes`` sends each replica its share of the
examples as above, and the replica runs ``worker_agent_episodes``: on its first call it imports the agent function
from the run's spec (``AgentSpec``: ``path/to/file.py:fn`` with the file made absolute in the trainer, or
``package.module:fn``; ``load_agent``, the trainer's own loader, so the file and what it imports must be importable
in the worker, FastAPI and uvicorn too) and starts an ``AgentProxy`` over the worker's engine on 127.0.0.1 (a free
port), both kept in ``WorkerContext.state`` (the proxy stopped with the worker); each call then runs ``run_agents``
for its share with the call's sampling and per-call cap, the run's ``max_turns`` / ``max_episode_tokens``,
``env_timeout`` per run and ``failure_reward``, the proxy driving the engine only during the call. The reply: per
example its episodes (one per recorded segment; a run that made no call as one without turns), and the call's
failure counts (error, timeout, no_reward). A dead replica's examples run through the trainer's own proxy
(``local``). With partial rollouts the call's job carries ``(swap_step, takes)`` as above, and the replica hands its
between-steps hook (``ctx.between_steps``) to ``proxy.driving``: the proxy's engine driver thread calls it between
its engine steps (``proxy_server.EngineDriver``), so with N > 0 a replica's calls take the batch's update at engine
step N of its driver's window (after the window, before it replies, when they took fewer steps); each recorded
segment carries the engine's version per sampled token (``Episode.versions``), which travels back with it. A
driver error (the engine failed, or the trainer's end closed while the driver waited in the hook) is raised after
the window, not left as failed agent runs. A dead replica's examples run through the trainer's proxy on one version
(no hook; ``RolloutWorkers.call`` holds ``local_lock`` around them). Under torchrun the replicas are rank 0's and run
every rank's agent runs; the episodes and the failure counts are then broadcast to the other ranks, which start no
proxy (``train.EpisodeSteps.root_episodes``); with partial rollouts the episodes carry their per-token versions
through that broadcast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.agents.episode import Episode
from polyrl.agents.pool import EnvPool
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, run_episodes
from polyrl.algorithms.workers import load_user_module
from polyrl.errors import ConfigError
from polyrl.run.replica_balance import episode_cost

_POOL = "polyrl.agents.env_pool"  # the WorkerContext.state key of a replica's environment pool
_PROXY = "polyrl.agents.agent_proxy"  # ... and of its agent proxy (agent programs, --agent)


@dataclass(frozen=True)
class EnvSpec:
    """What a replica builds its environments and renderer from: the trainer's pool's resolved ``spec``
    (registered names already turned into ``module:Class``, files made absolute), its ``workers`` and ``timeout``,
    and the run's chat template (None: the tokenizer's)."""

    spec: str
    workers: int
    timeout: float
    chat_template: str | None = None


def worker_episodes(
    ctx: Any,
    items: list[tuple[dict[str, Any], int | None]],
    env: EnvSpec,
    n: int,
    sampling: Any,
    limits: EpisodeLimits,
    failure_reward: float,
) -> tuple[list[list[Episode]], dict[str, int]]:
    """In a rollout worker (``RolloutWorkers.call``): ``n`` episodes of each ``(example, seed)`` of ``items`` on the
    worker's engine (with partial rollouts the episode loop calls the job's ``ctx.between_steps``); (per item its
    episodes, in index order; the failure counts of this call)."""
    held = ctx.state.get(_POOL)
    if held is None or held[0] != env:
        if held is not None:
            held[1].close()
        pool = EnvPool(env.spec, env.workers, env.timeout)
        held = (env, pool, ChatRenderer(ctx.tokenizer, env.chat_template))
        ctx.state[_POOL] = held
    _, pool, renderer = held
    before = dict(pool.totals)
    seeds = [s for _, s in items]
    eps = run_episodes(
        ctx.llm, pool, renderer, [x for x, _ in items], n, sampling, None if seeds[0] is None else seeds, limits,
        failure_reward, getattr(ctx, "between_steps", None),
    )  # fmt: skip
    per: list[list[Episode]] = [[] for _ in items]
    for e in eps:
        per[e.group].append(e)
    return per, {k: v - before.get(k, 0) for k, v in pool.totals.items() if v != before.get(k, 0)}


def _run_remote(
    workers: Any,
    job: Callable[..., tuple[list[list[Episode]], dict[str, int]]],
    args: tuple,
    examples: list[dict[str, Any]],
    seeds: list[int] | None,
    cost: float,
    local: Callable[[list[dict[str, Any]], list[int] | None], list[Episode]],
    totals: dict[str, int],
) -> list[Episode]:
    """``job`` (``worker_episodes`` / ``worker_agent_episodes``) over the replicas' shares of ``examples`` (each
    ``cost``), the examples of dead replicas run by ``local``; every reply's failure counts added to ``totals``; the
    episodes in (group, index) order, ``group`` the example's index in this call."""
    items = [(x, None if seeds is None else int(seeds[g])) for g, x in enumerate(examples)]

    def fallback(missing: list[int]) -> list[list[Episode]]:
        eps = local([examples[g] for g in missing], None if seeds is None else [seeds[g] for g in missing])
        per: list[list[Episode]] = [[] for _ in missing]
        for e in eps:
            per[e.group].append(e)
        return per

    def count(failures: dict[str, int]) -> None:
        for k, v in failures.items():
            totals[k] = totals.get(k, 0) + v

    per = workers.call(job, items, [cost] * len(items), fallback, args, on_meta=count)
    out = []
    for g, eps in enumerate(per):
        for e in eps:
            e.group = g  # its index in the share it ran in -> its example's index in this call
            out.append(e)
    return out


def remote_episodes(
    workers: Any,
    env: EnvSpec,
    examples: list[dict[str, Any]],
    n: int,
    sampling: Any,
    seeds: list[int] | None,
    limits: EpisodeLimits,
    failure_reward: float,
    local: Callable[[list[dict[str, Any]], list[int] | None], list[Episode]],
    totals: dict[str, int],
) -> list[Episode]:
    """``n`` episodes per example run by the rollout replicas of ``workers`` (see the module docstring), in
    (group, index) order as ``run_episodes`` returns them; ``local(examples, seeds)`` runs the examples of replicas
    that died or hung in the call; each replica's failure counts are added to ``totals``."""
    cost = episode_cost(n, limits.max_turns, limits.max_new_tokens, limits.max_episode_tokens)
    args = (env, n, sampling, limits, failure_reward)
    return _run_remote(workers, worker_episodes, args, examples, seeds, cost, local, totals)


@dataclass(frozen=True)
class AgentSpec:
    """What a replica builds its agent proxy from: the agent program's spec (``path/to/file.py:fn`` with the file
    made absolute, or ``package.module:fn``: imported in the worker by the trainer's loader, ``load_agent``), the
    run's chat template (None: the tokenizer's), the episode limits and the per-run timeout (``env_timeout``)."""

    agent: str
    chat_template: str | None
    max_turns: int
    max_episode_tokens: int
    timeout: float

    @staticmethod
    def of(agent: str, chat_template: str | None, max_turns: int, max_episode_tokens: int, timeout: float):
        target, _, name = agent.rpartition(":")
        if target.endswith(".py") or os.sep in target:  # a file: the same one whatever the worker's directory
            agent = f"{Path(target).resolve()}:{name}"
        return AgentSpec(agent, chat_template, max_turns, max_episode_tokens, timeout)


def load_agent(spec: str) -> Callable[..., Any]:
    """The agent function of ``--agent spec`` (``path/to/file.py:fn`` or ``package.module:fn``); a ConfigError
    says what is wrong. The trainer's proxy mode and the rollout workers load it alike."""
    target, _, name = spec.rpartition(":")
    fn = getattr(load_user_module(target, spec, "agent"), name, None)
    if not callable(fn):
        raise ConfigError(f"agent {spec!r}: {target} has no function {name!r}")
    return fn


class _HeldProxy:
    """A replica's agent proxy kept across its jobs (``WorkerContext.state``; ``close`` stops its server)."""

    def __init__(self, spec: AgentSpec, proxy: Any, fn: Callable[..., Any]) -> None:
        self.spec, self.proxy, self.fn = spec, proxy, fn

    def close(self) -> None:
        self.proxy.stop()


def worker_agent_episodes(
    ctx: Any,
    items: list[tuple[dict[str, Any], int | None]],
    spec: AgentSpec,
    n: int,
    sampling: Any,
    failure_reward: float,
) -> tuple[list[list[Episode]], dict[str, int]]:
    """In a rollout worker (``RolloutWorkers.call``): ``n`` runs of the agent program per ``(example, seed)`` of
    ``items`` through an ``AgentProxy`` serving the worker's engine on 127.0.0.1 (a free port; the proxy and the
    loaded agent function kept in ``ctx.state`` for later calls, stopped with the worker), with the call's
    sampling and per-call cap, the spec's limits and timeout: (per item its episodes, one per recorded segment, a
    run that made no call as one without turns; the failure counts of this call: error, timeout, no_reward). With
    partial rollouts the proxy's driver thread calls the job's ``ctx.between_steps`` between its engine steps."""
    held = ctx.state.get(_PROXY)
    if held is None or held.spec != spec:
        if held is not None:
            held.close()
        # lazy: FastAPI and uvicorn (the serve extra) are imported in the worker only for agent programs
        from polyrl.agents.proxy_server import AgentProxy

        fn = load_agent(spec.agent)
        renderer = ChatRenderer(ctx.tokenizer, spec.chat_template)
        proxy = AgentProxy(
            ctx.llm, sampling, sampling.max_tokens, renderer, request_sampling=False, max_turns=spec.max_turns,
            max_episode_tokens=spec.max_episode_tokens,
        ).start(drive=False)  # fmt: skip
        held = _HeldProxy(spec, proxy, fn)
        ctx.state[_PROXY] = held
    proxy = held.proxy
    proxy.sampling, proxy.max_tokens = sampling, sampling.max_tokens
    seeds = [s for _, s in items]
    # partial rollouts: the proxy's driver thread steps the engine, so it calls the job's hook between its steps
    with proxy.driving(getattr(ctx, "between_steps", None)):
        eps = proxy.run_agents(
            held.fn, [x for x, _ in items], n, None if seeds[0] is None else seeds, spec.timeout, failure_reward,
            keep_empty=True,
        )  # fmt: skip
    if proxy.driver.error is not None:  # the engine (or the hook: the trainer gone) failed: not the agents' fault
        raise proxy.driver.error
    per: list[list[Episode]] = [[] for _ in items]
    for e in eps:
        per[e.group].append(e)
    return per, {k: v for k, v in proxy.failures.items() if v}


def remote_agent_episodes(
    workers: Any,
    spec: AgentSpec,
    examples: list[dict[str, Any]],
    n: int,
    sampling: Any,
    seeds: list[int] | None,
    failure_reward: float,
    local: Callable[[list[dict[str, Any]], list[int] | None], list[Episode]],
    totals: dict[str, int],
) -> list[Episode]:
    """``n`` runs of the agent program per example, through a proxy in each rollout replica over its own engine
    (``worker_agent_episodes``); the episodes (every recorded segment) in (group, index) order; ``local`` (the
    trainer's own proxy) runs the examples of replicas that died or hung in the call; the replicas' failure counts
    are added to ``totals``."""
    cost = episode_cost(n, spec.max_turns, sampling.max_tokens, spec.max_episode_tokens)  # the call's cap per call
    args = (spec, n, sampling, failure_reward)
    return _run_remote(workers, worker_agent_episodes, args, examples, seeds, cost, local, totals)


__all__ = [
    "AgentSpec",
    "EnvSpec",
    "load_agent",
    "remote_agent_episodes",
    "remote_episodes",
    "worker_agent_episodes",
    "worker_episodes",
]
