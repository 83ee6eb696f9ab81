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

Not here: agent programs through the proxy (``--agent``): refused with the process producer (``config``); their
engine is driven by the proxy's server thread in the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyrl.agents.episode import Episode
from polyrl.agents.pool import EnvPool
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, run_episodes
from polyrl.run.replica_balance import episode_cost

_POOL = "polyrl.agents.env_pool"  # the WorkerContext.state key of a replica's environment pool


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
    items = [(x, None if seeds is None else int(seeds[g])) for g, x in enumerate(examples)]
    cost = episode_cost(n, limits.max_turns, limits.max_new_tokens, limits.max_episode_tokens)

    def fallback(missing: list[int]) -> list[list[Episode]]:
        eps = local([examples[g] for g in missing], None if seeds is None else [seeds[g] for g in missing])
        per: list[list[Episode]] = [[] for _ in missing]
        for e in eps:
            per[e.group].append(e)
        return per

    def count(failures: dict[str, int]) -> None:
        for k, v in failures.items():
            totals[k] = totals.get(k, 0) + v

    args = (env, n, sampling, limits, failure_reward)
    per = workers.call(worker_episodes, items, [cost] * len(items), fallback, args, on_meta=count)
    out = []
    for g, eps in enumerate(per):
        for e in eps:
            e.group = g  # its index in the share it ran in -> its example's index in this call
            out.append(e)
    return out


__all__ = ["EnvSpec", "remote_episodes", "worker_episodes"]
