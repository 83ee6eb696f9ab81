"""GRPO / GSPO / PPO over episodes: ``polyrl train --algo grpo --env calculator`` (or ``fit(..., grpo={"env": ...})``).

``with_episodes(run_cls)`` makes an ``OnlineRun`` class (``OnlineRun`` itself for GRPO/GSPO, ``ActorCriticRun`` for PPO)
whose ``collect`` rolls out episodes instead of single completions; everything after it is the online loop as it
is: each episode is ONE training ``Sample`` (opening prompt + every later token, ``mask`` on the policy's sampled
tokens only, ``logprobs`` = the engine's log-probs of exactly those tokens: the old log-probs, no re-tokenisation),
``group`` = its prompt, so GRPO's group advantages compare the ``samples_per_prompt`` episodes of one prompt, and the
loss, the mismatch measurement, checkpoints and exact resume are the online loop's. The episode reward is the
environment's (``reward`` is unused). ``rollout_row`` puts an episode's turns, tool calls and observations into
the run's ``rollouts.jsonl`` (``polyrl view``). Metrics per step: ``reward``, ``episode/turns``, ``episode/tool_calls``,
``episode/tool_call_rate`` (episodes with at least one call), ``episode/invalid_tool_calls``,
``episode/tool_errors``, ``episode/length``, status fractions, ``env_failures``, ``rollout_mask_logmass`` when turns
are constrained (``formats``: the environment's or ``grpo.rollout_response_format``); evaluation (``train.eval_every``)
runs greedy episodes on the held-out prompts (``eval_reward``, ``eval_tool_call_rate``) and, with ``eval_n`` K > 1, K
sampled episodes per prompt (``eval_sampled_reward``, unbiased ``eval_pass@k``, ``eval_length``).
Proxy mode (``--agent file.py:fn``): the episodes come from an openai-client agent program driven through
``polyrl.agents.proxy_server.AgentProxy`` (one Sample per recorded segment, the agent's reward on each); the
``reward`` metric and the evaluation count agent runs (``episode_totals``: a run's segments once, a run that failed
before its first call with ``failure_reward``), and the evaluation's calls are capped at ``eval_max_new_tokens``.
Asynchronous RL (``max_staleness`` K > 0, docs/async-rl.md): ``collect`` is the rollout source's producer, inline
or (``async_producer = "thread"``) in the producer thread on the policy's separate rollout copy, while the trainer
trains; the environment pool and the proxy are then used by that thread, and by the trainer's evaluation only once
the thread is drained. With ``async_producer = "process"`` ``episodes`` sends the examples to the rollout worker
processes (``remote.remote_episodes``: each runs the episode loop on its own engine with its own environment pool;
``--agent``: ``remote.remote_agent_episodes``, each runs the agent program through a proxy of its own serving its
engine, with or without partial rollouts; ``replica_episodes`` picks one), the trainer's own loop or proxy
(``local_episodes``) running the share of a worker that dies.
Each batch carries its transcripts (``batch_state``), checkpointed with the queue. With
partial rollouts (``partial_rollouts``) the episode loop calls the policy's ``between_steps`` (thread producer) or
the worker's job hook (process producer, ``remote``) at engine-step boundaries, and in proxy mode the proxy's
engine driver thread calls the source's hook bound to the producer thread's batch (thread producer:
``PartialRollouts.thread_hook``, given to ``AgentProxy.driving`` for the batch's agent runs) or, in a rollout worker
(process producer), the worker's job hook (``remote.worker_agent_episodes``), so a weight update
lands while episodes are in flight; each episode (proxy mode: each recorded segment) records the policy version of
every token (``Episode.versions`` -> ``Sample.token_versions``).
Under torchrun (``--nproc-per-node N``): each rank runs the episodes of its share of a call's prompt examples
(``data_parallel_episodes``: examples r, r + N, ..., each with its own seed, so the episodes are those of one
process) on its own rollout engine, with its own environment pool (``--env``) or its own agent proxy serving that
engine (``--agent``: the agent runs of its share, each rank's proxy on a port of its own); the episodes (ids, masks,
log-probs, versions, rewards, transcripts) and each rank's failure counts are gathered, so every rank holds the whole
batch, the same metrics and the same failure totals, and training goes on as for single completions
(``polyrl.run.online``): the same advantages on every rank, each training its strided share; rank 0 logs and writes
rollouts.jsonl. The evaluation's episodes are split the same way. Synchronous, and async with the inline or thread
producer (the gather then runs on the producer's gloo group, ``polyrl.run.async_steps``). With the process producer
rank 0's rollout worker processes run every episode (``--env``) or agent run (``--agent``) and the batch is
broadcast to the other ranks with the replicas' failure counts (``root_episodes``), which build no environment pool
and start no agent proxy of their own (their engines never run). Partial rollouts under torchrun: the thread
producer (each rank's episode loop or proxy takes the update) and the process producer (rank 0's workers take it,
``polyrl.run.worker_partial``; the broadcast episodes carry their per-token versions).
Not here: the episode loop (``rollout``), the loss and advantages (``polyrl.algorithms``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from polyrl.agents.episode import Episode
from polyrl.agents.formats import pick, turn_grammar
from polyrl.agents.pool import FAILURE_KINDS, EnvInfo, EnvPool
from polyrl.agents.remote import AgentSpec, EnvSpec, load_agent, remote_agent_episodes, remote_episodes
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, episode_metrics, run_episodes
from polyrl.data.dataset import chat_tokenizer
from polyrl.errors import ConfigError
from polyrl.run.evaluate import sampled_metrics
from polyrl.run.prompt_order import rollout_seed
from polyrl.run.stop_signal import StopSignal
from polyrl.run.teardown import release
from polyrl.train import parallel as par


@contextmanager
def rollout_window(policy: Any):
    """The rollout engine ready to sample (eval mode, KV cache allocated), restored afterwards (cache released when
    the policy releases it for training; requests aborted after a failure)."""
    net = policy.rollout_net
    was_training = net.training
    net.eval()
    if not policy.llm.kv.allocated:
        policy.llm.reallocate()
    try:
        yield policy.llm
    except BaseException:
        policy.llm.abort_all()
        raise
    finally:
        if policy.release_kv:
            policy.llm.release()
        net.train(was_training)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@dataclasses.dataclass
class EpisodeTotal:
    """One episode as the metrics count it: an environment episode, or one run of the agent program (proxy mode)."""

    group: int
    reward: float
    policy_tokens: int = 0
    turns: float = 0.0
    tool_calls: float = 0.0


def episode_totals(eps: list[Episode]) -> list[EpisodeTotal]:
    """One ``EpisodeTotal`` per ``(group, index)`` of ``eps``, in first-seen order. An environment episode is one
    ``Episode``; a proxy-mode agent run is one ``Episode`` per recorded segment (the agent rewrote its history), all
    with the run's reward: their policy tokens, turns and tool calls are summed, the reward taken once."""
    out: dict[tuple[int, int], EpisodeTotal] = {}
    for e in eps:
        t = out.setdefault((e.group, e.index), EpisodeTotal(e.group, e.reward))
        t.policy_tokens += int(sum(e.mask))
        t.turns += e.metrics.get("turns", 0.0)
        t.tool_calls += e.metrics.get("tool_calls", 0.0)
    return list(out.values())


class EpisodeSteps:
    """Mixin placed before an ``OnlineRun`` class (see ``with_episodes``)."""

    agents = False  # proxy mode (``--agent``): agent programs instead of environment episodes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

        a, ag = self.a, self.cfg.episodes
        template = chat_tokenizer(self.cfg.data, self.tokenizer).template
        self.renderer = ChatRenderer(self.tokenizer, template)
        self.limits = EpisodeLimits(ag.max_turns, a.max_new_tokens, ag.max_episode_tokens)
        self.env_pool, self.proxy, self.agent_fn = None, None, None
        self.agents = bool(ag.agent)  # proxy mode: agent programs (every rank, with or without a proxy of its own)
        if self.agents:
            self.agent_fn = load_agent(ag.agent)  # every rank: a wrong spec is the same ConfigError everywhere
            if self.policy.idle_engine:  # torchrun, process producer, rank > 0: rank 0's workers run every agent run
                source = f"agent {ag.agent!r} run by rank 0's rollout workers"  # (root_episodes): no proxy here
            else:
                self._start_proxy()
                source = f"agent {ag.agent!r} through {self.proxy.url}"
            # the process producer's replicas load the same function and serve their own engines (remote)
            self.agent_spec = AgentSpec.of(ag.agent, template, ag.max_turns, ag.max_episode_tokens, ag.env_timeout)
            if self.policy.remote is not None:
                source += f", agent runs in {len(self.policy.remote.procs)} rollout worker process(es)"
        else:
            self.env_info = EnvInfo.of(ag.env)
            source = f"env {ag.env!r} ({len(self.env_info.tools)} tool(s))"
            # the process producer's replicas build theirs from the same spec (polyrl.agents.remote)
            self.env_spec = EnvSpec(self.env_info.spec, ag.env_workers, ag.env_timeout, template)
            if self.policy.idle_engine:  # torchrun, process producer, rank > 0: rank 0's workers run every episode
                self._env_totals = dict.fromkeys(FAILURE_KINDS, 0)  # (root_episodes), so this rank builds no pool
            else:
                self.env_pool = EnvPool(ag.env, ag.env_workers, ag.env_timeout)
                self._env_totals = self.env_pool.totals
            if self.policy.remote is not None:
                source += f", episodes in {len(self.policy.remote.procs)} rollout worker process(es)"
            self._check_turn_format()
        self._apply_saved_failures(getattr(self, "_saved_env_failures", {}))
        self.print(
            f"episodes: {source}, at most {ag.max_turns} turns of {a.max_new_tokens} tokens, "
            f"{ag.max_episode_tokens} tokens per episode"
        )

    def _check_turn_format(self) -> None:
        """The environment's / the run's turn format with the environment's tools compiles (a UserError now, not at
        the first rollout)."""
        info = self.env_info
        fmt = pick(info.response_format, self.structured)
        grammar = turn_grammar(fmt, info.tools, self.tokenizer, info.parallel_tool_calls)
        if grammar is not None:
            self.policy.llm.grammar_cache().matcher(grammar)

    def _start_proxy(self) -> None:
        # lazy: the proxy server imports FastAPI (the serve extra), needed only in proxy mode
        from polyrl.agents.proxy_server import AgentProxy

        a, ag = self.a, self.cfg.episodes
        self.proxy = AgentProxy(
            self.policy.llm,
            self.sampling,
            a.max_new_tokens,
            self.renderer,
            request_sampling=False,
            max_turns=ag.max_turns,
            max_episode_tokens=ag.max_episode_tokens,
        ).start(drive=False)

    def _failure_counts(self) -> dict[str, int]:
        """The live dict of this process's failure counts: the environment pool's, the agent runs' (proxy mode, a
        plain dict on every rank), or a plain dict on a rank that builds no pool (``root_episodes`` adds rank 0's
        counts there)."""
        if self.agents:
            if not hasattr(self, "_agent_totals"):
                self._agent_totals = {}
            return self._agent_totals
        return self._env_totals

    @property
    def failure_totals(self) -> dict[str, int]:
        if self.agents:
            return dict(getattr(self, "_agent_totals", {}))
        return dict(getattr(self, "_env_totals", {}))

    def episodes(self, examples: list[dict], n: int, sampling: Any, seeds: list[int] | None) -> list[Any]:
        if self.policy.remote_on_root:  # torchrun, process producer: rank 0's replicas run every episode
            return self.root_episodes(lambda totals: self.replica_episodes(examples, n, sampling, seeds, totals))
        if self.policy.remote is not None:  # process producer: the rollout worker replicas
            return self.replica_episodes(examples, n, sampling, seeds, self._failure_counts())
        if self.world.distributed:  # torchrun: each rank its share, then every episode on every rank
            return self.data_parallel_episodes(examples, n, sampling, seeds)
        return self.local_episodes(examples, n, sampling, seeds)

    def replica_episodes(
        self, examples: list[dict], n: int, sampling: Any, seeds: list[int] | None, totals: dict[str, int]
    ) -> list[Any]:
        """The episodes of ``examples`` run by this process's rollout worker replicas (``policy.remote``): the
        episode loop with an environment pool in each (``remote_episodes``) or the agent program through a proxy in
        each (``remote_agent_episodes``); a dead replica's share by this process's own loop or proxy
        (``local_episodes``); the replicas' failure counts added to ``totals``."""
        local = lambda xs, ss: self.local_episodes(xs, n, sampling, ss)  # noqa: E731
        if self.agents:
            return remote_agent_episodes(
                self.policy.remote, self.agent_spec, examples, n, sampling, seeds, self.a.failure_reward, local, totals
            )  # fmt: skip
        return remote_episodes(
            self.policy.remote, self.env_spec, examples, n, sampling, seeds, self.limits, self.a.failure_reward, local,
            totals,
        )  # fmt: skip

    def root_episodes(self, run_on_root: Callable[[dict[str, int]], list[Any]]) -> list[Any]:
        """Under torchrun with the process producer: rank 0's rollout worker processes run every episode or agent
        run (``run_on_root(totals)``, ``replica_episodes``: the episode loop or the agent program in each replica; a
        dead worker's share by rank 0's own loop or proxy), then the episodes and the failure counts of this call
        are broadcast on this thread's group (the producer's in an async run, ``collectives_on``), so every rank
        holds the whole batch in ``(group, index)`` order and the same failure totals. A failure on rank 0 is
        broadcast instead: rank 0 re-raises it, the other ranks raise a RuntimeError naming it. The other ranks
        build no environment pool and start no agent proxy (their counts are a plain dict, rank 0's added to it;
        rank 0's own proxy, over its fallback engine, runs only a dead worker's share)."""
        totals = self._failure_counts()
        if not self.world.is_main:
            got = self.world.broadcast_object(None)
            if isinstance(got, str):
                raise RuntimeError(f"rank 0's episodes failed: {got}")
            eps, counts = got
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            return eps
        before = dict(totals)
        try:
            eps = run_on_root(totals)
        except BaseException as exc:
            self.world.broadcast_object(f"{type(exc).__name__}: {exc}")
            raise
        self.world.broadcast_object((eps, {k: v - before.get(k, 0) for k, v in totals.items()}))
        return eps

    def data_parallel_episodes(self, examples: list[dict], n: int, sampling: Any, seeds: list[int] | None) -> list[Any]:
        """Under torchrun: this rank runs the ``n`` episodes of examples ``rank, rank + W, ...`` on its own engine
        with its own environment pool (or its own agent proxy), each example with its own seed (``seeds[g]``, then
        one per episode and turn or call), so the episodes are those one process runs; then every rank's episodes
        (token ids, masks, log-probs, versions, rewards, transcripts; an agent run's segments in their order) and
        its failure counts of this call are gathered on this thread's group (the producer's in an async run,
        ``collectives_on``). Every rank returns every episode in ``(group, index)`` order, ``group`` the example's
        index in this call, and adds the other ranks' failures to its own counts, so the totals are the same on
        every rank. A rank whose share fails still joins the gather, and then every rank raises (no rank left
        waiting)."""
        mine = par.shard_indices(len(examples), self.world)
        totals = self._failure_counts()
        before = dict(totals)
        eps, failure = [], None
        try:
            if mine:
                share_seeds = None if seeds is None else [seeds[g] for g in mine]
                eps = self.local_episodes([examples[g] for g in mine], n, sampling, share_seeds)
        except Exception as exc:  # raised after the gather, which every rank must join
            failure = exc
        for e in eps:
            e.group = mine[e.group]  # its index in this rank's share -> its example's index in the call
        counts = {k: v - before.get(k, 0) for k, v in totals.items()}
        error = None if failure is None else f"{type(failure).__name__}: {failure}"
        parts = self.world.all_gather_object((eps, counts, error))
        if failure is not None:
            raise failure
        failed = [f"{r} ({err})" for r, (_, _, err) in enumerate(parts) if err is not None]
        if failed:
            raise RuntimeError(f"the episodes of rank(s) {', '.join(failed)} failed")
        out = []
        for r, (part, c, _) in enumerate(parts):
            out.extend(part)
            if r != self.world.rank:
                for k, v in c.items():
                    totals[k] = totals.get(k, 0) + v
        out.sort(key=lambda e: (e.group, e.index))
        return out

    def local_episodes(self, examples: list[dict], n: int, sampling: Any, seeds: list[int] | None) -> list[Any]:
        """``n`` episodes per example on this process's rollout engine (the environment pool's, or the proxy's)."""
        with rollout_window(self.policy) as llm:
            if not self.agents:
                return run_episodes(
                    llm, self.env_pool, self.renderer, examples, n, sampling, seeds, self.limits,
                    self.a.failure_reward, self.policy.between_steps,
                )  # fmt: skip
            # this call's sampling and per-call cap (the evaluation's eval_max_new_tokens, else max_new_tokens); every
            # agent run counted, one that made no call as an episode without turns
            self.proxy.sampling, self.proxy.max_tokens = sampling, sampling.max_tokens
            # partial rollouts: the proxy's driver thread steps the engine for this (the producer's) thread's batch,
            # so it calls the source's step-boundary hook bound to this batch (None in the trainer's thread)
            carry = getattr(getattr(self, "source", None), "thread_hook", None)
            with self.proxy.driving(carry() if carry is not None else None):
                eps = self.proxy.run_agents(
                    self.agent_fn, examples, n, seeds, self.cfg.episodes.env_timeout, self.a.failure_reward,
                    keep_empty=True,
                )  # fmt: skip
            totals = self._failure_counts()
            for k, v in self.proxy.failures.items():
                totals[k] = totals.get(k, 0) + v
            return eps

    def collect(self, step: int) -> tuple[list[Any], list[float], dict[str, float]]:
        t0 = time.perf_counter()
        idx = self.data.take(self.a.prompts_per_step)
        seeds = [rollout_seed(self.cfg.seed, step, k) for k in range(len(idx))]
        before = sum(self.failure_totals.values())
        eps = self.episodes([self.views[i] for i in idx], self.a.samples_per_prompt, self.sampling, seeds)
        t1 = time.perf_counter()
        kept = [e for e in eps if e.trainable]
        # sample i is kept[i]: rollout_row describes it. An async run's collect runs ahead (in the producer thread
        # with async_producer = "thread", while the trainer writes the rows of the batch it trains): its transcripts
        # leave with the batch (batch_state) and come back with it (restore_batch_state)
        self._collected = kept
        if self.source is None:
            self._step_episodes = kept
        samples = [e.to_sample() for e in kept]
        rewards = [e.reward for e in kept]
        policy_tokens = [float(sum(e.mask)) for e in kept]
        all_rewards = [t.reward for t in episode_totals(eps)]  # per episode (an agent run's segments count once)
        mean = _mean(all_rewards)
        m = {
            "reward": mean,
            "reward_std": float(sum((r - mean) ** 2 for r in all_rewards) / max(len(all_rewards) - 1, 1)) ** 0.5,
            "response_length": _mean(policy_tokens),
            "response_length_max": max(policy_tokens, default=0.0),
            "truncated_fraction": _mean([float(e.status == "max_tokens") for e in eps]),
            "rollout_s": t1 - t0,
            "rollout_tokens_per_s": sum(policy_tokens) / max(t1 - t0, 1e-9),
            "env_failures": float(sum(self.failure_totals.values()) - before),
            "env_failures_total": float(sum(self.failure_totals.values())),
            "episodes_untrainable": float(len(eps) - len(kept)),
            **episode_metrics(eps),
        }
        if any(e.masked_logmass is not None for e in kept):  # what the format masks removed, per policy token
            m["rollout_mask_logmass"] = sum(e.masked_logmass or 0.0 for e in kept) / max(1.0, sum(policy_tokens))
        bad = next((e for e in eps if e.status == "env_error"), None)
        if bad is not None:
            self.print(f"step {step + 1}: environment failure ({int(m['env_failures'])} this step): {bad.error}")
        if not samples:
            raise ConfigError(f"step {step + 1}: no episode could start (every reset failed: {bad and bad.error})")
        return samples, rewards, m

    def batch_state(self) -> Any:
        """The transcripts of the batch ``collect`` just produced, as JSON (checkpointed in an async run's queue)."""
        return [dataclasses.asdict(e) for e in self._collected]

    def restore_batch_state(self, state: Any) -> None:
        eps = None
        if state is not None:  # None: a queue checkpointed before transcripts were kept
            eps = [Episode(**{**d, "turns": [tuple(t) for t in d["turns"]]}) for d in state]
        self._step_episodes = eps

    def rollout_row(self, i: int, sample: Any) -> dict[str, Any]:
        """Episode ``i`` of this step for ``rollouts.jsonl``: the transcript after the opening prompt as tokens (with
        the policy mask) and as OpenAI messages (assistant turns, tool calls, tool observations)."""
        row = super().rollout_row(i, sample)
        if self._step_episodes is None:  # a batch restored from a checkpoint of an older version: no transcript
            return row
        e = self._step_episodes[i]
        row.update(
            kind="episode",
            completion=self.tokenizer.decode(e.ids),
            finish_reason=e.status,
            mask=list(e.mask),
            messages=e.messages,
            status=e.status,
            error=e.error,
            metrics=dict(e.metrics),
        )
        return row

    def evaluate(self) -> dict[str, float]:
        """Greedy episodes on the held-out prompts; with ``eval_n`` K > 1 also K sampled episodes per prompt at the
        training temperature (the same seeds at every evaluation): ``eval_sampled_reward``, unbiased
        ``eval_pass@k`` (an episode passes when its reward >= ``eval_pass_threshold``) and ``eval_length`` (the
        policy's tokens per episode), as the single-turn evaluation (``polyrl.run.evaluate.sampled_metrics``). Every
        number is per episode (``episode_totals``): in proxy mode one run of the agent program, however many
        segments it recorded, and a run that failed before its first call counts with ``failure_reward``; each
        call is capped at ``eval_max_new_tokens``."""
        _, _, views = self.eval_set
        params = self.sampling.clone(temperature=0.0, max_tokens=self.a.eval_max_new_tokens or self.a.max_new_tokens)
        greedy = episode_totals(self.episodes(list(views), 1, params, None))
        out = {
            "eval_reward": _mean([t.reward for t in greedy]),
            "eval_tool_call_rate": _mean([float(t.tool_calls > 0) for t in greedy]),
            "eval_turns": _mean([t.turns for t in greedy]),
        }
        n = getattr(self.a, "eval_n", 1)
        if n > 1:
            sampling = params.clone(temperature=self.a.temperature, top_p=self.a.top_p)
            seeds = [rollout_seed(self.cfg.seed, -1, k) for k in range(len(views))]
            drawn = episode_totals(self.episodes(list(views), n, sampling, seeds))
            rewards, groups = [t.reward for t in drawn], [t.group for t in drawn]
            lengths = [t.policy_tokens for t in drawn]
            out.update(sampled_metrics(rewards, groups, lengths, n, self.a.eval_pass_threshold))
        return out

    def data_state(self) -> dict[str, Any]:
        state = super().data_state()
        state["env_failures"] = self.failure_totals if hasattr(self, "limits") else {}
        return state

    def restore_counters(self, data_state: dict[str, Any]) -> None:
        # A resume runs inside OnlineRun.__init__, before this class has made its pool or proxy: keep the totals
        # until they exist.
        super().restore_counters(data_state)
        self._saved_env_failures = dict(data_state.get("env_failures", {}))
        if hasattr(self, "limits"):
            self._apply_saved_failures(self._saved_env_failures)

    def _apply_saved_failures(self, saved: dict[str, int]) -> None:
        if self.agents:
            self._agent_totals = dict(saved)
        elif hasattr(self, "_env_totals"):
            self._env_totals.update(saved)

    def _run(self, stop: StopSignal) -> dict[str, Any]:
        # inside OnlineRun.run's StopSignal: a SIGTERM while the pools close lets the run finish
        failed = False
        try:
            return super()._run(stop)
        except BaseException:
            failed = True
            raise
        finally:
            closers: list[tuple[str, Callable[[], object]]] = []
            if self.env_pool is not None:
                closers.append(("environment pool", self.env_pool.close))
            if self.proxy is not None:
                closers.append(("agent proxy", self.proxy.stop))
            release(closers, failed)  # after a failure (its producer thread may be left behind): logged, not raised


_CLASSES: dict[type, type] = {}


def with_episodes(run_cls: type) -> type:
    """``run_cls`` (an ``OnlineRun`` subclass) with ``EpisodeSteps`` in front: its rollouts are episodes."""
    if run_cls not in _CLASSES:
        _CLASSES[run_cls] = type(f"Episode{run_cls.__name__}", (EpisodeSteps, run_cls), {})
    return _CLASSES[run_cls]


__all__ = ["EpisodeSteps", "rollout_window", "with_episodes"]
