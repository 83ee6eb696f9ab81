"""What every online RL algorithm shares: ``OnlineConfig`` (the rollout, reward and update-schedule settings of the
``[grpo]`` / ``[gspo]`` / ``[ppo]`` tables, which subclass it) and ``OnlineHooks`` (what an algorithm gives the
online loop of ``polyrl.run.online``: advantages, the step normaliser, the loss).

Not here: the loop itself (``polyrl.run.online``), agentic episodes (``polyrl.agents.config.AgentConfig``, the
``[agent]`` table), loss math (``losses``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from polyrl.errors import ConfigError


@dataclass
class OnlineConfig:
    """Rollout, reward and update-schedule settings shared by online algorithms."""

    reward: str = "exact_match"  # builtin name, sum of builtins, or path/to/file.py:fn
    reward_workers: int = 2  # processes; 0 = in this process (no timeout)
    reward_timeout: float = 10.0  # seconds per call
    failure_reward: float = 0.0  # reward of a call that raised, timed out or returned a non-number
    # score each completion as soon as the rollout finishes it, while the rest still generate (polyrl.algorithms.
    # reward_stream); false = after the whole batch. Same rewards either way; metrics reward_wait_s, overlap_frac
    stream_rewards: bool = True
    samples_per_prompt: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 128  # per completion (per assistant turn in an agentic run)
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_len: int = 1024  # longer prompts are skipped (counted)
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # optimizer steps per pass
    eval_prompts: int = 200  # held-out prompts scored at each evaluation
    eval_max_new_tokens: int | None = None  # default max_new_tokens
    eval_n: int = 1  # > 1: also sample this many completions per eval prompt -> eval_pass@k, eval_length
    eval_pass_threshold: float = 1.0  # a sampled eval completion passes when its reward is at least this
    rollout_max_num_seqs: int = 512  # sequences decoded together (a whole 64 x 8 step in one wave)
    rollout_num_blocks: int | None = None  # KV cache blocks; None = from free memory, at most what the run uses
    rollout_gpu_memory_utilization: float = 0.85
    # "model": the rollout samples with the trained weights themselves; "fp8": with FP8 copies of the projection
    # weights, requantised after every update (RolloutConfig.weight_precision, docs/fp8-rollout.md): faster decode,
    # ~half the weights' bytes more memory; mismatch_* / TIS metrics show what it changes
    rollout_precision: str = "model"
    # the rollout engine's KV cache: "model" (the model's dtype) or "fp8" (float8_e4m3fn, unit scale: half the KV
    # bytes a decode step reads; RolloutConfig.kv_cache_dtype, docs/fp8-rollout.md)
    rollout_kv_dtype: str = "model"
    # free the KV cache while training (True), keep it and its CUDA graphs across steps (False), or "auto": keep it
    # on an accelerator when it takes at most a quarter of the device memory (colocated.KEEP_KV_FRACTION)
    release_kv: bool | str = "auto"
    rollouts_to_save: int = 8  # samples per step written to rollouts.jsonl for `polyrl view` (seeded); 0 = none
    # constrain rollouts (and evaluations) to a grammar: "" = none, json_object, json_schema:<file.json or {...}>,
    # regex:<pattern>, choice:a|b, grammar:<file.lark> (SamplingParams.structured; docs/serving.md). The trainer
    # learns from the model's unmasked log-probs; metric rollout_mask_logmass says how much the mask removed
    rollout_response_format: str = ""
    # MoE rollout-routing replay: the rollout engine records the experts it chose per token and the trainer's
    # forwards (the log-prob recompute and the training step) reuse them, so both score the same sub-network
    # (docs/models.md); the mismatch_* metrics then measure what is left. Needs an MoE model
    routing_replay: bool = False
    # asynchronous RL (polyrl.run.async_rollout): the most policy versions (RL steps) a trained sample may lag the
    # weights it is trained on. 0 = synchronous (generate, then train, on the same weights); K >= 1 = rollouts are
    # generated K steps ahead; staler ones are regenerated (counted). "inline": the producer runs in the trainer's
    # thread on the shared weights; "thread": a background thread on a separate copy of the weights (one more
    # copy in memory), synced after every step, so generation of step t+K overlaps training on step t
    max_staleness: int = 0
    async_producer: str = "inline"  # inline | thread | process (rollout worker processes over gloo)
    rollout_workers: int = 1  # async_producer = "process": worker processes, prompts split over them
    # ... a worker (replica) that dies is restarted this many times at most (it reloads the model folder and rejoins
    # at the next weight push, with the current weights); past that it is dropped and the trainer's engine takes its
    # prompts. 0 = drop at once (polyrl.run.rollout_workers)
    rollout_worker_restarts: int = 3
    # ... seconds a generate call waits for each worker's reply at most; one that misses it (hung: alive, not
    # answering) is killed and treated as a dead one (its prompts to the trainer's engine, then restarted as above);
    # on a gloo weights group also each bucket of a weight push (a worker that hangs during the push is dropped).
    # None = no deadline (a hung worker holds the step for the groups' 600 s timeout)
    rollout_worker_timeout_s: float | None = None
    # ... how a batch's prompts are split over the live workers (polyrl.run.replica_balance): "work" = each worker's
    # estimated work (n x max_tokens + a prefill term per prompt) in proportion to its measured speed (an EMA of work
    # per second from its replies); "count" = prompt i to worker i mod W (equal counts)
    rollout_balance: str = "work"
    # partial rollouts (async_producer = "thread" or "process"): a weight update does not wait for the generation in
    # flight; the producer's engine (each rollout worker's) takes the new weights at a decode-step boundary and the
    # same sequences go on (their KV cache kept), each token recording the version that produced it
    # (Sample.token_versions) and its behaviour log-prob
    partial_rollouts: bool = False
    # where the update lands: 0 = at the first decode-step boundary after it is published (most overlap; the split
    # depends on timing); N > 0 = at engine step N of the batch submitted just before it (the process producer: of
    # each worker's share), the producer waiting there for it (reproducible: a resumed run equals the uninterrupted
    # one bit for bit)
    partial_swap_step: int = 0
    # placements (polyrl.run.placement, docs/distributed.md): "" = colocated (the default); "cuda:1,cuda:2" = one
    # rollout worker process per listed device (cpu may repeat: cpu,cpu = two CPU replicas), prompts split over them;
    # needs max_staleness >= 1 and async_producer = "process". train_devices: the trainer's device ("" = default)
    rollout_devices: str = ""
    train_devices: str = ""
    # trainer -> rollout weights (polyrl.run.weight_sync): wire dtype of the floating weights (auto = the rollout's
    # dtype, bf16, fp32) and the broadcast bucket size in MiB (a larger tensor travels alone)
    weight_sync_dtype: str = "auto"
    weight_sync_bucket_mb: float = 256.0
    # on-policy distillation term (polyrl.algorithms.distill.TeacherTerm; --teacher DIR / --teacher-url URL): a frozen
    # teacher scores the sampled tokens and teacher_coef x (log p_teacher - log p_student), minus its step mean, is
    # added to every token's advantage (metrics distill/*). teacher: an HF folder run in-process; teacher_url: an
    # OpenAI-compatible server returning prompt log-probs (polyrl serve, vLLM). Both "" = off. teacher_coef 1.0 is
    # the unscaled teacher-minus-student log-prob advantage of NeMo-RL's on-policy distillation (MOPD)
    teacher: str = ""
    teacher_url: str = ""
    teacher_coef: float = 1.0
    teacher_dtype: str | None = None  # in-process teacher; None: the device's default compute dtype
    teacher_timeout: float = 120.0  # teacher_url: seconds per request
    teacher_retries: int = 3  # teacher_url: retries of a failed request (connection error, timeout, 429, 5xx)
    teacher_concurrency: int = 4  # teacher_url: requests in flight (16 samples each)

    def table_name(self) -> str:
        return "online"

    def __post_init__(self) -> None:
        name = self.table_name()
        positive_ints = ("samples_per_prompt", "prompts_per_step", "max_new_tokens", "max_prompt_len", "ppo_epochs")
        for key in (*positive_ints, "mini_batches", "eval_prompts", "rollout_max_num_seqs", "eval_n"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}.{key} must be a positive integer, got {v!r}")
        if self.mini_batches > self.prompts_per_step * self.samples_per_prompt:
            raise ConfigError(f"{name}.mini_batches ({self.mini_batches}) exceeds the samples per step")
        if not isinstance(self.rollouts_to_save, int) or isinstance(self.rollouts_to_save, bool):
            raise ConfigError(f"{name}.rollouts_to_save must be an integer >= 0, got {self.rollouts_to_save!r}")
        if self.rollouts_to_save < 0:
            raise ConfigError(f"{name}.rollouts_to_save must be >= 0 (0 = none), got {self.rollouts_to_save}")
        k = self.max_staleness
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"{name}.max_staleness must be an integer >= 0 (0 = synchronous), got {k!r}")
        if self.async_producer not in ("inline", "thread", "process"):
            raise ConfigError(
                f'{name}.async_producer must be "inline", "thread" or "process", got {self.async_producer!r}'
            )
        if (
            not isinstance(self.rollout_workers, int)
            or isinstance(self.rollout_workers, bool)
            or self.rollout_workers < 1
        ):
            raise ConfigError(f"{name}.rollout_workers must be a positive integer, got {self.rollout_workers!r}")
        r = self.rollout_worker_restarts
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ConfigError(f"{name}.rollout_worker_restarts must be an integer >= 0 (0 = no restart), got {r!r}")
        t = self.rollout_worker_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not t > 0):
            raise ConfigError(
                f"{name}.rollout_worker_timeout_s must be a number of seconds > 0 (unset: no deadline), got {t!r}"
            )
        if self.rollout_balance not in ("work", "count"):
            raise ConfigError(f'{name}.rollout_balance must be "work" or "count", got {self.rollout_balance!r}')
        self._check_partial(name)
        self._check_placement(name)
        if self.release_kv not in (True, False, "auto"):
            raise ConfigError(f'{name}.release_kv must be true, false or "auto", got {self.release_kv!r}')
        if not self.temperature > 0:
            raise ConfigError(
                f"{name}.temperature must be > 0 for RL sampling (the ratios need it), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{name}.top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.reward_workers, int) or self.reward_workers < 0:
            raise ConfigError(f"{name}.reward_workers must be >= 0, got {self.reward_workers!r}")
        if not _finite_number(self.reward_timeout) or not self.reward_timeout > 0:
            raise ConfigError(
                f"{name}.reward_timeout must be a number of seconds > 0, got {self.reward_timeout!r} (e.g. 10.0)"
            )
        if not _finite_number(self.failure_reward):
            raise ConfigError(
                f"{name}.failure_reward must be a finite number (the reward of a failed call, e.g. 0.0), got "
                f"{self.failure_reward!r}"
            )
        if self.rollout_response_format:
            # lazy: the spec parser lives with SamplingParams (infer), needed only when rollouts are constrained
            from polyrl.errors import UserError
            from polyrl.infer.sampling_params import StructuredOutputs

            try:
                StructuredOutputs.from_spec(self.rollout_response_format)
            except UserError as exc:
                raise ConfigError(f"{name}.rollout_response_format: {exc}") from None
        if not isinstance(self.stream_rewards, bool):
            raise ConfigError(f"{name}.stream_rewards must be true or false, got {self.stream_rewards!r}")
        if self.rollout_precision not in ("model", "fp8"):
            raise ConfigError(f'{name}.rollout_precision must be "model" or "fp8", got {self.rollout_precision!r}')
        if self.rollout_kv_dtype not in ("model", "fp8"):
            raise ConfigError(f'{name}.rollout_kv_dtype must be "model" or "fp8", got {self.rollout_kv_dtype!r}')
        if not isinstance(self.routing_replay, bool):
            raise ConfigError(f"{name}.routing_replay must be true or false, got {self.routing_replay!r}")
        self._check_teacher(name)
        if not isinstance(self.reward, str) or not self.reward.strip():
            raise ConfigError(f"{name}.reward is empty; pass --reward NAME or --reward path/to/file.py:fn")

    def _check_placement(self, name: str) -> None:
        """The placement settings against the async ones (devices are checked by ``polyrl.run.placement``)."""
        for key in ("rollout_devices", "train_devices"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f'{name}.{key} must be a comma list of devices, e.g. "cuda:1,cuda:2"')
        devices = [d for d in self.rollout_devices.split(",") if d.strip()]
        if devices and (self.max_staleness < 1 or self.async_producer != "process"):
            raise ConfigError(
                f"{name}.rollout_devices = {self.rollout_devices!r} puts rollout replicas in worker processes, which "
                f"only the process producer drives: set {name}.max_staleness >= 1 and {name}.async_producer = "
                '"process" (--max-staleness 1 --async-producer process), or drop rollout_devices (colocated)'
            )
        if devices and self.rollout_workers not in (1, len(devices)):
            raise ConfigError(
                f"{name}.rollout_workers = {self.rollout_workers} but rollout_devices lists {len(devices)} devices "
                "(one worker per device): drop rollout_workers"
            )
        if self.weight_sync_dtype not in ("auto", "bf16", "fp32"):
            raise ConfigError(
                f'{name}.weight_sync_dtype must be "auto", "bf16" or "fp32", got {self.weight_sync_dtype!r}'
            )
        b = self.weight_sync_bucket_mb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
            raise ConfigError(f"{name}.weight_sync_bucket_mb must be a number of MiB > 0, got {b!r}")

    @property
    def has_teacher(self) -> bool:
        return bool(self.teacher or self.teacher_url)

    def _check_partial(self, name: str) -> None:
        if not isinstance(self.partial_rollouts, bool):
            raise ConfigError(f"{name}.partial_rollouts must be true or false, got {self.partial_rollouts!r}")
        n = self.partial_swap_step
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"{name}.partial_swap_step must be an integer >= 0 (0 = as soon as published), got {n!r}")
        if not self.partial_rollouts:
            return
        if self.max_staleness < 1:
            raise ConfigError(
                f"{name}.partial_rollouts continues rollouts across weight updates, which a synchronous run has "
                f"none of: set {name}.max_staleness >= 1 (--max-staleness K) or drop --partial-rollouts"
            )
        if self.async_producer == "inline":
            raise ConfigError(
                f'{name}.partial_rollouts is built for async_producer = "thread" or "process" (engines that take the '
                'new weights between decode steps); "inline" has nothing in flight during an update: set '
                f'{name}.async_producer = "thread" (--async-producer thread)'
            )

    def _check_teacher(self, name: str) -> None:
        if self.teacher and self.teacher_url:
            raise ConfigError(f"{name}.teacher and {name}.teacher_url are both set; give one teacher")
        if self.teacher and not (Path(self.teacher) / "config.json").is_file():
            raise ConfigError(f"{name}.teacher={self.teacher!r}: no config.json there; give an HF checkpoint folder")
        if self.teacher_url and not self.teacher_url.startswith(("http://", "https://")):
            raise ConfigError(f"{name}.teacher_url={self.teacher_url!r} must start with http:// or https://")
        if not self.teacher_coef >= 0:
            raise ConfigError(f"{name}.teacher_coef must be >= 0, got {self.teacher_coef}")
        if not self.teacher_timeout > 0:
            raise ConfigError(f"{name}.teacher_timeout must be > 0 seconds, got {self.teacher_timeout}")
        for key in ("teacher_retries", "teacher_concurrency"):
            v = getattr(self, key)
            low = 0 if key == "teacher_retries" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"{name}.{key} must be an integer >= {low}, got {v!r}")
        if self.has_teacher and self.temperature != 1.0:
            raise ConfigError(
                f"{name}.temperature must be 1.0 with a teacher: the student's and the teacher's log-probs are "
                f"compared on the raw distributions, got {self.temperature}"
            )


LossFn = Callable[[Any, Any], Any]


class OnlineHooks(Protocol):
    """What an online algorithm gives the loop (``grpo.GroupRelative``, ``ppo.PPOHooks``).

    - ``needs_reference``: keep a frozen reference model (a KL term).
    - ``advantages(rewards, groups) -> (adv, keep, metrics)``: one advantage per sample, the samples to train on.
    - ``normalizer(tokens, sequences)``: the step's loss divisor from global counts.
    - ``make_loss(tokens_in_step, normalizer)``: the engine loss ``(model, RLBatch) -> (loss_sum, metric_sums)``;
      hooks with ``measures_in_loss = True`` also take ``measure=True`` (the loss then records mismatch/entropy).
    """

    @property
    def needs_reference(self) -> bool: ...

    def advantages(
        self, rewards: list[float], groups: list[int]
    ) -> tuple[list[float], list[int], dict[str, float]]: ...

    def normalizer(self, tokens: float, sequences: int) -> float: ...

    def make_loss(self, tokens_in_step: float, normalizer: float) -> LossFn: ...


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


__all__ = ["LossFn", "OnlineConfig", "OnlineHooks"]
