"""The asynchronous-RL steps of an online run (``max_staleness`` K > 0), as a mixin of ``OnlineRun``: the checks of
the async settings, the rollout source (``polyrl.run.async_rollout``) with its producer, the decoupled objective's
switches, what a step records and publishes after its update, and the queue a checkpoint holds.

Data-parallel (under torchrun, docs/distributed.md): the ``inline`` and ``thread`` producers run on every rank, each
rank's rollout engine generating its share of the step's prompts (``ColocatedPolicy`` with a ``world``). The
producer's collectives (the gather of every rank's samples, rank 0's reward broadcast) run on a gloo group of their
own (``producer_group``, made once on every rank when the source is made, in the same order), through
``par.collectives_on``: with the ``thread`` producer they run in the background thread while the trainer's thread
runs FSDP's collectives on the default group, and two streams of collectives must never share one group. The
``thread`` producer's copy of the weights is the plain rollout copy, refreshed (an all-gather of the shards, on the
default group) in the trainer's thread at ``weights_updated`` once the producer is idle. After the gather every
rank holds every sample of a batch and the same rewards, so the queue a checkpoint holds is the same on every rank
(``queue_state`` checks this: a digest of each rank's queue is compared) and rank 0's copy resumes every rank. The
``process`` producer under torchrun: rank 0 alone owns the rollout worker processes (``rollout_devices``, which must
not be a rank's own accelerator: ``placement.check_torchrun_placement``); every rank runs ``collect`` as with the
other producers, but the generation is rank 0's workers' over every prompt, broadcast on the producer's group
(``ColocatedPolicy.remote_on_root``, ``par.generate_on_root``; an agentic run's episodes: ``root_episodes``), and
rank 0 scores it as it scores every batch, so every rank queues the same batch. The weights: at ``weights_updated``
every rank all-gathers its plain copy (the thread producer's sync, in the trainer's thread) and rank 0 then pushes
that copy to its workers (``ColocatedPolicy.push_source``). Worker deaths, restarts and load balancing are rank 0's
alone. ``partial_rollouts`` under torchrun, the ``thread`` producer: each rank's engine takes the update at its own step
boundary. A sharded trainer's update is all-gathered (trainer's thread, default
group, every rank in the same order, before the version is published) into a second plain copy of the weights
(``StagedWeights``; one more full copy per rank), which the producer thread copies into its engine's weights
locally (``LLM.swap_weights``), so the trainer's wait for its producer never depends on another rank's producer
(docs/async-rl.md, "Partial rollouts under torchrun"); a replicated (LoRA) model syncs locally as in one process.
``partial_rollouts`` with the ``process`` producer: ``worker_partial.WorkerPartialRollouts`` (the workers' engines
take an update between decode steps); under torchrun every rank's source is one, rank 0's with the workers (its
weights all-gathered into the plain copy on every rank in the trainer's thread, then pushed from it by rank 0, the
notice deferred to the batch that takes it), the other ranks' without (their ``produce`` takes rank 0's broadcast,
per-token versions included; their ``weights_updated`` is the gather alone). No staging copy is needed: rank 0's
plain copy is read by the push, the trainer's log-prob recompute and its engine only for a dead worker's share,
which runs under ``local_lock``, as the gather does. Agentic runs (``--env``, ``--agent``) take the inline and thread
producers under torchrun: the produce function is then the episode loop (or the agent runs through the rank's proxy)
on each rank's share of the prompts, its gather of the episodes on the producer's group (``polyrl.agents.train``);
and the process producer: rank 0's workers run every episode or agent run, broadcast with their failure counts
(``root_episodes``; the other ranks build no environment pool and start no agent proxy), with partial rollouts too
(rank 0's ``WorkerPartialRollouts`` sets the workers' ``job_partial`` around each batch, their episode loops or
proxy drivers take the update between engine steps, and the broadcast episodes carry their per-token versions).

Not here: the loop (``online``), the sources and the ``async/*`` metrics (``async_rollout``).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.lora import is_adapter_dir
from polyrl.platform import device
from polyrl.run.async_rollout import InlineRollouts, PartialRollouts, RolloutBatch, ThreadedRollouts
from polyrl.run.offline import tokenizer_path
from polyrl.run.placement import check_torchrun_placement, resolve_placement
from polyrl.run.weight_sync import InProcessSync, SyncStats
from polyrl.run.worker_partial import WorkerPartialRollouts
from polyrl.train import parallel as par

DEFAULT_ASYNC_IS_CAP = 2.0  # an async run's importance-weight cap when tis_cap is unset
# the collect metrics that are this rank's own clock (every other value of a queued batch is the same on every rank)
_RANK_CLOCKS = ("rollout_s", "rollout_tokens_per_s")


class AsyncSteps:
    """Mixin: needs the ``OnlineRun`` attributes (``cfg``, ``a``, ``world``, ``policy``, ``start``, ``steps``,
    ``collect``, ``print``)."""

    source: Any = None
    producer_group: Any = None  # data-parallel async runs: the producer's gloo group (see the module docstring)

    def _check_async(self) -> int:
        k = getattr(self.a, "max_staleness", 0)
        table = self.a.table_name()
        if (
            k > 0
            and self.a.async_producer == "process"
            and (
                getattr(self.a, "rollout_response_format", "")
                or (self.cfg.lora is None and is_adapter_dir(Path(self.cfg.model)))
            )
        ):
            raise ConfigError(
                'async_producer = "process" runs a model folder (or a LoRA run) in its workers: no structured '
                'rollouts yet; use async_producer = "thread"'
            )
        # validated (and the train device made current) before the model loads
        rollout, train = getattr(self.a, "rollout_devices", ""), getattr(self.a, "train_devices", "")
        if self.world.distributed:  # `--nproc-per-node` checked it before launching; plain torchrun, here
            check_torchrun_placement(rollout, train, table)
        self.placement = resolve_placement(rollout, train)
        self.placement.apply()
        # agentic runs (cfg.episodes): the producers they take are checked by their table (AgentConfig.check)
        return k

    def _make_source(self) -> InlineRollouts | None:
        self._note_resumed_queue()
        if self.max_staleness == 0:
            return None
        k, version = self.max_staleness, self.start
        self.producer_group = self.world.new_group()  # every rank, here, in the same order (None in one process)

        def produce(step: int, v: int) -> RolloutBatch:
            with par.collectives_on(self.producer_group):
                samples, rewards, m = self.collect(step)
                return RolloutBatch(step, v, samples, rewards, m, self.data.epochs, extra=self.batch_state())

        if self.a.async_producer == "process" and self.policy.device.type != "cpu" and self.placement.colocated:
            raise ConfigError(
                f'async_producer = "process" on an accelerator needs the rollout replicas\' devices: set '
                f"{self.a.table_name()}.rollout_devices (--rollout-devices {self.policy.device.type}:1)"
            )
        if self.a.async_producer == "process":  # every rank: rank 0's workers generate, the batch is broadcast
            self.policy.remote_on_root = self.world.distributed
            self.policy.release_idle_engine()  # the other ranks' engines never run: their KV cache freed now
        if self.a.async_producer == "process" and self.world.is_main:  # rollout engines in worker processes
            # lazy: worker processes and their process group exist only in runs that ask for them
            from polyrl.run.rollout_workers import RolloutWorkers

            devices = list(self.placement.rollout) or ["cpu"] * self.a.rollout_workers
            self.print(f"placement: {self.placement.describe()}")
            self.policy.remote = RolloutWorkers(
                self.cfg.model, tokenizer_path(self.cfg), self.rollout_config(), devices=devices,
                trainer_device=self.policy.device, dtype=next(self.policy.rollout_net.parameters()).dtype,
                wire_dtype=self.a.weight_sync_dtype, bucket_mb=self.a.weight_sync_bucket_mb, lora=self.cfg.lora,
                seed=self.cfg.seed, max_restarts=self.a.rollout_worker_restarts,
                reply_timeout_s=self.a.rollout_worker_timeout_s, balance=self.a.rollout_balance,
            )  # fmt: skip
            # version `start` (after a resume's load); with partial rollouts the workers stamp their tokens with it
            partial = version if getattr(self.a, "partial_rollouts", False) else None
            self.policy.remote.push_weights(self.policy.push_source, partial)
        if getattr(self.a, "partial_rollouts", False) and self.a.async_producer == "process":
            # the workers take updates between their engines' decode steps (polyrl.run.worker_partial); under
            # torchrun they are rank 0's, the other ranks' sources take its batches and gather the weights only
            remote, policy = self.policy.remote, self.policy

            def push(v: int, defer: bool) -> None:  # sharded: from the copy gathered on every rank just before
                policy.last_sync = remote.push_weights(policy.push_source, v, defer)

            source = WorkerPartialRollouts(
                produce, k, lambda: policy.sync_rollout_weights(remote=False), push if remote is not None else None,
                remote, policy.llm, version, self.a.partial_swap_step, gather_first=policy.sharded,
            )  # fmt: skip
        elif getattr(self.a, "partial_rollouts", False):  # the thread's engine takes updates between decode steps
            swap, sync, stage = self.a.partial_swap_step, self.policy.sync_rollout_weights, None
            if self.policy.sharded:  # data-parallel, FSDP2: gathered into a staging copy, loaded from it locally
                staged = StagedWeights(self.policy)
                sync, stage = staged.load, staged.gather
            source: InlineRollouts = PartialRollouts(produce, k, sync, self.policy.llm, version, swap, stage)
            self.policy.between_steps = source.between_steps
        elif self.a.async_producer in ("thread", "process"):
            source = ThreadedRollouts(produce, k, self.policy.sync_rollout_weights, version)
        else:
            source = InlineRollouts(produce, k, version)
        state = self._resumed_async
        if state is not None:
            source.load_state_dict(state)
        elif self.start > 0:
            self.print(f"note: {self.start_point} holds no rollout queue (a synchronous run's); generating afresh")
        return source

    def _note_resumed_queue(self) -> None:
        """A resumed checkpoint's rollout queue that this run's ``max_staleness`` will not train as it is: said once,
        before the first step. K = 0 (synchronous) drops every queued batch (their prompts stay consumed: the prompt
        position is past them); a lower K drops the batches older than K at their step (counted in
        ``async/stale_dropped_total``) and generates fresh ones."""
        queue = (self._resumed_async or {}).get("queue") or []
        if not queue:
            return
        k, table = self.max_staleness, self.a.table_name()
        if k == 0:
            self.print(
                f"note: {self.start_point} holds {len(queue)} rollout batch(es) generated ahead by an asynchronous "
                f"run; this run is synchronous ({table}.max_staleness = 0), so they are dropped and their prompts "
                "skipped (resume with the checkpoint's --max-staleness to train them)"
            )
            return
        stale = [int(b["step"]) + 1 for b in queue if int(b["step"]) - int(b["version"]) > k]
        if stale:
            self.print(
                f"note: {len(stale)} of the {len(queue)} rollout batch(es) queued in {self.start_point} (steps "
                f"{', '.join(map(str, stale))}) are older than {table}.max_staleness = {k}: they are dropped at their "
                "step and regenerated from the current weights (async/stale_dropped_total)"
            )

    def batch_state(self) -> Any:
        """What ``collect`` left for this step's ``rollout_row`` beyond the samples (an episode producer: the
        transcripts), JSON-ready: it travels with an async batch and is checkpointed with it. Called right after
        ``collect``, in the thread that ran it (the threaded producer's)."""
        return None

    def restore_batch_state(self, state: Any) -> None:
        """Put back ``batch_state()`` of the batch this step trains (async runs)."""

    @property
    def decoupled(self) -> bool:
        """The decoupled off-policy objective (async runs): the proximal policy (the trainer's recompute at the start
        of the step) anchors the clipped ratio; truncated ``pi_prox / pi_behaviour`` weights correct for the
        behaviour (rollout) policy's staleness."""
        return self.max_staleness > 0

    def is_cap(self) -> float | None:
        """The truncation cap of the importance weights: ``tis_cap``, else 2.0 in an async run."""
        cap = getattr(self.a, "tis_cap", None)
        return cap if cap is not None or not self.decoupled else DEFAULT_ASYNC_IS_CAP

    def publish(self, step: int, batch: RolloutBatch, t_train: float) -> dict[str, float]:
        """After step ``step``'s update: its ``async/*`` record (``_async_record``), then version ``step + 1`` handed
        to the source (the thread producer is joined and its weights synced, ``async/sync_s``, ``weight_sync/*``),
        then the rollout worker processes' counters."""
        rec = self._async_record(batch, t_train, time.perf_counter())
        self.source.weights_updated(step + 1)  # waits for the producer, syncs its weights (thread)
        rec["async/sync_s"] = self.source.sync_s
        if self.policy.last_sync is not None:  # run.weight_sync: weight_sync/seconds, /bytes, /gbps
            rec.update(self.policy.last_sync.metrics())
        if self.policy.remote is not None:
            rec["async/rollout_workers_alive"] = float(self.policy.remote.num_alive)
            rec["async/rollout_worker_failures_total"] = float(self.policy.remote.failures)
            rec["async/rollout_worker_restarts_total"] = float(self.policy.remote.restarts)
            rec.update(self.policy.remote.balance_metrics())  # replica_balance: shares and speeds
        return rec

    def queue_state(self) -> dict[str, Any]:
        """The source's queue for a checkpoint (``state_dict``: drains the thread). Data-parallel: every rank's queue
        must be the one rank 0 writes (they resume from it): a digest of each (its samples, rewards, versions and
        metrics but this rank's clocks) is gathered and compared, a CheckpointError if they differ."""
        state = self.source.state_dict()
        if self.world.distributed:
            digests = self.world.all_gather_object(_queue_digest(state))
            if len(set(digests)) > 1:
                raise CheckpointError(
                    "the ranks' rollout queues differ (every rank should hold every gathered sample and rank 0's "
                    f"rewards); digests {digests}"
                )
        return state

    def _async_record(self, batch: RolloutBatch, t_train: float, t_end: float) -> dict[str, float]:
        """Counters and the wall-clock intervals (seconds since the run started) of this batch's generation and
        of this step's training (prepare + update): with the threaded producer, the next batch's generation
        overlaps the training."""
        src, t = self.source, self.t_start
        partial = isinstance(src, PartialRollouts | WorkerPartialRollouts)
        extra = {"async/weight_swaps_total": float(src.swaps_total)} if partial else {}
        return {
            **extra,
            "async/stale_dropped_total": float(src.stale_dropped_total),
            "async/stale_dropped_samples_total": float(src.stale_dropped_samples),
            "async/wait_s": src.wait_s,
            "async/gen_start_s": batch.t_start - t,
            "async/gen_end_s": batch.t_end - t,
            "async/train_start_s": t_train - t,
            "async/train_end_s": t_end - t,
        }


class StagedWeights:
    """Partial rollouts under torchrun with an FSDP2-sharded trainer (``PartialRollouts``' ``stage`` and ``sync``):
    a second plain full copy of the weights (``staging``, in the rollout copy's dtype, on its device), which
    ``gather()`` fills with the all-gather of the shards (a collective of the default group: the trainer's thread,
    every rank, in the same order) and ``load()`` copies into the rollout engine's plain copy (``rollout_net``; no
    collective, so the producer thread may run it at an engine-step boundary). The rollout copy then holds exactly
    what the thread producer's all-gather writes into it without partial rollouts (the same gather and cast, then a
    plain copy). Costs one more full copy of the weights per rank (docs/async-rl.md, "Partial rollouts under
    torchrun"). Both calls return once the device is done (``gather`` before the version is published, ``load``
    before the producer goes on), so the two threads' streams never touch the staging copy at once."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        # a collective (one all-gather per tensor): made in _make_source, on every rank, in the trainer's thread
        self.staging = par.rollout_model(policy.model, policy.engine.compute_dtype).requires_grad_(False)
        self._copy = InProcessSync(self.staging, policy.rollout_net)  # by name: parameters and buffers
        tensors = {id(t): t for t in self.staging.state_dict(keep_vars=True).values()}.values()
        self._gathered = (sum(t.numel() * t.element_size() for t in tensors), len(tensors))

    @torch.no_grad()
    def gather(self) -> None:
        """The all-gather of the trained shards into the staging copy (``weight_sync/*``: its seconds and bytes)."""
        t0 = time.perf_counter()
        par.sync_rollout_weights(self.policy.model, self.staging)
        if next(self.staging.parameters()).device.type != "cpu":  # the gathers are queued: done before publishing
            device.synchronize()
        self.policy.last_sync = SyncStats(time.perf_counter() - t0, *self._gathered)

    def load(self) -> None:
        """The staging copy into the rollout engine's weights, in place (``LLM.swap_weights``' ``load``)."""
        self._copy.sync()


def _queue_digest(state: dict[str, Any]) -> str:
    """A digest of a source's ``state_dict`` without the values that are each rank's own: its clocks, and with
    partial rollouts its count of updates taken in flight (``swaps_total``: with ``partial_swap_step`` N a rank
    whose share ends before engine step N takes the update after its end, not in flight; rank 0's is written)."""
    queue = [{**b, "metrics": {k: v for k, v in b["metrics"].items() if k not in _RANK_CLOCKS}} for b in state["queue"]]
    blob = json.dumps({**{k: v for k, v in state.items() if k != "swaps_total"}, "queue": queue}, sort_keys=True,
                      default=str)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()


__all__ = ["DEFAULT_ASYNC_IS_CAP", "AsyncSteps", "StagedWeights"]
