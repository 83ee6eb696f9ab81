"""PPO with a learned critic as a registered online algorithm: the ``[ppo]`` config, the value loss and
the hooks of the actor-critic loop (``polyrl.run.actor_critic``: ``OnlineRun`` with PPO's advantage stage and a
critic update).

Per RL step: sample completions (``samples_per_prompt``, default 1: PPO needs no groups) and score them; one no-grad
pass gives the trainer's log-probs (mismatch, ``old_logprobs``), the reference's (only with ``kl_coef`` > 0) and the
critic's values ``V_t`` of every completion token; token rewards = the score on the last token ``- kl_coef x KL_t``
(KL in the reward, estimator ``kl_estimator``); GAE(``gamma``, ``lam``) -> advantages and returns
(``polyrl.algorithms.gae``); advantages whitened over the step's tokens (``whiten_advantages``). Then, for
``ppo_epochs`` x ``mini_batches``: a critic step on the clipped value loss
``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` (``value_clip`` = c; 0: unclipped), and, once
``critic_warmup_steps`` RL steps have passed, a policy step on the clipped ratio loss of ``losses.policy_loss``
(the same math as GRPO), aggregated by ``loss_agg``.

The loop with the critic is ``polyrl.run.actor_critic``. The critic is a separate model
(``polyrl.models.value_head``): initialised from ``critic_model`` or the policy
checkpoint with a zero head, trained by its own ``TrainEngine`` with ``critic_lr`` (default ``optim.lr``) and the
run's other optimizer settings. Its checkpoints go to ``<out>/critic/checkpoints/step-*`` (saved before the
policy's, so every policy checkpoint has its critic; resume restores both), the final critic to
``<out>/critic/final`` (``AutoModelForTokenClassification`` loads it).

Under torchrun (``--nproc-per-node N``) the critic is FSDP2-sharded like the policy and each rank works on its
share of each mini-batch (``OnlineRun.share`` / ``even_out``): values, GAE and the updates on its own samples;
advantage whitening and the metrics use global sums; critic checkpoints are sharded.
Not here: the loop and the critic (``polyrl.run.actor_critic``), rewards, the policy-loss math (``losses``), GAE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from polyrl.algorithms.losses import AGGREGATIONS, KL_ESTIMATORS, aggregate, policy_loss
from polyrl.algorithms.losses import normalizer as loss_normalizer
from polyrl.algorithms.online_config import OnlineConfig
from polyrl.algorithms.rl_batch import RLBatch, completion_logprobs
from polyrl.algorithms.spec import AlgorithmSpec
from polyrl.algorithms.teacher import TeacherTerm
from polyrl.errors import ConfigError
from polyrl.train.losses import attention_metadata

OLD_LOGPROBS = ("rollout", "recompute")
PLOT_SERIES = (
    "reward",
    "eval_reward",
    "eval_pass@*",  # --eval-n K: eval_pass@1 .. eval_pass@K in one panel
    "eval_length",
    "value_loss",
    "explained_variance",
    "kl",
    "mismatch_mean",
    "clip_fraction",
    "distill/reverse_kl",
)


@dataclass
class PPOConfig(OnlineConfig):
    """The ``[ppo]`` table: the rollout/loop settings of ``OnlineConfig`` plus PPO's."""

    samples_per_prompt: int = 1
    prompts_per_step: int = 32
    clip_low: float = 0.2
    clip_high: float = 0.2
    value_clip: float | None = 0.2  # 0 or None: unclipped value loss
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    kl_coef: float = 0.0  # KL penalty in the reward; > 0 keeps a frozen copy of the initial weights
    kl_estimator: str = "k1"
    loss_agg: str = "token-mean"
    old_logprobs: str = "rollout"  # rollout (the engine's) | recompute (the trainer's, before the update)
    critic_model: str | None = None  # HF folder (a critic or a causal LM); None: the policy checkpoint
    critic_lr: float | None = None  # None: optim.lr
    critic_warmup_steps: int = 0  # RL steps that update only the critic

    def table_name(self) -> str:
        return "ppo"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.table_name()
        if not (0.0 <= self.clip_low < 1.0) or not self.clip_high >= 0.0:
            raise ConfigError(
                f"{n}.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.value_clip is not None and not self.value_clip >= 0:
            raise ConfigError(f"{n}.value_clip must be >= 0 (e.g. 0.2; 0 = an unclipped value loss)")
        for key in ("gamma", "lam"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"{n}.{key} must be in [0, 1], got {v!r}")
        if not self.kl_coef >= 0:
            raise ConfigError(f"{n}.kl_coef must be >= 0 (0 turns the KL penalty and the reference model off)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"{n}.kl_estimator={self.kl_estimator!r}: use one of {', '.join(KL_ESTIMATORS)}")
        if self.loss_agg not in AGGREGATIONS:
            raise ConfigError(f"{n}.loss_agg={self.loss_agg!r}: use one of {', '.join(AGGREGATIONS)}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ConfigError(f"{n}.old_logprobs={self.old_logprobs!r}: use 'rollout' or 'recompute'")
        if self.critic_lr is not None and not self.critic_lr > 0:
            raise ConfigError(f"{n}.critic_lr must be > 0 (e.g. 1e-5), or unset to use optim.lr")
        w = self.critic_warmup_steps
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ConfigError(f"{n}.critic_warmup_steps must be a non-negative integer, got {w!r}")


# ---- losses -------------------------------------------------------------------------------------
def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``[T]`` and the indicator ``[T]`` of tokens where the clipped term is larger
    (its gradient is zero there): ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype).detach()


def make_value_loss(cfg: PPOConfig, tokens_in_step: float, step_normalizer: float):
    """The critic's engine loss ``(critic, RLBatch) -> (loss_sum, metric_sums)`` (token mean over the step)."""
    scale = step_normalizer / max(tokens_in_step, 1.0)

    def loss_fn(model: nn.Module, batch: RLBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v = model.value(batch.input_ids, batch.position_ids, attention_metadata(batch))  # [T]
        f, m = batch.fields, batch.mask
        per_tok, clipped = value_loss(v, f["old_value"], f["returns"], cfg.value_clip or None)
        loss_sum, _ = aggregate(per_tok, m, batch.seq_index, batch.num_sequences, "token-mean")
        metrics = {"value_clip_fraction": (clipped * m).sum() * scale, "value_pred": (v.detach() * m).sum() * scale}
        return loss_sum, metrics

    return loss_fn


def make_policy_loss(cfg: PPOConfig, tokens_in_step: float, step_normalizer: float):
    """The policy's engine loss: ``losses.policy_loss`` (token ratio, asymmetric clip) with the batch's ``adv`` and
    ``old_logp`` fields, aggregated by ``loss_agg``; clip fraction and ratio as means over the step's tokens."""
    scale = step_normalizer / max(tokens_in_step, 1.0)

    def loss_fn(model: nn.Module, batch: RLBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, _ = completion_logprobs(model, batch, cfg.temperature)
        f, m, b = batch.fields, batch.mask, batch.num_sequences
        per_tok, info = policy_loss(
            logp,
            f["old_logp"],
            f["adv"],
            m,
            batch.seq_index,
            b,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            is_weights=f.get("is_w"),  # async runs: the decoupled objective's truncated pi_prox / pi_behaviour
        )
        loss_sum, _ = aggregate(per_tok, m, batch.seq_index, b, cfg.loss_agg, cfg.max_new_tokens)
        metrics = {
            "clip_fraction": (info["clipped"] * m).sum() * scale,
            "ratio_mean": (info["ratio"] * m).sum() * scale,
        }
        return loss_sum, metrics

    return loss_fn


class PPOHooks:
    """The ``OnlineRun`` hooks of PPO: the score passes through as the per-sample "advantage"
    (``ActorCriticRun.prepare`` turns it into token advantages), every sample is trained on."""

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg
        # --teacher / --teacher-url: the per-token distillation term, added after GAE and whitening (ActorCriticRun)
        self.teacher = TeacherTerm(cfg) if cfg.has_teacher else None

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def advantages(self, rewards: list[float], groups: list[int]) -> tuple[list[float], list[int], dict[str, float]]:
        return list(rewards), list(range(len(rewards))), {}

    def normalizer(self, tokens: float, sequences: int) -> float:
        return loss_normalizer(self.cfg.loss_agg, tokens, sequences, self.cfg.max_new_tokens)

    def make_loss(self, tokens_in_step: float, normalizer: float):
        return make_policy_loss(self.cfg, tokens_in_step, normalizer)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over tokens (1: perfect critic, 0: no better than a constant); NaN if Var(R)=0."""
    var = returns.var(unbiased=False)
    return float(1.0 - (returns - values).var(unbiased=False) / var) if var > 0 else float("nan")


SPEC = AlgorithmSpec(
    name="ppo",
    description="PPO: a critic (value head), GAE, clipped policy and value losses, critic warm-up, colocated rollout",
    config_cls=PPOConfig,
    loop="actor_critic",
    hooks=PPOHooks,
    plot_series=PLOT_SERIES,
)
