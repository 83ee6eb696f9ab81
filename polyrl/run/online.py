"""The online RL run loop (``polyrl train --algo grpo|gspo``; PPO's ``actor_critic`` extends it), over a colocated
policy.

One RL step, each stage a method of ``OnlineRun`` so an algorithm can override one without copying the rest:

1. ``collect(step)``: the next ``prompts_per_step`` prompts (``PromptStream``, ``prompt_order.py``: seeded, resumable)
   -> ``samples_per_prompt`` completions each from the rollout engine, sampling seeded from ``(seed, step, prompt)``
   so a resumed run draws the same tokens -> rewards from the ``RewardPool`` (isolated workers, timeouts), each
   sample handed to it as soon as the engine finishes it (``RewardStream``; ``stream_rewards = false``: after the
   batch), so scoring overlaps generation; the step then waits only for the last rewards (``reward_wait_s``).
2. ``hooks.advantages(rewards, groups)`` -> one advantage per sample and the samples to train on.
3. ``prepare(step, samples, adv, keep)``: shuffle (seeded) and split into ``mini_batches``; pack each exactly as the
   loss will see it; one no-grad pass of the trainer over those packs measures the trainer's log-probs and entropy
   BEFORE the update, hence the rollout/train mismatch (mean and max |rollout - trainer| per token; with
   ``routing_replay`` on an MoE model both trainer forwards use the rollout's recorded experts), the old
   log-probs (``old_logprobs = "rollout" | "recompute"``), truncated IS weights (``tis_cap``) and the reference
   log-probs (only when a reference model exists). Per-token values ride in ``RLBatch.fields``. When that pass
   could only measure (``single_pass``: one optimizer step per batch, rollout old log-probs, no reference, no IS),
   it is skipped and the training forward measures mismatch and entropy itself (same values, one forward less).
4. ``update(...)``: ``ppo_epochs`` x ``mini_batches`` optimizer steps, loss from ``hooks.make_loss`` (GRPO / GSPO:
   one graph-safe loss kept across steps, so in a synchronous run whose KV cache stays allocated the engine replays
   the captured micro-batch step as a CUDA graph; with the KV cache taken back every rollout, and in async runs,
   the updates stay eager).
5. metrics (reward, response length, truncation, KL, mismatch, entropy, clip fraction, time split rollout /
   reward / logprob / train), evaluation every ``train.eval_every`` steps on held-out prompts (greedy mean reward and
   exact-match accuracy; with ``eval_n`` > 1 also sampled mean reward, unbiased pass@k and length; with
   ``train.eval_before_train`` also of the initial policy, as step 0; ``train.keep_best``: the best evaluated
   step's policy kept as ``<out>/best``, ``polyrl.run.best``), atomic
   checkpoints with the data position (exact resume), ``metrics.png``, summary, and a
   seeded sample of ``rollouts_to_save`` rollouts per step in ``rollouts.jsonl`` for ``polyrl view``
   (``polyrl.run.rollout_log``: texts, rewards, the rollout's and, when measured, the trainer's per-token log-probs).

Asynchronous RL (``max_staleness`` K > 0, ``polyrl.run.async_rollout``, docs/async-rl.md): step s takes its batch from
a ``RolloutSource`` (a policy-versioned queue), which then starts the batches up to s + K with the current weights
(inline; in a background thread on a copy of the weights, optionally with partial rollouts whose sequences in
flight take each update between two decode steps; or in rollout worker processes; agentic runs: inline or
the thread, whose episodes then run beside the training, with partial rollouts too, or (``--env``) the worker
processes, each running the episode loop, ``polyrl.agents.remote``); ``prepare`` uses the
decoupled objective (recomputed proximal log-probs, truncated ``pi_prox / pi_behaviour`` weights, ``async/*``
metrics); after the update the source gets the new version (the thread's weights are synced); checkpoints hold the
queue; with partial rollouts the batches in flight are finished before an evaluation. K = 0: no source. The source,
the async checks and what a step publishes are the ``AsyncSteps`` mixin (``polyrl.run.async_steps``).

Under torchrun (``polyrl train --nproc-per-node N``) the policy is FSDP2-sharded (a LoRA policy: replicated, see
``polyrl.train.parallel.replicate``) and the run is data-parallel: the prompt stream, the seeds and so the sampled
tokens are the same as in one process; each rank generates for its share of the prompts (``ColocatedPolicy`` with a
``world``), rank 0 scores every sample and broadcasts the rewards, every rank computes the same advantages and
mini-batches and trains on its strided share of each mini-batch (padded with zero-weight micro-batches so every rank
joins every FSDP collective), normalised by the global token count; metrics are reduced over ranks; rank 0 logs;
checkpoints (sharded, or replicated for LoRA) resume at any world size. Async RL there: the ``inline`` and
``thread`` producers, each rank generating its share; the producer's collectives on a gloo group of their own, the
thread's weight copy all-gathered in the trainer's thread at ``weights_updated`` (``async_steps``). Agentic runs
(``--env``, ``--agent``) too: each rank runs the episodes of its share of the prompts and every rank gets every
episode (``polyrl.agents.train``); ``save_rollouts`` gathers the trainer's log-probs of the saved samples to rank 0.

``hooks`` (e.g. ``grpo.GroupRelative``) provide ``needs_reference``, ``advantages(rewards, groups) -> (adv, keep,
metrics)``, ``normalizer(tokens, sequences)`` and ``make_loss(tokens_in_step, normalizer)`` (``OnlineHooks`` of
``polyrl.algorithms.online_config``, whose ``OnlineConfig`` holds the settings every online algorithm shares). A
registered episode producer (``cfg.episodes``, see ``polyrl.run.episodes``) puts its ``collect`` / ``evaluate`` in
front of the run class: agentic RL without this package importing ``polyrl.agents``. Not here: loss math
(``losses``), advantages, reward functions, the colocated engines (``colocated``), the critic (``actor_critic``).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from polyrl.algorithms.losses import kl_penalty, tis_weights
from polyrl.algorithms.online_config import OnlineHooks
from polyrl.algorithms.reward_sources import open_rewards
from polyrl.algorithms.rewards import example_view
from polyrl.algorithms.rl_batch import RLBatch, Sample, pack_samples
from polyrl.algorithms.teacher import add_token_term, check_teacher_tokenizer
from polyrl.data.builtin import check
from polyrl.data.config import DataConfig
from polyrl.data.dataset import chat_tokenizer, encode_prompts, load_prompts
from polyrl.data.examples import PromptExample
from polyrl.errors import CheckpointError, ConfigError, DataError
from polyrl.infer.config import RolloutConfig
from polyrl.infer.sampling_params import SamplingParams, StructuredOutputs
from polyrl.models.checkpoint import load_tokenizer
from polyrl.run.async_rollout import PartialRollouts, staleness_metrics
from polyrl.run.async_steps import AsyncSteps
from polyrl.run.best import BestKeeper
from polyrl.run.colocated import ColocatedPolicy
from polyrl.run.config import RunConfig, save_resolved
from polyrl.run.data_parallel import DataParallelSteps
from polyrl.run.evaluate import sampled_metrics
from polyrl.run.offline import (
    any_rank,
    end_status,
    eval_data_config,
    export_final,
    export_model,
    keep_best,
    open_checkpoints,
    open_metrics,
    place_policy,
    report_stream,
    resume_note,
    resume_point,
    run_steps,
    tokenizer_path,
)
from polyrl.run.prompt_order import PromptStream, rollout_seed
from polyrl.run.rollout_log import RolloutLog, chosen, spread, token_strings
from polyrl.run.stop_signal import StopSignal
from polyrl.run.teardown import release
from polyrl.run.worker_partial import WorkerPartialRollouts
from polyrl.train import parallel as par


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class OnlineRun(AsyncSteps, DataParallelSteps):
    """A whole online run (see the module docstring); ``run()`` returns the summary."""

    best: BestKeeper | None = None  # train.keep_best (set in __init__)

    def __init__(self, cfg: RunConfig, hooks: OnlineHooks, stream: TextIO | None = None) -> None:
        self.cfg, self.hooks, self.a = cfg, hooks, cfg.algo_config
        self.world = par.init_world()
        self.stream_out = report_stream(stream, self.world)
        self.out = Path(cfg.out)
        self.t_start = time.perf_counter()
        self.start_point = resume_point(cfg)
        self._resumed_async: dict[str, Any] | None = None  # the checkpointed rollout queue of an async run
        self.tokenizer = load_tokenizer(tokenizer_path(cfg))
        if getattr(self.a, "teacher", None):  # a local teacher's tokenizer, before any weights load
            check_teacher_tokenizer(self.a.teacher, self.tokenizer)
        self.prompts, self.prompt_ids, self.views, skipped = self._load(cfg.data, "train")
        self.eval_set = self._eval_set() if cfg.train.eval_every > 0 else None
        self.best = keep_best(cfg, self.world, self.export_best, self.stream_out)
        if self.best is not None:
            self.best.check(self.eval_metric_names())
        self.steps = self._total_steps()
        a = self.a
        self.max_staleness = self._check_async()
        reward = repr(a.reward) if cfg.episodes is None else cfg.episodes.reward_source
        self.print(
            f"{cfg.algo}: {len(self.prompts)} prompts ({skipped} longer than max_prompt_len skipped), {self.steps} "
            f"steps of {a.prompts_per_step} prompts x {a.samples_per_prompt} samples, "
            f"{a.ppo_epochs * a.mini_batches} optimizer step(s) each; reward {reward}"
        )
        if self.world.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            save_resolved(cfg, self.out)
        self.policy = self._make_policy()
        self.structured = StructuredOutputs.from_spec(getattr(a, "rollout_response_format", ""))
        self.sampling = SamplingParams(
            temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_new_tokens, structured=self.structured
        )
        self.pool = None  # rank 0 scores every sample (one set of reward workers per run)
        if self.world.is_main:
            self.pool = open_rewards(
                a.reward, cfg.reward, a.reward_workers, a.reward_timeout, a.failure_reward,
                device=self.policy.device, dtype=self.policy.engine.compute_dtype,
            )  # fmt: skip
        self.data = PromptStream(len(self.prompts), cfg.data.seed)
        self.start = 0
        if self.start_point is not None:
            self._resume()
        # the sampled rollouts for `polyrl view` (rank 0); rows of steps after a resumed checkpoint are dropped
        self.rollout_log = None
        if self.world.is_main and a.rollouts_to_save > 0:
            self.rollout_log = RolloutLog(self.out, self.start)
        self.measured_logprobs: list[Any] | None = None  # the trainer's per-sample log-probs of this step, if measured
        self.source = self._make_source()  # async RL (max_staleness > 0): rollouts generated ahead; None: synchronous

    def rollout_config(self) -> RolloutConfig:
        """The rollout engine sized for this run: the longest prompt plus the longest generation (an episode's
        whole context in agentic runs), every sequence of a step (or of the eval set) in one wave."""
        a = self.a
        longest = max(len(x) for x in self.prompt_ids + (self.eval_set[1] if self.eval_set else []))
        gen = max(a.max_new_tokens, a.eval_max_new_tokens or 0)
        if self.cfg.episodes is not None:  # episodes: the context holds them whole
            gen = max(gen, self.cfg.episodes.max_episode_tokens - longest)
        seqs = min(
            a.rollout_max_num_seqs,
            max(a.prompts_per_step * a.samples_per_prompt, len(self.eval_set[0]) if self.eval_set else 1),
        )
        block = RolloutConfig.block_size
        # the most the rollout can hold at once (+1 block per sequence of slack), not all free memory: a smaller
        # cache is allocated and zeroed faster after every release
        return RolloutConfig(
            num_blocks=a.rollout_num_blocks,
            max_num_blocks=seqs * (-(-(longest + gen + 1) // block) + 1),
            gpu_memory_utilization=a.rollout_gpu_memory_utilization,
            max_num_seqs=seqs,
            max_model_len=longest + gen + 1,
            max_num_batched_tokens=max(8192, longest + gen + 1),
            record_routing=bool(getattr(a, "routing_replay", False)),
            weight_precision="fp8" if getattr(a, "rollout_precision", "model") == "fp8" else None,
            kv_cache_dtype="fp8_e4m3" if getattr(a, "rollout_kv_dtype", "model") == "fp8" else None,
        )

    def _make_policy(self) -> ColocatedPolicy:
        """The policy (FSDP2-sharded under torchrun; LoRA: replicated, every rank rolls out base + its adapter) with
        its rollout engine over the same weights (async thread / process producers: a separate copy, but not on the
        ranks other than 0 of a replicated run with the process producer, whose engines never run)."""
        cfg, a = self.cfg, self.a
        if getattr(a, "routing_replay", False) and cfg.episodes is not None:
            raise ConfigError(
                f"{a.table_name()}.routing_replay does not reach agentic episodes yet (their samples carry no routing "
                f"record, so nothing would be replayed); remove {a.table_name()}.routing_replay"
            )
        model, _ = place_policy(cfg, self.world)
        if getattr(a, "routing_replay", False) and not model.config.is_moe:
            raise ConfigError(
                f"{a.table_name()}.routing_replay replays the experts of a mixture-of-experts model, and "
                f"{cfg.model} is dense ({model.config.model_type}); remove {a.table_name()}.routing_replay"
            )
        separate = self.max_staleness > 0 and a.async_producer in ("thread", "process")
        if separate and a.async_producer == "process" and not self.world.is_main and par.is_replicated(model):
            # LoRA under torchrun: rank 0's workers generate (ColocatedPolicy.idle_engine), so this rank keeps no
            # rollout copy of its whole replica (FSDP2: the plain copy stays, the log-prob recompute reads it)
            separate = False
        return ColocatedPolicy(
            model,
            self.tokenizer,
            cfg.optim,
            cfg.schedule,
            cfg.precision,
            cfg.engine,
            self.rollout_config(),
            total_steps=self.steps * a.ppo_epochs * a.mini_batches,
            release_kv=a.release_kv,
            reference=self.hooks.needs_reference,
            world=self.world,
            separate_rollout=separate,
        )

    def print(self, msg: str) -> None:
        print(msg, file=self.stream_out, flush=True)

    # ---- setup ------------------------------------------------------------------------------------
    def _load(self, data_cfg: DataConfig, part: str) -> tuple[list[PromptExample], list[list[int]], list[dict], int]:
        prompts, _ = load_prompts(data_cfg, part)
        chat = chat_tokenizer(data_cfg, self.tokenizer)
        kept, ids = [], []
        for p, x in zip(prompts, encode_prompts(chat, prompts, data_cfg.path)):
            if 0 < len(x) <= self.a.max_prompt_len:
                kept.append(p)
                ids.append(x)
        if not kept:
            raise DataError(
                f"{data_cfg.path}: no prompt fits {self.a.table_name()}.max_prompt_len="
                f"{self.a.max_prompt_len}; raise it"
            )
        return kept, ids, [example_view(p) for p in kept], len(prompts) - len(kept)

    def _eval_set(self) -> tuple[list[PromptExample], list[list[int]], list[dict]]:
        c = self.cfg
        if c.train.eval_data:
            dcfg, part = eval_data_config(c), "train"
        elif c.data.holdout > 0:
            dcfg, part = c.data, "test"
        elif c.data.path.startswith("builtin:"):
            dcfg, part = dataclasses.replace(c.data, path=c.data.path.split("@", 1)[0] + "@test", split=None), "train"
        else:
            raise ConfigError(
                "train.eval_every is set but there is no eval data; pass --eval-data SPEC or set data.holdout"
            )
        prompts, ids, views, _ = self._load(dcfg, part)
        n = self.a.eval_prompts
        return prompts[:n], ids[:n], views[:n]

    def _total_steps(self) -> int:
        t = self.cfg.train
        if t.max_steps is not None:
            return t.max_steps
        epochs = t.epochs if t.epochs is not None else 1.0
        return max(1, math.ceil(epochs * len(self.prompts) / self.a.prompts_per_step))

    def _resume(self) -> None:
        loaded = self.policy.load(self.start_point)
        if "prompts" not in loaded.data_state:
            raise CheckpointError(f"{self.start_point} has no prompt position; it was not written by an online run")
        self.data.load_state_dict(loaded.data_state["prompts"])
        self.restore_counters(loaded.data_state)
        self._resumed_async = loaded.data_state.get("async")
        self.start = loaded.step
        if self.start > self.steps:
            raise ConfigError(
                f"the checkpoint is at step {self.start}, past this run's {self.steps} steps; raise --max-steps"
            )
        self.print(f"resumed from {self.start_point} at step {self.start}{resume_note(loaded, self.cfg)}")

    def restore_counters(self, data_state: dict[str, Any]) -> None:
        """Cumulative counters saved by ``data_state`` (reward failures), back after a resume."""
        if self.pool is not None:
            self.pool.totals.update(data_state.get("reward_failures", {}))
        if self.best is not None:
            self.best.load_state_dict(data_state.get("best"))

    def data_state(self) -> dict[str, Any]:
        # the queue first: saving it drains the producer, whose batches in flight (with partial rollouts, one that
        # was submitted but had not started, so had not taken its prompts yet) move the prompt position and the
        # reward-failure totals; read after it, they match the queue
        queue = self.queue_state() if self.source is not None else None  # data-parallel: the same on every rank
        failures = dict(self.pool.totals) if self.pool is not None else {}
        state = {"prompts": self.data.state_dict(), "reward_failures": failures}
        if queue is not None:  # the rollouts generated ahead: checkpointed (their weights are gone)
            state["async"] = queue
        if self.best is not None:
            state["best"] = self.best.state_dict()
        return state

    def export_best(self, folder: Path) -> Path | None:
        """The policy now as ``folder`` for ``train.keep_best``: the same folder as the final export."""
        return export_model(self.policy.model, self.world, folder, self.tokenizer)

    def evaluate_before_train(self) -> dict[str, float]:
        """``train.eval_before_train``: the evaluation of the initial policy (logged as step 0)."""
        if isinstance(self.source, PartialRollouts | WorkerPartialRollouts):
            self.source.drain()  # the evaluation has the rollout engine to itself
        return self.evaluate()

    # ---- one step -----------------------------------------------------------------------------------
    def collect(self, step: int) -> tuple[list[Sample], list[float], dict[str, float]]:
        """Rollout + rewards of RL step ``step`` (0-based): (samples, rewards, metrics)."""
        t0 = time.perf_counter()
        idx = self.data.take(self.a.prompts_per_step)
        seeds = [rollout_seed(self.cfg.seed, step, k) for k in range(len(idx))]
        n, views = self.a.samples_per_prompt, [self.views[i] for i in idx]
        stream = self.reward_stream()  # rank 0: scores each sample as it finishes, while the rest generate
        hook = None
        if stream is not None and getattr(self.a, "stream_rewards", True):

            def hook(g: int, j: int, sample: Sample) -> None:
                stream.submit(g * n + j, sample.text, views[g])

        try:
            samples = self.policy.rollout([self.prompt_ids[i] for i in idx], n, self.sampling, seeds, on_finish=hook)
        except BaseException:
            if stream is not None:
                stream.close()
            raise
        t1 = time.perf_counter()
        res, timing = self.finish_scoring(stream, [s.text for s in samples], [views[s.group] for s in samples])
        lengths = [len(s.completion_ids) for s in samples]
        m = {
            "reward": _mean(res.rewards),
            "reward_std": float(torch.tensor(res.rewards).std()) if len(samples) > 1 else 0.0,
            "response_length": _mean(lengths),
            "response_length_max": float(max(lengths)),
            "truncated_fraction": _mean([float(s.finish_reason == "length") for s in samples]),
            "rollout_s": t1 - t0,
            "rollout_tokens_per_s": sum(lengths) / max(t1 - t0, 1e-9),
            **timing,  # reward_s (scoring wall time, overlapping the rollout), reward_wait_s, reward/overlap_frac,
            # reward_failures_total (rank 0's count, on every rank)
            **res.metrics(),
        }
        if self.structured is not None:  # what the grammar mask removed: 0 = the policy already follows the format
            m["rollout_mask_logmass"] = sum(s.masked_logmass or 0.0 for s in samples) / max(1, sum(lengths))
        for msg in res.messages[:1]:
            self.print(
                f"step {step + 1}: reward {self.a.reward!r} failed on {res.num_failures} of {len(samples)} samples "
                f"(each scored failure_reward={self.a.failure_reward:g}; counted in reward_failures_*): {msg}"
            )
        return samples, res.rewards, m

    def split(self, step: int, keep: list[int]) -> list[list[int]]:
        order = list(keep)
        random.Random(f"polyrl-minibatch:{self.cfg.seed}:{step}").shuffle(order)
        k = min(self.a.mini_batches, len(order))
        return [order[i * len(order) // k : (i + 1) * len(order) // k] for i in range(k)]

    def single_pass(self) -> bool:
        """True when the separate no-grad pass before the update would only measure: one optimizer step per batch,
        old log-probs from the rollout engine, no reference model, no IS correction. The training forward then
        measures mismatch and entropy itself (all its forwards precede the step's one update), saving a forward
        over every token of the step."""
        a = self.a
        return (
            getattr(self.hooks, "measures_in_loss", False)
            and a.ppo_epochs == 1
            and a.mini_batches == 1
            and getattr(a, "old_logprobs", "recompute") == "rollout"
            and self.policy.ref_model is None
            and not getattr(a, "tis_cap", None)
            and not self.decoupled
        )

    def prepare(
        self, step: int, samples: list[Sample], adv: list[float], keep: list[int]
    ) -> tuple[list[list[RLBatch]], dict[str, float]]:
        """Mini-batches of packed ``RLBatch`` es with their per-token fields, and the measurement metrics."""

        t0 = time.perf_counter()
        budget = self.policy.micro_batch_tokens
        groups = [self.share(g) for g in self.split(step, keep)]  # this rank's part of each mini-batch
        mine = [i for g in groups for i in g]
        if self.single_pass():  # measured by the training forward (update)
            rollout = [list(s.logprobs) for s in samples]
            fields = {"adv": adv, "rollout_logp": rollout, "old_logp": rollout}
            batches = self.even_out([pack_samples(samples, fields, budget, g) for g in groups], samples, keep[0])
            return batches, {"logprob_s": time.perf_counter() - t0}
        plain = [b for g in groups for b in pack_samples(samples, None, budget, g)]
        T = self.a.temperature
        lps, ents = self.policy.logprobs(samples, T, entropy=True, batches=plain)
        self.measured_logprobs = lps
        refs = None
        if self.policy.ref_model is not None:
            refs, _ = self.policy.logprobs(samples, T, model=self.policy.ref_model, batches=plain)
        rollout_lp = [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]
        mismatch_mean, mismatch_max = self.global_stats([(rollout_lp[i] - lps[i]).abs() for i in mine])
        fields: dict[str, list[Any]] = {"adv": adv, "rollout_logp": [x.tolist() for x in rollout_lp]}
        old = rollout_lp if self.a.old_logprobs == "rollout" and not self.decoupled else lps
        fields["old_logp"] = [x.tolist() if x is not None else None for x in old]
        if refs is not None:
            fields["ref_logp"] = [x.tolist() if x is not None else None for x in refs]
        cap = self.is_cap()
        if cap:
            fields["is_w"] = [
                tis_weights(lps[i], rollout_lp[i], cap).tolist() if lps[i] is not None else None
                for i in range(len(samples))
            ]
        batches = self.even_out([pack_samples(samples, fields, budget, g) for g in groups], samples, keep[0])
        m = {
            "mismatch_mean": mismatch_mean,
            "mismatch_max": mismatch_max,
            "entropy": self.global_stats([ents[i] for i in mine])[0],
            "logprob_s": time.perf_counter() - t0,
        }
        if refs is not None:
            kl = [kl_penalty(lps[i], refs[i], getattr(self.a, "kl_estimator", "k3")) for i in mine]
            m["kl_before"] = self.global_stats(kl)[0]
        if self.source is not None:
            gather = self.world.all_gather_object if self.world.distributed else None  # over every rank's share
            m.update(staleness_metrics(step, samples, mine, rollout_lp, lps, cap, gather))
        return batches, m

    def update(self, batches: list[list[RLBatch]]) -> dict[str, float]:
        """``ppo_epochs`` passes of one optimizer step per mini-batch; means of the engine's step stats."""
        t0 = time.perf_counter()
        recs = []
        measure = self.single_pass()
        for _ in range(self.a.ppo_epochs):
            for mb in batches:
                # global counts (every rank's share of the mini-batch); padding micro-batches count 0
                tokens = self.world.sum_float(sum(b.num_target_tokens for b in mb))
                seqs = self.world.sum_float(sum(b.num_sequences for b in mb if b.num_target_tokens > 0))
                norm = self.hooks.normalizer(tokens, int(seqs))
                loss_fn = (
                    self.hooks.make_loss(tokens, norm, measure=True) if measure else self.hooks.make_loss(tokens, norm)
                )
                eager = getattr(self.policy, "release_kv", False) or self.source is not None
                if eager and getattr(loss_fn, "graph_safe", False):
                    # Eager updates when the KV cache is taken back for every rollout (a captured step's activation
                    # pool would hold device memory across it) and in async runs (a capture while the producer
                    # generates in another thread may see its device calls and fail)
                    loss_fn.graph_safe = False
                recs.append(self.policy.step(mb, loss_fn, norm).to_dict())
                if measure:
                    top = float(loss_fn.mismatch_max) if loss_fn.mismatch_max is not None else 0.0
                    recs[-1]["mismatch_max"] = max(self.world.all_gather_object(top)) if self.world.distributed else top
        out: dict[str, float] = {}
        for key in recs[0]:
            vals = [r[key] for r in recs if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
            if vals:
                out[key] = sum(vals) if key in ("tokens", "time_s") else _mean(vals)
        out["lr"] = recs[-1]["lr"]
        out["optimizer_steps"] = float(self.policy.engine.global_step)
        out["skipped"] = any(r["skipped"] for r in recs)
        out["skipped_total"] = recs[-1]["skipped_total"]
        if "clip_fraction" in recs[-1]:
            out["clip_fraction_last"] = recs[-1]["clip_fraction"]
        out["train_s"] = time.perf_counter() - t0
        out.pop("step", None)
        out.pop("time_s", None)
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward and exact-match accuracy (when answers exist)."""

        prompts, ids, views = self.eval_set
        params = SamplingParams(
            temperature=0.0, max_tokens=self.a.eval_max_new_tokens or self.a.max_new_tokens, structured=self.structured
        )
        samples = self.policy.rollout(ids, 1, params)
        res = self.score([s.text for s in samples], views)
        out = {"eval_reward": _mean(res.rewards)}
        if all(p.answer is not None for p in prompts):
            out["eval_accuracy"] = _mean([float(check(s.text, p)) for s, p in zip(samples, prompts)])
        n = getattr(self.a, "eval_n", 1)
        if n > 1:  # sampled as in training, the same seeds at every evaluation: mean reward, pass@k, length
            sampling = params.clone(temperature=self.a.temperature, top_p=self.a.top_p)
            seeds = [rollout_seed(self.cfg.seed, -1, k) for k in range(len(ids))]
            drawn = self.policy.rollout(ids, n, sampling, seeds)
            res = self.score([s.text for s in drawn], [views[s.group] for s in drawn])
            lengths = [len(s.completion_ids) for s in drawn]
            groups = [s.group for s in drawn]
            out.update(sampled_metrics(res.rewards, groups, lengths, n, self.a.eval_pass_threshold))
        return out

    def eval_metric_names(self) -> set[str] | None:
        """The metrics ``evaluate`` logs, known before it runs (None when a subclass evaluates its own way)."""
        if self.eval_set is None or type(self).evaluate is not OnlineRun.evaluate:
            return None
        names = {"eval_reward"}
        if all(p.answer is not None for p in self.eval_set[0]):
            names.add("eval_accuracy")
        n = getattr(self.a, "eval_n", 1)
        if n > 1:
            names.update(sampled_metrics([0.0] * n, [0] * n, [0] * n, n))
        return names

    def step(self, step: int) -> dict[str, Any]:
        """RL step ``step`` (0-based) end to end; the metrics record (``step`` 1-based)."""
        t0 = time.perf_counter()
        batch = None
        if self.source is None:
            samples, rewards, rec = self.collect(step)
        else:  # async: this step's batch (generated ahead), then the next ones are started before training
            batch = self.source.get(step)
            for ahead in range(step + 1, min(step + self.max_staleness, self.steps - 1) + 1):
                self.source.submit(ahead)
            samples, rewards, rec = batch.samples, batch.rewards, dict(batch.metrics)
            self.restore_batch_state(batch.extra)
        groups = [s.group for s in samples]
        if hasattr(self.hooks, "sample_advantages"):  # per-token advantages from the samples (distill)
            adv, keep, adv_metrics = self.hooks.sample_advantages(samples, rewards, groups, self.tokenizer)
        else:
            adv, keep, adv_metrics = self.hooks.advantages(rewards, groups)
        rec.update(adv_metrics)
        teacher = getattr(self.hooks, "teacher", None)
        if teacher is not None:  # --teacher on GRPO / GSPO / PPO: the per-token distillation term
            term, teacher_metrics = teacher(samples, self.tokenizer)
            rec.update(teacher_metrics)
            adv = self.add_teacher_term(adv, term)
        self.measured_logprobs = None
        t_train = time.perf_counter()
        if keep:
            batches, m = self.prepare(step, samples, adv, keep)
            rec.update(m)
            rec.update(self.update(batches))
        else:
            rec["update_skipped"] = 1.0
        if batch is not None:  # async/* of this step, then version step + 1 published (AsyncSteps)
            rec.update(self.publish(step, batch, t_train))
        self.save_rollouts(step, samples, rewards, adv)
        self.measured_logprobs = None
        rec["step"] = step + 1
        rec["epoch"] = self.data.epochs if batch is None else batch.epochs
        e = self.cfg.train.eval_every
        if self.eval_set is not None and ((step + 1) % e == 0 or step + 1 == self.steps):
            if isinstance(self.source, PartialRollouts | WorkerPartialRollouts):
                # its weights_updated does not wait for the batches in flight: finish them first, so that the
                # evaluation has the rollout engine (and an agentic run's environment pool) to itself
                self.source.drain()
            rec.update(self.evaluate())
        rec["time_s"] = time.perf_counter() - t0
        return rec

    def add_teacher_term(self, adv: list[Any], term: list[list[float]]) -> list[Any]:
        """The advantages with the teacher's per-token term added (PPO's run adds it after GAE instead)."""
        return add_token_term(adv, term)

    # ---- the sampled rollouts (rollouts.jsonl) -------------------------------------------------------------
    def save_rollouts(self, step: int, samples: list[Sample], rewards: list[float], adv: list[Any]) -> None:
        """Write ``rollouts_to_save`` seeded samples of step ``step`` (0-based) to ``rollouts.jsonl`` (rank 0).
        Data-parallel: each rank measured the trainer's log-probs of its own share, so the chosen samples' are
        gathered first (a collective: every rank calls this)."""
        if self.a.rollouts_to_save <= 0:
            return
        picked = chosen(self.cfg.seed, step, len(samples), self.a.rollouts_to_save)
        lps = self.measured_logprobs
        if self.world.distributed and lps is not None:
            found: dict[int, Any] = {}
            for part in self.world.all_gather_object({i: lps[i] for i in picked if lps[i] is not None}):
                found.update(part)
            lps = [found.get(i) for i in range(len(samples))]
        if self.rollout_log is None:
            return
        rows = []
        for i in picked:
            s = samples[i]
            a = adv[i] if i < len(adv) else None
            row = {
                "step": step + 1,
                "sample": i,
                "group": s.group,
                "reward": float(rewards[i]),
                "advantage": float(a) if isinstance(a, (int, float)) else None,
                **self.rollout_row(i, s),
            }
            measured = lps[i] if lps is not None and i < len(lps) else None
            row["trainer_logprobs"] = spread(measured, s.mask, len(s.completion_ids))
            rows.append(row)
        self.rollout_log.write(rows)

    def rollout_row(self, i: int, sample: Sample) -> dict[str, Any]:
        """The text and per-token fields of sample ``i`` of this step (an episode producer adds its turns)."""
        return {
            "kind": "completion",
            "prompt": self.tokenizer.decode(sample.prompt_ids),
            "completion": sample.text or self.tokenizer.decode(sample.completion_ids),
            "finish_reason": sample.finish_reason,
            "tokens": token_strings(self.tokenizer, sample.completion_ids),
            "logprobs": spread(sample.logprobs, sample.mask, len(sample.completion_ids)),
        }

    # ---- the run ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """The run; a stop signal is caught across the loop and the finish (``polyrl.run.stop_signal``)."""
        with StopSignal() as stop:
            return self._run(stop)

    def export_more(self) -> dict[str, Any]:
        """What a subclass writes after the final model, in the run's finish (before its summary, under its
        ``StopSignal``): the summary's entries for it (PPO: ``final_critic``)."""
        return {}

    def _run(self, stop: StopSignal) -> dict[str, Any]:
        cfg, world = self.cfg, self.world
        ckpts = open_checkpoints(self.out, cfg, world)
        series = ("loss", "lr", "grad_norm", *cfg.spec.plot_series)
        log = open_metrics(cfg, self.out, world, self.steps, self.start, series, self.stream_out)
        config_dict = cfg.to_dict()
        model = self.policy.model

        def save(step: int) -> None:
            if not world.distributed:
                ckpts.save(
                    step, model, self.policy.engine, data_state=self.data_state(), config=config_dict,
                    tokenizer=self.tokenizer,
                )  # fmt: skip
                return
            self.policy.save(ckpts.root, step, data_state=self.data_state(), config=config_dict)
            if world.is_main:
                ckpts.prune()
            world.barrier()

        failed = False
        try:
            before = self.evaluate_before_train if cfg.train.eval_before_train else None
            run_steps(self.start, self.steps, self.step, log, ckpts, save, before=before, best=self.best,
                      agree=any_rank(world), stop=stop)  # fmt: skip
            final = export_final(cfg, model, world, self.tokenizer)
            more = self.export_more()
        except BaseException as exc:
            failed = True
            if log is not None:
                log.close(extra={"status": end_status(exc)}, print_table=False)
            raise
        finally:
            closers: list[tuple[str, Callable[[], object]]] = []
            if self.source is not None:
                # a failed rank under torchrun does not wait for its producer's batch: that batch may wait on the
                # other ranks (stuck in a collective with this one), so the rank exits and torchrun stops the rest
                source = self.source
                closers.append(("rollout producer", lambda: source.close(abandon=failed and world.distributed)))
            if self.policy.remote is not None:
                closers.append(("rollout workers", self.policy.remote.close))
            if self.pool is not None:
                closers.append(("reward pool", self.pool.close))
            if self.rollout_log is not None:
                closers.append(("rollout log", self.rollout_log.close))
            release(closers, failed)
        if log is None:
            return {"status": "finished", "rank": world.rank}
        h = log.history
        rewards = [r["reward"] for r in h if "reward" in r]
        k = max(1, min(5, len(rewards) // 4 or 1))
        extra = {
            "algo": cfg.algo,
            "status": "finished",
            "resumed_from_step": self.start,
            "wall_time_s": time.perf_counter() - self.t_start,
            "reward_first": _mean(rewards[:k]) if rewards else None,
            "reward_last": _mean(rewards[-k:]) if rewards else None,
            "reward_failures": dict(self.pool.totals),
            "world_size": world.world_size,
            "final_model": str(final) if final is not None else None,
            **more,
            **(self.best.summary() if self.best is not None else {}),
        }
        for key in ("eval_reward", "eval_accuracy"):
            vals = [r[key] for r in h if key in r]
            if vals:
                extra[f"final_{key}"] = vals[-1]
        summary = log.close(extra=extra)
        plot = f"  plot: {log.plot}" if log.plot is not None else ""
        self.print(f"final model: {final}  metrics: {self.out / 'metrics.jsonl'}{plot}")
        return summary


def run_online(cfg: RunConfig, stream: TextIO | None = None, run_cls: type[OnlineRun] | None = None) -> dict[str, Any]:
    """Train ``cfg`` (a ``RunConfig`` whose ``algo_config`` is an ``OnlineConfig``) with its algorithm's hooks, in
    ``run_cls`` (default ``OnlineRun``; the actor-critic loop passes its subclass), with a registered episode
    producer's steps in front when the run has one (``cfg.episodes``: agentic RL); the summary. Tears the process
    group down at the end under torchrun."""
    cls = run_cls or OnlineRun
    if cfg.episodes is not None:
        cls = cfg.episodes.run_class(cls)
    try:
        return cls(cfg, cfg.spec.hooks(cfg.algo_config), stream).run()
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["OnlineRun", "run_online"]
