"""The colocated policy: ONE ``DecoderLM`` that the training engine updates and the rollout engine samples from.
The building block of every online run (GRPO, GSPO, PPO, agentic RL) and of the public ``polyrl.trainer.Trainer``
(which adds model loading by path on top).

- ``ColocatedPolicy(model, tokenizer, ...)``: ``rollout(prompts, n, sampling, seeds, on_finish)`` -> ``Sample`` s
  (``on_finish(group, index, sample)``: each sample as soon as it finishes, for rewards scored meanwhile);
  ``logprobs(samples, temperature, model=None, entropy=False)`` (no-grad recompute, same packing as training);
  ``step(batches, loss_fn, normalizer)`` (one optimizer step; the prefix cache is reset afterwards);
  ``save`` / ``load`` (polyrl.train.checkpoint). The LLM holds the very module the engine trains: no copy, no
  weight sync. With ``release_kv`` the KV cache exists only while rolling out (``llm.reallocate()`` before,
  ``llm.release()`` after), which also gives every rollout the same fresh block state (reproducible batches).
  ``reference=True`` keeps a frozen copy of the initial weights (``ref_model``) for a KL penalty; for a LoRA model
  (``polyrl.models.lora``) the reference is the same model with its adapters off (no copy), and with
  ``lora_config.merge_for_rollout`` rollouts run with the adapters merged in place (unmerged afterwards).
  ``separate_rollout=True`` (async RL's threaded producer): the rollout engine gets a copy of the
  weights of its own, refreshed only by ``sync_rollout_weights()`` (so it can generate while the trainer updates);
  log-prob recomputes then run on the trained model itself (sharded: see below). ``between_steps`` (set by async
  RL's partial rollouts) is handed to the rollout engine's ``generate`` (and by an agentic run to its episode loop,
  which steps the same engine): a weight update can then land between two decode steps, and each ``Sample`` gets
  the engine's per-token ``token_versions``. The copy is ``run.weight_sync.InProcessSync``
  (adapters alone for a LoRA model); ``last_sync`` holds its ``SyncStats`` (the worker replicas' when ``remote``).
- Data-parallel (``world`` of ``polyrl.train.parallel``, under torchrun): the trained model is FSDP2-sharded, so the
  rollout engine runs a plain full copy in the compute dtype (``rollout_net``, refreshed in place after every
  optimizer step with one all-gather per tensor), each rank generates for its share of the prompts and every rank
  gets all samples back (``generate_data_parallel``). Log-prob recomputes run on that plain copy too (same weights
  and kernels as the FSDP forward, no collectives, so ranks may hold different numbers of micro-batches there).
  With ``separate_rollout`` (async RL's threaded producer under torchrun) that plain copy is NOT refreshed after
  every optimizer step (the producer thread may be generating on it) but only by ``sync_rollout_weights()``, which
  is then the all-gather (a collective on the default group: the run calls it in the trainer's thread, once the
  producer is idle, on every rank; with partial rollouts ``run.async_steps.StagedWeights`` gathers into a staging
  copy instead, loaded into this one at the producer's step boundary); log-prob recomputes still run on the copy,
  which the run has synced to the trained weights before any recompute of a step (``weights_updated`` precedes it),
  while the producer may read the same tensors (no-grad forwards only, no collective).
  With async RL's rollout worker processes under torchrun (``remote_on_root``, set on every rank) rank 0's workers
  (its ``remote``; the other ranks have none) generate every prompt and the outputs are broadcast
  (``par.generate_on_root``; the other ranks' engines never run, so they hold no KV cache: ``release_idle_engine``);
  ``sync_rollout_weights`` all-gathers the plain copy on every rank, then rank 0 pushes that copy to its workers
  (``push_source``).
  A replicated model (``replicate_model``: LoRA) stays colocated as in one process (rollout, reference and
  ``merge_for_rollout`` as above, on every rank's own identical replica); only generation is split over ranks.

Deliberately not here: the sample and batch types (``polyrl.algorithms.rl_batch``), rewards, advantages, losses,
the run loop (``polyrl.run.online``).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyrl.algorithms.rl_batch import RLBatch, Sample, completion_logprobs, pack_samples
from polyrl.data.chat import ChatTokenizer
from polyrl.data.formats import RowError
from polyrl.errors import UserError
from polyrl.infer.config import RolloutConfig
from polyrl.infer.llm import LLM
from polyrl.infer.sampling_params import SamplingParams
from polyrl.models.lora import AdapterDisabled, merged
from polyrl.models.moe import Routing, routing_scope
from polyrl.platform import device
from polyrl.run.weight_sync import InProcessSync, SyncStats
from polyrl.train import parallel as par
from polyrl.train.checkpoint import load_checkpoint, save_checkpoint
from polyrl.train.config import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig
from polyrl.train.engine import TrainEngine

# "auto" keeps the rollout KV cache (and its CUDA graphs) across steps when it takes at most this share of the
# device's memory: on the H200, keeping it saved 0.3 s of a 7.6 s GRPO step (no re-allocation, no re-capture).
KEEP_KV_FRACTION = 0.25


def keeps_kv_released(release_kv: bool | str, kv_bytes: int) -> bool:
    """Whether to free the KV cache while training: the setting, with "auto" resolved for this device."""
    if release_kv != "auto":
        return bool(release_kv)
    if device.device_type() == "cpu":
        return True
    _, total = device.mem_get_info()
    return kv_bytes > KEEP_KV_FRACTION * total


class ColocatedPolicy:
    """A trainable model and a rollout engine over the same parameter tensors (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        optim: OptimConfig | None = None,
        schedule: ScheduleConfig | None = None,
        precision: PrecisionConfig | None = None,
        engine: StepConfig | None = None,
        rollout: RolloutConfig | None = None,
        total_steps: int | None = None,
        release_kv: bool | str = "auto",
        reference: bool = False,
        world: par.World | None = None,
        separate_rollout: bool = False,
    ) -> None:
        if schedule is None and total_steps is None:
            schedule = ScheduleConfig(decay="constant")  # an open-ended Python session has no length
        self.model = model
        self._tokenizer = tokenizer
        self.world = world if world is not None and world.distributed else None

        self.sharded = self.world is not None and not par.is_replicated(model)
        if not self.sharded:  # one process, or a whole replica per rank: the rollout shares the trained tensors
            lora = getattr(model, "lora_config", None) is not None
            # before any update or hook: the initial weights (LoRA: the frozen base itself, adapters off, no copy)
            initial = copy.deepcopy(model) if reference and not lora else None
            self.engine = TrainEngine(model, optim, schedule, precision, engine, total_steps, world=self.world)
            # colocated: the very tensors the optimizer updates; separate_rollout (async RL's threaded producer): a
            # copy of its own, refreshed by sync_rollout_weights() only
            self.rollout_net = copy.deepcopy(model).requires_grad_(False) if separate_rollout else model
            self.ref_model: nn.Module | None = None
            if initial is not None:
                self.ref_model = initial.to(self.engine.compute_dtype).eval().requires_grad_(False)
            elif reference:
                self.ref_model = AdapterDisabled(model)
        else:
            self.engine = TrainEngine(model, optim, schedule, precision, engine, total_steps, world=self.world)
            dtype = self.engine.compute_dtype
            self.rollout_net = par.rollout_model(model, dtype).requires_grad_(False)
            self.ref_model = par.rollout_model(model, dtype).requires_grad_(False) if reference else None
        self.llm = LLM(self.rollout_net, tokenizer, rollout)  # built after the cast: KV cache in the compute dtype
        self.release_kv = keeps_kv_released(release_kv, self.llm.kv.total_bytes)
        if self.release_kv:
            self.llm.release()
        # sharded: rollout_net is a plain copy either way; separate_rollout makes it change in sync_rollout_weights only
        self.separate_rollout = separate_rollout
        self.remote: Any = None  # rollout worker processes (run.rollout_workers); this engine is their fallback
        # data-parallel with rollout worker processes (set on every rank): rank 0's workers generate every prompt
        # and the outputs are broadcast (par.generate_on_root); only rank 0 holds ``remote``
        self.remote_on_root = False
        self._copy_sync: InProcessSync | None = None
        self.last_sync: SyncStats | None = None  # the last sync_rollout_weights (run.weight_sync), None: none yet
        self.last_sync_local: SyncStats | None = None  # with worker replicas: the copy into this engine's weights
        self.device = self.engine.device
        self.micro_batch_tokens = (engine or StepConfig()).micro_batch_tokens  # the packing budget of RL batches
        # called by the rollout engine between decode steps (LLM.generate's between_steps; partial rollouts swap the
        # weights there, polyrl.run.async_rollout.PartialRollouts); this engine only (data-parallel: this rank's)
        self.between_steps: Callable[[LLM, int], None] | None = None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # ---- prompts ----------------------------------------------------------------------------------
    def encode(self, prompt: Any) -> list[int]:
        """Token ids of a prompt: ids, text, a message list or a ``PromptExample`` (chat template, with its tools)."""
        messages = getattr(prompt, "messages", None)
        if messages is None and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            messages = prompt
        if messages is not None:
            if self._tokenizer is None:
                raise UserError("chat prompts need a tokenizer; pass tokenizer= or give token ids")
            try:  # a PromptExample's tools go to the template, which must render them
                return ChatTokenizer(self._tokenizer).encode_prompt(messages, getattr(prompt, "tools", None))
            except RowError as exc:
                raise UserError(f"prompt: {exc}") from None
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise UserError("text prompts need a tokenizer; pass tokenizer= or give token ids")
            return list(self._tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    # ---- rollout ----------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(
        self,
        prompts: Sequence[Any],
        n: int = 1,
        sampling: SamplingParams | None = None,
        seeds: Sequence[int] | None = None,
        on_finish: Callable[[int, int, Sample], None] | None = None,
    ) -> list[Sample]:
        """``n`` completions of each prompt, grouped by prompt (``group`` = prompt index). ``seeds[i]`` seeds prompt
        i's samples (reproducible whatever else is in the batch); ``sampling.seed`` is used otherwise.

        ``on_finish(group, index, sample)`` gets each sample as soon as the engine finishes it (``LLM.generate``'s
        hook; the sample is ``samples[group * n + index]`` of the returned list, without its routing record): it
        must be cheap, e.g. hand the text to a reward stream. Data-parallel: this rank's own share only (the others'
        samples arrive with the gather); rollout worker processes: a worker's share when its whole reply arrives."""

        base = (sampling or SamplingParams()).clone(n=n)
        plist = [base.clone(seed=int(s)) for s in seeds] if seeds is not None else [base] * len(prompts)
        ids = [self.encode(p) for p in prompts]
        if self.idle_engine:  # rank 0's workers generate: this rank takes the broadcast, its engine and weights
            self.release_idle_engine()  # untouched (no KV cache beside training, no merge or mode change of a model)
            outs = par.generate_on_root(self.llm.generate, ids, plist, self.world)
            return [self._sample(out.prompt_token_ids, c, g) for g, out in enumerate(outs) for c in out.outputs]
        was_training = self.rollout_net.training
        self.rollout_net.eval()
        if not self.llm.kv.allocated:
            self.llm.reallocate()
        merge = self._merge_for_rollout()
        hook = None
        if on_finish is not None:

            def hook(g: int, j: int, c: Any) -> None:
                on_finish(g, j, self._sample(ids[g], c, g, routing=False))

        try:
            if self.world is not None and self.remote_on_root:
                gen = lambda p, sp, **kw: self.remote.generate(p, sp, self.llm.generate, **kw)  # noqa: E731 (rank 0)
                outs = par.generate_on_root(gen, ids, plist, self.world, on_finish=hook)
            elif self.world is not None:
                outs = par.generate_data_parallel(
                    self.llm, ids, plist, self.world, on_finish=hook, between_steps=self.between_steps
                )
            elif self.remote is not None:
                outs = self.remote.generate(ids, plist, self.llm.generate, on_finish=hook)
            else:
                outs = self.llm.generate(ids, plist, on_finish=hook, between_steps=self.between_steps)
        except BaseException:
            self.llm.abort_all()  # a failed generate leaves requests behind; the cache must still be freed
            raise
        finally:
            merge.__exit__(None, None, None)
            if self.release_kv:
                self.llm.release()
            self.rollout_net.train(was_training)
        return [self._sample(out.prompt_token_ids, c, g) for g, out in enumerate(outs) for c in out.outputs]

    def _sample(self, prompt_ids: Sequence[int], c: Any, group: int, routing: bool = True) -> Sample:
        """The ``Sample`` of completion output ``c`` of prompt ``group`` (with its routing record when asked)."""
        s = Sample(list(prompt_ids), list(c.token_ids), list(c.logprobs), c.finish_reason, c.text, group)
        s.index = c.index
        s.masked_logmass = getattr(c, "masked_logmass", None)
        versions = getattr(c, "token_versions", None)  # the engine tracks a policy version (partial rollouts)
        if versions is not None:
            s.token_versions = list(versions)
        if routing and getattr(c, "routed_experts", None) is not None:  # RolloutConfig.record_routing (MoE)
            s.routed_experts = c.routed_experts
            s.routing_layers = tuple(self.rollout_net.config.moe_layers)
        return s

    def _merge_for_rollout(self) -> Any:
        """Entered context: with ``lora.merge_for_rollout`` the adapters are merged into the base weights in place
        (the rollout runs plain linears; CUDA graphs captured now see the merged weights in the same storage) and
        unmerged when it exits; otherwise nothing (the rollout runs base + adapter, unmerged)."""

        cfg = getattr(self.rollout_net, "lora_config", None)
        ctx = contextlib.nullcontext()
        if cfg is not None and cfg.merge_for_rollout:
            ctx = merged(self.rollout_net)
        ctx.__enter__()
        return ctx

    # ---- log-probs and training -----------------------------------------------------------------
    @torch.no_grad()
    def logprobs(
        self,
        samples: Sequence[Sample],
        temperature: float = 1.0,
        model: nn.Module | None = None,
        entropy: bool = False,
        batches: Sequence[RLBatch] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sample: the completion tokens' log-probs (fp32 CPU ``[c]``) under ``model`` (default the policy) and,
        with ``entropy``, the entropies. Pass the training ``batches`` to recompute with the exact packing the loss
        will use (so an unchanged model gives a ratio of exactly 1). Data-parallel: the default model is the plain
        full copy (``rollout_net``, the model itself when replicated); samples in no given batch get None.
        Batches carrying a routing record (``RLBatch.routing_replay``, MoE) are recomputed with the rollout's experts
        forced when ``model`` is the policy (rollout-routing replay); another model (the reference) routes itself."""
        model = model or (self.model if self.separate_rollout and not self.sharded else self.rollout_net)
        policy = model is self.rollout_net or model is self.model
        was_training = model.training
        model.eval()
        batches = batches if batches is not None else pack_samples(samples, max_tokens=self.micro_batch_tokens)
        lps: list[torch.Tensor | None] = [None] * len(samples)
        ents: list[torch.Tensor | None] = [None] * len(samples)
        try:
            for b in batches:
                b = b.to(self.device)
                replay = b.routing_replay if policy else None
                scope = contextlib.nullcontext()
                if replay is not None:
                    scope = routing_scope(model, Routing(record=False, keep_logits=False, replay=replay))
                with scope:
                    lp, ent = completion_logprobs(model, b, temperature, entropy)
                for j, v in zip(b.sample_ids, b.per_sample(lp)):
                    lps[j] = v.cpu()
                if ent is not None:
                    for j, v in zip(b.sample_ids, b.per_sample(ent)):
                        ents[j] = v.cpu()
        finally:
            model.train(was_training)
        return lps, (ents if entropy else None)  # type: ignore[return-value]

    def step(
        self, batches: Sequence[RLBatch], loss_fn: Callable[[nn.Module, Any], Any], normalizer: float | None = None
    ) -> Any:
        """One optimizer step (``TrainEngine.step``); the rollout engine's prefix cache is reset afterwards."""
        stats = self.engine.step(list(batches), loss_fn, normalizer)
        if self.sharded and not self.separate_rollout:
            par.sync_rollout_weights(self.model, self.rollout_net)
        if not self.separate_rollout:  # a separate copy (maybe generating now) changes in sync_rollout_weights only
            self.llm.reset_prefix_cache()
        return stats

    @property
    def idle_engine(self) -> bool:
        """True on a rank other than 0 with ``remote_on_root``: rank 0's rollout workers generate every prompt and
        this rank only receives the outputs, so its own engine never runs (rank 0's is a dead worker's fallback). A
        replicated (LoRA) run builds such a rank's policy without a separate rollout copy (``OnlineRun``: its engine
        sits on the trained tensors, which ``rollout`` then never touches)."""
        return self.remote_on_root and self.world is not None and not self.world.is_main

    def release_idle_engine(self) -> None:
        """Free the KV cache of an ``idle_engine`` (allocated when the engine was built, kept with ``release_kv``
        off); nothing elsewhere."""
        if self.idle_engine and self.llm.kv.allocated:
            self.llm.release()

    @property
    def push_source(self) -> nn.Module:
        """The module whose tensors ``remote.push_weights`` sends to the rollout worker processes: the trained model,
        or when it is FSDP2-sharded its plain full copy (``rollout_net``, which ``sync_rollout_weights`` all-gathers
        on every rank first), so the push reads whole tensors and runs no collective of the default group."""
        return self.rollout_net if self.sharded else self.model

    @torch.no_grad()
    def sync_rollout_weights(self, remote: bool = True) -> None:
        """Copy the trained weights into a separate rollout copy (``separate_rollout``; the rollout engine must be
        idle) and reset its prefix cache; nothing to do when the rollout shares the trained tensors. Sharded
        (``separate_rollout`` under torchrun): the all-gather of the shards into the plain copy, a collective that
        every rank calls in the same thread as its FSDP steps. With rollout worker processes (``remote``) their
        weights are pushed too, unless ``remote`` is False (partial rollouts push them on their own:
        ``run.worker_partial``); sharded, rank 0 pushes them from the gathered copy (``push_source``) after the
        gather (every rank's collective), the other ranks having no workers."""
        if self.separate_rollout and self.sharded:
            t0 = time.perf_counter()
            par.sync_rollout_weights(self.model, self.rollout_net)
            moved = list({id(t): t for t in self.rollout_net.state_dict(keep_vars=True).values()}.values())
            if moved and moved[0].device.type != "cpu":  # the gathers and copies are queued: time them done
                device.synchronize()
            nbytes = sum(t.numel() * t.element_size() for t in moved)
            self.last_sync = SyncStats(time.perf_counter() - t0, nbytes, len(moved))
            self.llm.reset_prefix_cache()
            if self.remote is not None:  # rank 0's worker replicas: pushed from the gathered copy
                self.last_sync_local = self.last_sync
                if remote:
                    self.last_sync = self.remote.push_weights(self.push_source)
        elif self.separate_rollout:
            if self._copy_sync is None:  # a LoRA model's base is frozen: its adapters alone (run.weight_sync)
                lora = getattr(self.model, "lora_config", None) is not None
                self._copy_sync = InProcessSync(self.model, self.rollout_net, lora_only=lora)
            stats = self._copy_sync.sync()
            self.llm.reset_prefix_cache()
            if self.remote is None:
                self.last_sync = stats
            else:  # the worker replicas' sync is the step's weight_sync/*, this copy's aside
                self.last_sync_local = stats
                if remote:
                    self.last_sync = self.remote.push_weights(self.model)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(
        self, root: str | Path, step: int, data_state: dict | None = None, config: dict[str, Any] | None = None
    ) -> Path:
        """Atomic checkpoint ``<root>/step-%08d`` (weights, optimizer, RNG, counters, ``data_state``); when
        data-parallel sharded (every rank writes its shards) or replicated (rank 0 writes, every rank its RNG), a
        collective."""

        if self.world is not None:
            return par.save_distributed_checkpoint(
                root, step, self.model, self.engine, self.world, data_state=data_state, config=config,
                tokenizer=self._tokenizer,
            )  # fmt: skip
        return save_checkpoint(
            root, step, self.model, self.engine, data_state=data_state, config=config, tokenizer=self._tokenizer
        )

    def load(self, path: str | Path) -> Any:
        """Restore a checkpoint in place (parameter tensors keep their identity); returns ``LoadedCheckpoint``.
        One-process and sharded checkpoints load at any world size."""

        if self.world is not None or par.is_sharded_checkpoint(path):
            loaded = par.load_any_checkpoint(path, self.model, self.engine, self.world)
            if self.sharded and not self.separate_rollout:  # separate: sync_rollout_weights below does it
                par.sync_rollout_weights(self.model, self.rollout_net)
        else:
            loaded = load_checkpoint(path, self.model, self.engine)
        self.sync_rollout_weights()
        self.llm.reset_prefix_cache()
        return loaded


__all__ = ["KEEP_KV_FRACTION", "ColocatedPolicy", "keeps_kv_released"]
