"""Asynchronous RL: rollouts generated ahead of the trainer with a bound on their staleness (``max_staleness`` K of
the ``[grpo]`` / ``[gspo]`` / ``[ppo]`` table, ``polyrl train --max-staleness K``).

Policy versions: version v = the weights after v RL steps' updates. A batch for RL step s generated with version
v is trained at version s; its staleness is ``s - v``. Every ``Sample`` records ``policy_version``: the version that
generated it, or with partial rollouts the OLDEST version among its tokens (``token_versions``: one per token).

- ``RolloutSource``: what the loop asks for, ``submit(step)`` (start producing step ``step``'s batch with the
  weights the rollout engine holds now), ``get(step)`` (the finished batch; produced now if never submitted; a batch
  older than K versions is DROPPED and replaced by a fresh batch of the next prompts from the current weights:
  counted in ``stale_dropped_total`` / ``stale_dropped_samples``), ``weights_updated(version)``
  (the trainer has published version ``version``: wait for in-flight generation, then sync the rollout weights),
  ``state_dict`` / ``load_state_dict`` (the queue, for exact resume) and ``close``. A later multi-placement
  source (rollout engines on other GPUs, weights over NCCL) implements the same five methods.
- ``InlineRollouts``: the producer runs in the trainer's thread on the colocated (shared) weights: ``submit(s+K)``
  at step s generates right away with version s. Same samples as the threaded source, no overlap.
- ``ThreadedRollouts``: a background thread generates on a separate copy of the weights (``ColocatedPolicy(...,
  separate_rollout=True)``); ``weights_updated`` joins it and copies the trainer's weights in. Generation of step
  s+K overlaps training of step s. Same samples, bit for bit, as ``InlineRollouts`` (same versions, same seeds).
  Agentic runs too: the produce function is then the episode loop (``polyrl.agents.train``: multi-turn episodes on
  the copy's engine, the environment workers or the agent proxy driven from this thread); the engine and the
  environment pool have one user at a time, since ``weights_updated`` drains the thread before the trainer's
  evaluation or checkpoint touches them, and a batch produced on demand (``get`` of a step never submitted, or a
  stale one replaced) also runs in this thread, after those in flight.
  With ``async_producer = "process"`` the same thread drives rollout worker processes (``rollout_workers``: the
  policy's ``remote``; weights pushed over gloo by ``sync``), falling back to the trainer's engine for a dead one
  until it is restarted (it rejoins at a ``sync``, with those weights) or, past ``rollout_worker_restarts``, for good.
  In an agentic run of an environment (``--env``) the workers run the episodes themselves (``polyrl.agents.remote``:
  the episode loop on each worker's engine, an environment pool per worker), the thread building the batch.
- ``PartialRollouts`` (``partial_rollouts = true``, ``--partial-rollouts``; the thread producer: inline has nothing
  in flight during an update (refused with a ConfigError), and the process producer has its own source with the same
  semantics per worker, ``polyrl.run.worker_partial.WorkerPartialRollouts``, whose workers' engines take an update
  between their decode steps): ``weights_updated`` does NOT wait for the generation in flight nor
  throw it away. The producer's engine is paused at a decode-step boundary (``LLM.generate``'s ``between_steps``,
  set on the policy; in an agentic run the episode loop of ``polyrl.agents.rollout`` calls the same hook between
  its engine steps, so an update lands while episodes are in flight and one turn may span two versions: each
  ``Episode`` records per-token versions, its Sample's ``token_versions``; for agent programs through the proxy,
  whose engine driver thread steps the engine, ``thread_hook`` hands that thread the hook bound to the producer
  thread's batch), the step launched ahead is read, the trainer's weights are copied in (``LLM.swap_weights``;
  the trainer waits only for that copy), and the same sequences continue on the new weights. Their KV cache is
  kept: the keys and values of their earlier tokens were computed by the older weights (as in AReaL's partial
  rollouts; a later token's log-prob is the new weights' over that mixed cache, not a plain forward of either).
  The engine stamps every generated token with its ``policy_version`` (``Sample.token_versions``), and its
  behaviour log-prob is the one already recorded per token (``Sample.logprobs``), so the decoupled objective's
  per-token importance weights ``pi_prox / pi_behav`` use each token's own behaviour version unchanged. The
  staleness bound is per token: a batch's ``version`` is its oldest token's, so a batch holding any token older
  than K versions is dropped whole (its groups stay whole for group-relative advantages) and regenerated, counted
  as above. Where the update lands (``partial_swap_step``): 0 = at the first decode-step boundary after it is
  published (most overlap; the split depends on timing, so two runs differ); N > 0 = reproducible: a batch
  submitted at version v starts on the weights the engine holds (v, or v + 1 when an earlier batch took it already)
  and takes v + 1 at its engine step N, the producer waiting there for it if the trainer has not published it yet
  (a batch shorter than N takes it after its end); an update no submitted batch takes is synced once the producer
  is idle, as without partial rollouts.
  ``async/weight_swaps_total`` counts the updates a generation in flight took. Since ``weights_updated`` does not
  wait for the batches in flight, the loop ``drain``s them before an evaluation (one user of the rollout engine and
  of an agentic run's environment pool at a time).

The loop (``OnlineRun.step``): ``get(s)``; ``submit(s+1 .. s+K)`` (those not yet submitted, below the run's last
step); prepare + update; ``weights_updated(s+1)``. With K = 0 the loop does not use a source at all (today's
synchronous code path, bit for bit).

Exact resume: the queue is CHECKPOINTED (``state_dict``: the finished batches' samples, rewards, metrics and
versions, in the checkpoint's ``trainer_state.json``): the weights that produced them are gone, so they cannot be
regenerated; the prompt stream position saved next to them is already past them. A batch keeps the run's
``batch_state()`` as ``extra`` (JSON: an agentic batch's episode transcripts, so the ``rollouts.jsonl`` rows of the
queued steps after a resume are the uninterrupted run's). The threaded producers drain
first (with partial rollouts the batches in flight finish on the newest weights); each sample carries its
``token_versions``. With ``partial_swap_step`` N > 0 the resumed run equals the uninterrupted one bit for bit; with
0 the queue is restored exactly but where later updates land depends on timing in both runs.

Under torchrun (``InlineRollouts``, ``ThreadedRollouts`` and ``PartialRollouts``) these classes are the same on every
rank: the run's produce function does the data-parallel rollout, its collectives on a gloo group of the producer's
own, and the sync callback all-gathers the sharded weights (``polyrl.run.async_steps``); every rank makes the same
calls in the same order, so the queues agree. ``PartialRollouts`` there splits the sync in two (``stage``: the
all-gather into a staging copy, in the trainer's thread before the version is published; ``sync``: the local copy
into the engine, at the producer's step boundary), so a rank's trainer never waits for a point of its producer that
depends on another rank (see the class docstring and docs/async-rl.md, "Partial rollouts under torchrun"). The
process producer's partial rollouts under torchrun: ``worker_partial.WorkerPartialRollouts`` on every rank (rank 0's
with its workers).

``staleness_metrics``: the ``async/*`` metrics of a trained batch (staleness histogram, per-lag token counts, per
token with partial rollouts, importance-weight statistics of the decoupled objective; data-parallel: over every
rank's share). Not here: the loss
(``polyrl.algorithms.losses``), the loop (``online``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from polyrl.algorithms.rl_batch import Sample
from polyrl.errors import CheckpointError
from polyrl.run.producer_thread import ProducerThread


@dataclass
class RolloutBatch:
    """The rollouts of one RL step: samples (each with ``policy_version``), rewards, the collect metrics, the
    prompt stream's epoch count after them, the version that generated them and the wall-clock interval
    (``time.perf_counter``) of the generation."""

    step: int
    version: int
    samples: list[Sample]
    rewards: list[float]
    metrics: dict[str, float]
    epochs: float
    t_start: float = 0.0
    t_end: float = 0.0
    # the run's batch_state(): JSON-ready data its rollout_row needs beyond the samples (an agentic batch's episode
    # transcripts for rollouts.jsonl); checkpointed with the batch, None for single-turn runs
    extra: Any = None

    def to_state(self) -> dict[str, Any]:
        state = {
            "step": self.step,
            "version": self.version,
            "samples": [dataclasses.asdict(s) for s in self.samples],
            "rewards": list(self.rewards),
            "metrics": dict(self.metrics),
            "epochs": self.epochs,
        }
        if self.extra is not None:
            state["extra"] = self.extra
        return state

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> RolloutBatch:
        return cls(
            int(d["step"]), int(d["version"]), [Sample(**s) for s in d["samples"]], [float(r) for r in d["rewards"]],
            dict(d["metrics"]), float(d["epochs"]), extra=d.get("extra"),
        )  # fmt: skip


# produce(step, version) -> the batch of RL step ``step`` generated with the rollout weights of ``version``
Producer = Callable[[int, int], RolloutBatch]


class RolloutSource(Protocol):
    """Where the loop's rollouts come from (see the module docstring)."""

    def submit(self, step: int) -> None: ...

    def get(self, step: int) -> RolloutBatch: ...

    def weights_updated(self, version: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self, abandon: bool = False) -> None: ...


class InlineRollouts:
    """The in-process source over colocated weights: ``submit`` generates at once with the current version."""

    def __init__(self, produce: Producer, max_staleness: int, version: int = 0) -> None:
        self.produce, self.max_staleness, self.version = produce, max_staleness, version
        self._done: dict[int, RolloutBatch] = {}
        self.stale_dropped_total = 0  # batches older than max_staleness versions, dropped and replaced
        self.stale_dropped_samples = 0
        self.submitted: set[int] = set()
        self.wait_s = 0.0  # the last get's wait for its batch (inline: the whole generation, when not ahead)
        self.sync_s = 0.0  # the last weight sync

    def _stamp(self, batch: RolloutBatch) -> RolloutBatch:
        for s in batch.samples:
            s.policy_version = batch.version
        return batch

    def _produce_now(self, step: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = self.produce(step, self.version)
        batch.t_start, batch.t_end = t0, time.perf_counter()
        return self._stamp(batch)

    def submit(self, step: int) -> None:
        if step in self.submitted:
            return
        self.submitted.add(step)
        self._done[step] = self._produce_now(step)

    def _take(self, step: int) -> RolloutBatch | None:
        return self._done.pop(step, None)

    def get(self, step: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = self._take(step)
        self.submitted.discard(step)
        if batch is None:
            batch = self._produce_now(step)
        elif step - batch.version > self.max_staleness:
            # too old to train on: dropped (its prompts stay consumed) and replaced by a fresh batch of the next
            # prompts, generated now with the current weights (the rollout engine is idle here: the last
            # ``weights_updated`` waited for it)
            self.stale_dropped_total += 1
            self.stale_dropped_samples += len(batch.samples)
            batch = self._produce_now(step)
        self.wait_s = time.perf_counter() - t0
        return batch

    def weights_updated(self, version: int) -> None:
        self.version = version

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "stale_dropped": [self.stale_dropped_total, self.stale_dropped_samples],
            "queue": [self._done[k].to_state() for k in sorted(self._done)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["version"]) != self.version:
            raise CheckpointError(
                f"the checkpoint's rollout queue is at policy version {state['version']}, the weights at {self.version}"
            )
        self.stale_dropped_total, self.stale_dropped_samples = (int(x) for x in state["stale_dropped"])
        self._done = {int(d["step"]): RolloutBatch.from_state(d) for d in state["queue"]}
        self.submitted = set(self._done)

    def close(self, abandon: bool = False) -> None:
        """Drop the queue. ``abandon``: the run failed under torchrun, so a batch in flight may wait for other ranks
        that will not come; the producer thread is not waited for (the threaded sources)."""
        self._done.clear()


class ThreadedRollouts(InlineRollouts):
    """A background producer thread on a separate copy of the weights; ``sync()`` copies the trainer's weights into
    it (called by ``weights_updated`` once the thread is idle)."""

    def __init__(self, produce: Producer, max_staleness: int, sync: Callable[[], None], version: int = 0) -> None:
        super().__init__(produce, max_staleness, version)
        self.sync = sync
        self._pool = ProducerThread("polyrl-rollout")
        self._futures: dict[int, Future[RolloutBatch]] = {}
        self._lock = threading.Lock()

    def submit(self, step: int) -> None:
        if step in self.submitted:
            return
        self.submitted.add(step)
        # the version the rollout weights hold now (synced only while the thread is idle)
        self._futures[step] = self._pool.submit(self._timed, step, self.version)

    def _timed(self, step: int, version: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = self.produce(step, version)
        batch.t_start, batch.t_end = t0, time.perf_counter()
        return self._stamp(batch)

    def _produce_now(self, step: int) -> RolloutBatch:
        # in the producer thread, after the batches submitted before it: one thread on the rollout engine (and, in an
        # agentic run, on the environment pool) at a time, whatever is still in flight (K >= 2)
        return self._pool.submit(self._timed, step, self.version).result()

    def _take(self, step: int) -> RolloutBatch | None:
        fut = self._futures.pop(step, None)
        if fut is not None:
            return fut.result()  # re-raises a failure of the producer
        return super()._take(step)

    def drain(self) -> None:
        """Wait for every submitted batch (the rollout engine is idle afterwards)."""
        for step in sorted(self._futures):
            self._done[step] = self._futures.pop(step).result()

    def weights_updated(self, version: int) -> None:
        t0 = time.perf_counter()
        self.drain()
        self.sync()
        self.sync_s = time.perf_counter() - t0
        self.version = version

    def state_dict(self) -> dict[str, Any]:
        self.drain()
        return super().state_dict()

    def close(self, abandon: bool = False) -> None:
        for fut in self._futures.values():
            fut.cancel()
        # abandoned: a batch in flight may wait on another rank (its gather, or an update whose all-gather needs
        # this rank); the thread is a daemon, so it does not hold the failing process's exit either
        self._pool.shutdown(wait=not abandon, cancel_futures=True)
        self._futures.clear()
        super().close(abandon)


class SwapCount:
    """The ``swaps_total`` counter of a partial-rollout source (``async/weight_swaps_total``), kept in its checkpointed
    state next to the queue (mixed in before ``ThreadedRollouts``, whose ``state_dict`` drains first: the batches in
    flight finish, on the newest weights)."""

    swaps_total: int = 0

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        state["swaps_total"] = self.swaps_total
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # type: ignore[misc]
        self.swaps_total = int(state.get("swaps_total", 0))


class PartialRollouts(SwapCount, ThreadedRollouts):
    """The threaded producer with partial rollouts (see the module docstring): ``weights_updated`` does not wait for
    the generation in flight; the producer's engine takes the new weights at a decode-step boundary
    (``LLM.swap_weights``, called from ``between_steps``, which the policy hands to its engine's ``generate``) and
    the same sequences go on. ``engine``: the rollout ``LLM`` (its ``policy_version`` is stamped on every token).
    ``swap_step`` 0: at the first boundary after the update; N > 0: at engine step N of the batch it belongs to
    (reproducible).

    ``stage`` (data-parallel, a sharded trainer): ``sync`` cannot be the all-gather of the shards, a collective of
    the default group that the trainer's thread must make on every rank in the same order, while the engine takes
    the update in the producer thread at a boundary that may come late (after this rank's producer has gathered a
    batch's samples with the other ranks'). So ``weights_updated`` first calls ``stage()`` in the trainer's thread
    (the all-gather into a staging copy that the engine does not read), then publishes the version; ``sync`` is the
    local copy from the staging copy into the engine's weights, run by whichever thread applies the update. Nobody
    reads the staging copy while ``stage`` writes it: the engine already holds the previous version then (every
    ``weights_updated`` returns with the engine at its version), and only an engine behind the published version
    copies from it."""

    def __init__(
        self,
        produce: Producer,
        max_staleness: int,
        sync: Callable[[], None],
        engine: Any,
        version: int = 0,
        swap_step: int = 0,
        stage: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(produce, max_staleness, sync, version)
        self.engine, self.swap_step, self.stage = engine, swap_step, stage
        engine.policy_version = version
        self._cv = threading.Condition()
        self._published = version  # the trainer's newest version (the engine's lags it only inside weights_updated)
        self._busy = False  # the producer thread is inside a batch
        self._open: dict[int, int | None] = {}  # submitted, unfinished batches -> the version they take (swap_step)
        self._local = threading.local()  # the producer thread's batch: its step and the version it takes
        self._closed = False
        self.swaps_total = 0  # updates taken by a generation in flight (the rest were synced while it was idle)

    # ---- the producer thread --------------------------------------------------------------------
    def _work(self, step: int, version: int, takes: int | None) -> RolloutBatch:
        with self._cv:
            self._busy = True
            if not self.swap_step and self.engine.policy_version < self._published:  # idle engine: take it now
                self._apply(self._published, in_flight=False)
        self._local.takes = takes
        try:
            t0 = time.perf_counter()
            batch = self.produce(step, version)
            if self.swap_step and takes is not None and self.engine.policy_version < takes:
                self._await_update(takes, in_flight=False)  # shorter than swap_step: takes the update after its end
            batch.t_start, batch.t_end = t0, time.perf_counter()
            return self._stamp(batch)
        finally:
            self._local.takes = None
            with self._cv:
                self._busy = False
                self._open.pop(step, None)
                self._cv.notify_all()

    def between_steps(self, llm: Any, steps: int) -> None:
        """The rollout engine's step-boundary hook (``LLM.generate``'s ``between_steps``): take a published update
        (``swap_step`` 0), or wait for this batch's update at engine step ``swap_step``. A no-op outside the producer
        thread (an evaluation in the trainer's thread)."""
        if getattr(self._local, "active", False):
            self._boundary(steps, self._local.takes)

    def thread_hook(self) -> Callable[[Any, int], None] | None:
        """``between_steps`` bound to the calling thread's batch, for another thread that steps the engine for it
        (an agentic run's proxy: its engine driver thread serves the agents of the producer thread's batch): the
        returned ``hook(llm, steps)`` takes that batch's update (the version it takes, read now) from whichever
        thread calls it between two engine steps. None outside the producer thread (an evaluation in the trainer's
        thread: no update lands in it)."""
        if not getattr(self._local, "active", False):
            return None
        takes = self._local.takes
        return lambda llm, steps: self._boundary(steps, takes)

    def _boundary(self, steps: int, takes: int | None) -> None:
        """An engine-step boundary of a batch that takes ``takes`` (reproducible mode; None: none)."""
        if self.swap_step:
            if steps == self.swap_step and takes is not None and self.engine.policy_version < takes:
                self._await_update(takes, in_flight=True)
        elif self.engine.policy_version < self._published:  # unlocked peek; checked again under the lock
            with self._cv:
                if self.engine.policy_version < self._published:
                    self._apply(self._published, in_flight=True)

    def _await_update(self, version: int, in_flight: bool) -> None:
        """Wait for the trainer to publish ``version`` (reproducible mode), then load it."""
        with self._cv:
            while self._published < version and not self._closed:
                self._cv.wait()
            if not self._closed and self.engine.policy_version < version:
                self._apply(version, in_flight)

    def _apply(self, version: int, in_flight: bool) -> None:
        """Load the trainer's weights (``version``) into the rollout engine; the caller holds the lock and the
        trainer waits in ``weights_updated`` (its weights do not move meanwhile)."""
        self.engine.swap_weights(self.sync, version)
        self.swaps_total += int(in_flight)
        self._cv.notify_all()

    # ---- the trainer's side -----------------------------------------------------------------------
    def submit(self, step: int) -> None:
        if step in self.submitted:
            return
        self.submitted.add(step)
        version = self.version
        takes = version + 1 if self.swap_step else None  # reproducible: this batch takes the next update
        with self._cv:
            self._open[step] = takes
        self._futures[step] = self._pool.submit(self._run, step, version, takes)

    def _run(self, step: int, version: int, takes: int | None) -> RolloutBatch:
        self._local.active = True
        return self._work(step, version, takes)

    def _produce_now(self, step: int) -> RolloutBatch:
        # in the producer thread too (never two threads on one engine); takes no update (the trainer waits for it)
        with self._cv:
            self._open[step] = None
        return self._pool.submit(self._run, step, self.version, None).result()

    def _stamp(self, batch: RolloutBatch) -> RolloutBatch:
        """Each sample's ``policy_version`` = its oldest token's; the batch's = its oldest sample's (the staleness
        bound of ``get`` applies to it, so to every token)."""
        for s in batch.samples:
            tv = s.token_versions
            s.policy_version = min(tv) if tv else batch.version
        batch.version = min((s.policy_version for s in batch.samples), default=batch.version)
        return batch

    def weights_updated(self, version: int) -> None:
        t0 = time.perf_counter()
        if self.stage is not None:  # data-parallel: the collective, here in the trainer's thread, before publishing
            self.stage()
        with self._cv:
            self._published = version
            self._cv.notify_all()
            if self.swap_step:  # the batch that takes it does so at its step swap_step (or at its end)
                while self.engine.policy_version < version and version in self._open.values():
                    self._cv.wait()
            else:  # the generation in flight takes it at its next decode step; an idle producer cannot start
                while self.engine.policy_version < version and self._busy:
                    self._cv.wait()
                if self.engine.policy_version < version:
                    self._apply(version, in_flight=False)
        if self.engine.policy_version < version:  # reproducible mode, no batch takes it: as without partial rollouts
            self.drain()
            with self._cv:
                self._apply(version, in_flight=False)
        self.sync_s = time.perf_counter() - t0
        self.version = version

    def close(self, abandon: bool = False) -> None:
        with self._cv:
            self._closed = True  # a producer waiting for an update that will not come goes on
            self._cv.notify_all()
        super().close(abandon)


def staleness_metrics(
    step: int,
    samples: Sequence[Sample],
    mine: Sequence[int],
    behaviour: Sequence[torch.Tensor] | None = None,
    proximal: Sequence[torch.Tensor | None] | None = None,
    cap: float | None = None,
    gather: Callable[[Any], list[Any]] | None = None,
) -> dict[str, float]:
    """The ``async/*`` metrics of step ``step``'s trained samples ``mine``: staleness (in versions) mean over tokens
    and max, tokens per staleness lag (``async/tokens_lag{k}``: the tokens generated by policy version ``step - k``,
    so the per-version token counts; per token with partial rollouts, plus ``async/mixed_version_samples``) and,
    given the behaviour (rollout) and proximal (recomputed) log-probs, the importance weights ``pi_prox / pi_behav``
    before truncation: mean, max, and the fraction of tokens the cap truncates. Data-parallel: ``mine`` is this
    rank's share and ``gather`` (``World.all_gather_object``) brings every rank's counts, so the metrics cover the
    whole step on every rank."""
    lags: dict[int, int] = {}
    mixed, partial = 0, False
    for i in mine:
        s = samples[i]
        if s.token_versions is not None:  # partial rollouts: each token's own version
            partial = True
            keep = s.mask if s.mask is not None else [1] * len(s.token_versions)
            versions = [v for v, m in zip(s.token_versions, keep) if m]
            for v in versions:
                lags[step - v] = lags.get(step - v, 0) + 1
            mixed += int(len(set(versions)) > 1)
            continue
        lag = step - (s.policy_version if s.policy_version is not None else step)
        lags[lag] = lags.get(lag, 0) + s.num_policy_tokens
    weights = None  # (sum, count, max, min, truncated count) of this rank's importance weights
    if behaviour is not None and proximal is not None:
        ws = [torch.exp(proximal[i] - behaviour[i]) for i in mine if proximal[i] is not None]
        w = torch.cat(ws) if ws else torch.zeros(0)
        if w.numel():
            trunc = int((w > cap).sum()) if cap is not None else 0
            weights = (float(w.double().sum()), int(w.numel()), float(w.max()), float(w.min()), trunc)
    local = (lags, mixed, partial, weights)
    parts = gather(local) if gather is not None else [local]
    lags = {}
    for part_lags, _, _, _ in parts:
        for k, n in part_lags.items():
            lags[k] = lags.get(k, 0) + n
    tokens = sum(lags.values())
    out: dict[str, float] = {
        "async/staleness_mean": sum(k * n for k, n in lags.items()) / max(tokens, 1),
        "async/staleness_max": float(max(lags, default=0)),
    }
    if any(p[2] for p in parts):  # samples whose tokens came from more than one policy version (mid-sequence update)
        out["async/mixed_version_samples"] = float(sum(p[1] for p in parts))
    for k in sorted(lags):
        out[f"async/tokens_lag{k}"] = float(lags[k])
    ws_all = [p[3] for p in parts if p[3] is not None]
    if ws_all:
        n = sum(x[1] for x in ws_all)
        out["async/is_weight_mean"] = sum(x[0] for x in ws_all) / n
        out["async/is_weight_max"] = max(x[2] for x in ws_all)
        out["async/is_weight_min"] = min(x[3] for x in ws_all)
        if cap is not None:
            out["async/is_truncated_fraction"] = sum(x[4] for x in ws_all) / n
    return out


__all__ = [
    "InlineRollouts",
    "PartialRollouts",
    "Producer",
    "RolloutBatch",
    "RolloutSource",
    "SwapCount",
    "ThreadedRollouts",
    "staleness_metrics",
]
