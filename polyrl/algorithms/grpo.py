"""GRPO as a registered online algorithm: the ``[grpo]`` config, group-normalised advantages and the clipped
token-ratio loss against REAL old log-probs (the rollout engine's, or the trainer's recompute before the update).

Per RL step (the loop is ``polyrl.run.online``): sample ``samples_per_prompt`` completions per prompt, score
them, ``A_i = (r_i - mean_group) / (std_group + eps)`` (``scale_rewards="none"``: no std division, Dr. GRPO),
optionally drop groups whose rewards all agree (``filter_groups``), then ``ppo_epochs`` passes over ``mini_batches``
optimizer steps of the loss ``max(-A r_t, -A clip(r_t, 1-clip_low, 1+clip_high))`` (+ ``kl_coef`` x KL(k1|k3) to
the initial weights, x truncated IS weights with ``tis_cap``), aggregated by ``loss_agg`` (``polyrl.algorithms.
losses``). With one epoch of one mini-batch and ``old_logprobs="recompute"`` the ratio is exactly 1 and the update is
REINFORCE with group baselines; more optimizer steps per batch move the ratio and clipping applies.

``GSPOConfig`` (``polyrl.algorithms.gspo``) subclasses this config with the sequence-level ratio. Not here: the loop,
rewards, checkpointing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polyrl.algorithms.advantages import group_advantages, informative_groups
from polyrl.algorithms.losses import AGGREGATIONS, KL_ESTIMATORS, aggregate_sum, policy_loss
from polyrl.algorithms.losses import normalizer as loss_normalizer
from polyrl.algorithms.online_config import OnlineConfig
from polyrl.algorithms.rl_batch import RLBatch, completion_logprobs
from polyrl.algorithms.spec import AlgorithmSpec
from polyrl.algorithms.teacher import TeacherTerm
from polyrl.errors import ConfigError

OLD_LOGPROBS = ("rollout", "recompute")
REWARD_SCALES = ("std", "none")
PLOT_SERIES = (
    "reward",
    "eval_reward",
    "eval_pass@*",  # --eval-n K: eval_pass@1 .. eval_pass@K in one panel
    "eval_length",
    "response_length",
    "kl",
    "mismatch_mean",
    "entropy",
    "clip_fraction",
    "distill/reverse_kl",
)


@dataclass
class GRPOConfig(OnlineConfig):
    """The ``[grpo]`` table: the rollout/loop settings of ``OnlineConfig`` plus the loss."""

    RATIO = "token"  # class constant, not a setting: GSPO's subclass uses "sequence"

    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO's clip-higher: e.g. 0.28
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | constant (Dr. GRPO)
    scale_rewards: str = "std"  # std (GRPO) | none (Dr. GRPO)
    adv_eps: float = 1e-6
    filter_groups: bool = False  # drop groups whose rewards all agree
    kl_coef: float = 0.0  # > 0 keeps a frozen copy of the initial weights as the reference
    kl_estimator: str = "k3"
    old_logprobs: str = "rollout"  # rollout (the engine's) | recompute (the trainer's, before the update)
    # truncated importance sampling cap (needs old_logprobs="recompute"; an async run, max_staleness > 0, always
    # recomputes and caps pi_prox / pi_behaviour at tis_cap, default 2.0: the decoupled objective)
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        name = self.table_name()
        if not (0.0 <= self.clip_low < 1.0) or not self.clip_high >= 0.0:
            raise ConfigError(
                f"{name}.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.loss_agg not in AGGREGATIONS:
            raise ConfigError(f"{name}.loss_agg={self.loss_agg!r}: use one of {', '.join(AGGREGATIONS)}")
        if self.scale_rewards not in REWARD_SCALES:
            raise ConfigError(f"{name}.scale_rewards={self.scale_rewards!r}: use 'std' or 'none'")
        if self.kl_coef < 0:
            raise ConfigError(f"{name}.kl_coef must be >= 0 (0 turns the KL penalty and reference model off)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"{name}.kl_estimator={self.kl_estimator!r}: use one of {', '.join(KL_ESTIMATORS)}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ConfigError(f"{name}.old_logprobs={self.old_logprobs!r}: use 'rollout' or 'recompute'")
        if self.tis_cap is not None:
            if not self.tis_cap > 0:
                raise ConfigError(f"{name}.tis_cap must be > 0 (e.g. 2.0) or unset")
            if self.old_logprobs != "recompute" and self.max_staleness == 0:  # async: always the recompute
                raise ConfigError(
                    f"{name}.tis_cap corrects the trainer's old log-probs towards the rollout engine's; "
                    f'set {name}.old_logprobs = "recompute" with it'
                )

    def table_name(self) -> str:
        return "grpo"


class GroupRelative:
    """The loop hooks of GRPO-family algorithms (GRPO, GSPO, Dr. GRPO, DAPO-style settings)."""

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        # --teacher / --teacher-url: the per-token distillation term added to the advantages (OnlineRun.step)
        self.teacher = TeacherTerm(cfg) if cfg.has_teacher else None

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def advantages(self, rewards: list[float], groups: list[int]) -> tuple[list[float], list[int], dict[str, float]]:
        """(advantage per sample, indices of the samples to train on, metrics)."""
        adv = group_advantages(rewards, groups, self.cfg.scale_rewards, self.cfg.adv_eps)
        all_groups = set(groups)
        keep_groups = informative_groups(rewards, groups) if self.cfg.filter_groups else all_groups
        keep = [i for i, g in enumerate(groups) if g in keep_groups]
        solved = informative_groups(rewards, groups)
        return (
            adv,
            keep,
            {
                "groups_filtered": float(len(all_groups) - len(keep_groups)),
                "groups_uniform_fraction": 1.0 - len(solved) / max(1, len(all_groups)),
            },
        )

    def normalizer(self, tokens: float, sequences: int) -> float:
        return loss_normalizer(self.cfg.loss_agg, tokens, sequences, self.cfg.max_new_tokens)

    measures_in_loss = True  # make_loss(..., measure=True) reports mismatch and entropy from the training forward

    def make_loss(self, tokens_in_step: float, normalizer: float, measure: bool = False):
        """The step's loss: one ``PolicyLoss`` per ``measure`` kept across steps and refilled (``set_step``), so a
        CUDA-graphed training step captured with it replays in every later step."""
        losses = self.__dict__.setdefault("_losses", {})
        loss = losses.get(bool(measure))
        if loss is None:
            loss = losses[bool(measure)] = make_policy_loss(self.cfg, tokens_in_step, normalizer, measure, graphed=True)
            return loss
        return loss.set_step(tokens_in_step, normalizer)


class PolicyLoss:
    """The engine loss ``(model, RLBatch) -> (loss_sum, metric_sums)`` of one optimizer step (``make_policy_loss``).
    With ``measure``, the same forward also measures the rollout/trainer mismatch against ``fields["rollout_logp"]``
    and the entropy (metrics ``mismatch_mean``, ``entropy``; the running max in ``mismatch_max``, a device tensor):
    exact "before the update" values whenever the step's forwards all precede its one optimizer update.

    Graph-safe (``graph_safe``, ``train/graphed_step.py``): no host sync (the completion rows come from the batch's
    packed ``targets``, not ``nonzero``), nothing read from the batch on the host but tensor shapes and
    ``max_seqlen``, and the step's constants live in device tensors: ``set_step`` refills the metric scale and
    zeroes the running mismatch max in place, so ONE loss object serves every step (``GroupRelative.make_loss``
    keeps it) and the engine replays the step captured with it. ``graphed=False`` is the eager path it replaced
    (``nonzero`` per micro-batch, Python-float scale; same numbers): the reference of the tests and of
    ``polyrl bench grpo --train-phase``'s "before" row."""

    def __init__(
        self, cfg: GRPOConfig, tokens_in_step: float, step_normalizer: float, measure: bool = False, graphed=False
    ):
        self.cfg = cfg
        self.measure = measure
        self.graphed = bool(graphed)
        self.graph_safe = self.graphed
        self._scale_t: torch.Tensor | None = None  # fp32 0-dim, on the batches' device
        self._max_t: torch.Tensor | None = None  # the step's running max |rollout - trainer| (measure)
        self._eager_max: torch.Tensor | None = None
        self.set_step(tokens_in_step, step_normalizer)

    def set_step(self, tokens_in_step: float, step_normalizer: float) -> PolicyLoss:
        """The next optimizer step's constants (in place: a captured step reads the same device tensors)."""
        self.scale = step_normalizer / max(tokens_in_step, 1.0)
        if self._scale_t is not None:
            self._scale_t.fill_(self.scale)
        if self._max_t is not None:
            self._max_t.zero_()
        self._eager_max = None
        return self

    @property
    def mismatch_max(self) -> torch.Tensor | None:
        """The running max over this step's micro-batches so far (a device scalar; None: not measured yet)."""
        return self._max_t if self.graphed else self._eager_max

    def _step_tensors(self, dev: torch.device) -> torch.Tensor:
        if self._scale_t is None or self._scale_t.device != dev:
            self._scale_t = torch.full((), float(self.scale), dtype=torch.float32, device=dev)
            self._max_t = torch.zeros((), dtype=torch.float32, device=dev) if self.measure else None
        return self._scale_t

    def __call__(self, model: nn.Module, batch: RLBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        if self.graphed:
            scale: Any = self._step_tensors(batch.mask.device)
        else:
            scale = self.scale
            batch = dataclasses.replace(batch, targets=None)  # the replaced path: nonzero of the mask
        logp, ent = completion_logprobs(model, batch, cfg.temperature, entropy=self.measure)
        f = batch.fields
        b = batch.cu_seqlens.shape[0] - 1  # = num_sequences, from a shape (a replayed batch has its own ids)
        per_tok, info = policy_loss(
            logp,
            f["old_logp"],
            f["adv"],
            batch.mask,
            batch.seq_index,
            b,
            ratio=cfg.RATIO,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            ref_logp=f.get("ref_logp"),
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            is_weights=f.get("is_w"),
        )
        loss_sum = aggregate_sum(per_tok, batch.mask, batch.seq_index, b, cfg.loss_agg)  # no host sync
        m = batch.mask
        metrics = {
            "clip_fraction": (info["clipped"] * m).sum() * scale,
            "ratio_mean": (info["ratio"] * m).sum() * scale,
        }
        if "kl" in info:
            metrics["kl"] = (info["kl"] * m).sum() * scale
        if self.measure:
            diff = (logp.detach() - f["rollout_logp"]).abs() * m
            metrics["mismatch_mean"] = diff.sum() * scale
            metrics["entropy"] = (ent * m).sum() * scale
            top = diff.max() if diff.numel() else diff.new_zeros(())
            if self.graphed:  # diff >= 0, so a max from 0 is the max over the step
                torch.maximum(self._max_t, top, out=self._max_t)
            else:
                self._eager_max = top if self._eager_max is None else torch.maximum(self._eager_max, top)
        return loss_sum, metrics


def make_policy_loss(
    cfg: GRPOConfig, tokens_in_step: float, step_normalizer: float, measure: bool = False, graphed: bool = False
):
    """The engine loss of one optimizer step (see ``PolicyLoss``). The batch's fields: ``adv``, ``old_logp``,
    optional ``ref_logp``, ``is_w`` and (with ``measure``) ``rollout_logp`` (per token). Token metrics (clip fraction,
    ratio, KL, mismatch, entropy) are pre-scaled so the engine's division by ``step_normalizer`` leaves means over
    the step's tokens. ``graphed=True``: graph-safe, to be reused for the next steps with ``set_step`` (the CUDA-graphed
    step replays then; ``GroupRelative.make_loss`` does this)."""
    return PolicyLoss(cfg, tokens_in_step, step_normalizer, measure, graphed)


SPEC = AlgorithmSpec(
    name="grpo",
    description="GRPO: group-normalised advantages, clipped token ratio vs real old log-probs, colocated rollout",
    config_cls=GRPOConfig,
    loop="online",
    hooks=GroupRelative,
    plot_series=PLOT_SERIES,
)
