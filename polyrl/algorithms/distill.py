"""On-policy distillation as a registered online algorithm (``--algo distill --set distill.teacher=DIR``).

Per RL step the student samples (the online loop), a frozen teacher scores those exact tokens, and each completion
token's advantage is the negative per-token reverse KL estimate ``A_t = teacher_coef * (log p_teacher(y_t) -
log p_student(y_t))`` (plus ``reward_coef`` x the GRPO group advantage of the task reward, broadcast over the
tokens; 0 by default: pure distillation). The update is GRPO's clipped token-ratio loss with these per-token
advantages (``grpo.make_policy_loss``), so with one optimizer step per batch it is the policy gradient of
``-KL(student || teacher)`` on the student's own samples (on-policy distillation, as in GKD / Tinker's recipe).

The teacher (``polyrl.algorithms.teacher``) runs in-process on the default device, frozen, in its own rollout engine
(its log-probs: the engine's prompt log-probs of ``prompt + completion``), or behind a server. The student's
log-probs are the rollout engine's (at the sampling temperature, which must be 1 so both are of the raw
distributions). Student and teacher must share a tokenizer (checked on the first step against the run's tokenizer).
A remote teacher (``--teacher-url``: ``polyrl serve`` or vLLM) is ``polyrl.algorithms.remote_teacher``.

``TeacherTerm`` is the per-token term on its own: GRPO / GSPO / PPO runs given ``--teacher`` / ``--teacher-url`` add
it, times ``teacher_coef``, to their task-reward advantages (``OnlineRun.step``; PPO after GAE and whitening).
Not here: the loop (``polyrl.run.online``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl.algorithms.grpo import PLOT_SERIES, GroupRelative, GRPOConfig
from polyrl.algorithms.rl_batch import Sample
from polyrl.algorithms.spec import AlgorithmSpec
from polyrl.algorithms.teacher import TeacherTerm, add_token_term
from polyrl.errors import ConfigError


@dataclass
class DistillConfig(GRPOConfig):
    """The ``[distill]`` table: GRPO's settings (the teacher's among them: ``teacher`` / ``teacher_url``,
    ``teacher_coef``, ... of ``OnlineConfig``) plus the weight of the task reward's term and the baseline."""

    reward_coef: float = 0.0  # weight of the task reward's group-normalised advantage (0: pure distillation)
    baseline: bool = True  # subtract the step's mean per-token advantage (variance reduction; unbiased)

    def __post_init__(self) -> None:
        super().__post_init__()
        name = self.table_name()
        if not self.has_teacher:
            raise ConfigError(
                f"{name}.teacher is empty; give the teacher model folder (--teacher DIR) or a server "
                "(--teacher-url URL)"
            )
        if self.teacher_coef < 0 or self.reward_coef < 0 or self.teacher_coef + self.reward_coef == 0:
            raise ConfigError(f"{name}.teacher_coef and reward_coef must be >= 0 and not both 0")

    def table_name(self) -> str:
        return "distill"


class Distill(GroupRelative):
    """The loop hooks of on-policy distillation: ``sample_advantages`` gives per-token advantages."""

    cfg: DistillConfig

    def __init__(self, cfg: DistillConfig) -> None:
        super().__init__(cfg)
        self.teacher = None  # not the generic teacher term of GroupRelative: the teacher IS the advantage here
        self.term = TeacherTerm(cfg, cfg.baseline)

    def sample_advantages(
        self, samples: list[Sample], rewards: list[float], groups: list[int], tokenizer: Any = None
    ) -> tuple[list[list[float]], list[int], dict[str, float]]:
        """(per-token advantages per sample, samples to train on, metrics) from the teacher's scores."""
        cfg = self.cfg
        base, keep, metrics = super().advantages(rewards, groups) if cfg.reward_coef else ([0.0] * len(samples), [], {})
        term, tm = self.term(samples, tokenizer)
        adv = add_token_term([cfg.reward_coef * x for x in base], term)
        keep = keep if cfg.reward_coef and cfg.filter_groups else list(range(len(samples)))
        metrics = {**metrics, **tm}
        metrics["reverse_kl"] = tm["distill/reverse_kl"]  # the names the plot and earlier runs use
        metrics["teacher_logprob"] = tm["distill/teacher_logprob"]
        return adv, keep, metrics


SPEC = AlgorithmSpec(
    name="distill",
    description="on-policy distillation: a frozen teacher scores the student's samples, per-token reverse KL",
    config_cls=DistillConfig,
    loop="online",
    hooks=Distill,
    plot_series=(*PLOT_SERIES, "reverse_kl"),
)
