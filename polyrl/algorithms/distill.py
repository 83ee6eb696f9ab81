"""On-policy distillation as a registered online algorithm (``--algo distill --set distill.teacher=DIR``).

Per RL step the student samples (the online loop), a frozen teacher scores those exact tokens, and each completion
token's advantage is the negative per-token reverse KL estimate ``A_t = teacher_coef * (log p_teacher(y_t) -
log p_student(y_t))`` (plus ``reward_coef`` x the GRPO group advantage of the task reward, broadcast over the
tokens; 0 by default: pure distillation). The update is GRPO's clipped token-ratio loss with these per-token
advantages (``grpo.make_policy_loss``), so with one optimizer step per batch it is the policy gradient of
``-KL(student || teacher)`` on the student's own samples (on-policy distillation, as in GKD / Tinker's recipe).

The teacher runs in-process on the default device, frozen, in its own rollout engine: its log-probs are the
engine's prompt log-probs of ``prompt + completion`` scored from the completion on (``infer/prompt_logprobs.py``),
the ``n`` samples of a prompt sharing the prompt's KV through the prefix cache. The student's log-probs are the
rollout engine's (at the sampling temperature, which must be 1 so both are of the raw distributions). Student and
teacher must share a tokenizer (checked on the first step against the run's tokenizer: same vocabulary). Not here:
the loop (``polyrl.run.online``), a remote teacher (``--teacher-url``, not built yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.algorithms.grpo import PLOT_SERIES, GroupRelative, GRPOConfig
from polyrl.algorithms.rl_batch import Sample
from polyrl.algorithms.spec import AlgorithmSpec
from polyrl.errors import ConfigError


@dataclass
class DistillConfig(GRPOConfig):
    """The ``[distill]`` table: GRPO's settings plus the teacher and the weights of the two advantage terms."""

    teacher: str = ""  # the teacher's HF checkpoint folder (same tokenizer as the student)
    teacher_coef: float = 1.0  # weight of the per-token reverse-KL advantage
    reward_coef: float = 0.0  # weight of the task reward's group-normalised advantage (0: pure distillation)
    teacher_dtype: str | None = None  # None: the default compute dtype of the device (fp32 on the CPU)
    baseline: bool = True  # subtract the step's mean per-token advantage (variance reduction; unbiased)

    def __post_init__(self) -> None:
        super().__post_init__()
        name = self.table_name()
        if not self.teacher:
            raise ConfigError(f"{name}.teacher is empty; give the teacher model folder: --set {name}.teacher=DIR")
        if not (Path(self.teacher) / "config.json").is_file():
            raise ConfigError(f"{name}.teacher={self.teacher!r}: no config.json there; give an HF checkpoint folder")
        if self.temperature != 1.0:
            raise ConfigError(
                f"{name}.temperature must be 1.0: the student's and the teacher's log-probs are compared on the raw "
                f"distributions, got {self.temperature}"
            )
        if self.teacher_coef < 0 or self.reward_coef < 0 or self.teacher_coef + self.reward_coef == 0:
            raise ConfigError(f"{name}.teacher_coef and reward_coef must be >= 0 and not both 0")

    def table_name(self) -> str:
        return "distill"


class TeacherScorer:
    """A frozen teacher in its own rollout engine: ``score(samples)`` -> per sample, the teacher's log-prob of each
    completion token (of each policy token for a masked sample)."""

    def __init__(self, path: str, dtype: str | None = None) -> None:
        # lazy: the teacher's weights and engine load on the first step, not when the config is validated
        import torch

        from polyrl.infer.config import RolloutConfig
        from polyrl.infer.llm import LLM
        from polyrl.models.checkpoint import load_model, load_tokenizer
        from polyrl.platform import device as platform_device

        dev = platform_device.torch_device()
        dt = getattr(torch, dtype) if dtype else None
        if dt is None:
            dt = torch.bfloat16 if dev.type != "cpu" and platform_device.supports_bf16() else torch.float32
        model = load_model(path, dtype=dt, device=dev)
        model.eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.vocab_size = model.config.vocab_size
        self.llm = LLM(model, self.tokenizer, RolloutConfig(num_blocks=None, max_num_seqs=256))

    def check_tokenizer(self, student: Any) -> None:
        """A ConfigError unless the student's tokenizer has the teacher's vocabulary."""
        if student is None or not hasattr(student, "get_vocab"):
            return
        if student.get_vocab() != self.tokenizer.get_vocab():
            raise ConfigError(
                "distill: the teacher's tokenizer differs from the student's (their vocabularies are not the same); "
                "distillation compares log-probs of the same token ids, so give a teacher of the same tokenizer family"
            )

    def score(self, samples: list[Sample]) -> list[list[float]]:
        # lazy: the engine's parameters (infer) only when scoring
        from polyrl.infer.sampling_params import SamplingParams

        prompts, params = [], []
        for s in samples:
            ids = list(s.prompt_ids) + list(s.completion_ids)
            if max(ids) >= self.vocab_size:
                raise ConfigError(f"distill: the student sampled ids past the teacher's vocabulary ({self.vocab_size})")
            prompts.append(ids)
            params.append(
                SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=len(s.prompt_ids))
            )
        out = []
        for s, r in zip(samples, self.llm.generate(prompts, params)):
            lps = r.prompt_logprobs.logprobs[len(s.prompt_ids) :]
            if s.mask is not None:
                lps = [lp for lp, m in zip(lps, s.mask) if m]
            out.append([float(x) for x in lps])
        return out


class Distill(GroupRelative):
    """The loop hooks of on-policy distillation: ``sample_advantages`` gives per-token advantages."""

    cfg: DistillConfig

    def __init__(self, cfg: DistillConfig) -> None:
        super().__init__(cfg)
        self.teacher: TeacherScorer | None = None

    def sample_advantages(
        self, samples: list[Sample], rewards: list[float], groups: list[int], tokenizer: Any = None
    ) -> tuple[list[list[float]], list[int], dict[str, float]]:
        """(per-token advantages per sample, samples to train on, metrics) from the teacher's scores."""
        if self.teacher is None:
            self.teacher = TeacherScorer(self.cfg.teacher, self.cfg.teacher_dtype)
            self.teacher.check_tokenizer(tokenizer)
        cfg = self.cfg
        base, keep, metrics = super().advantages(rewards, groups) if cfg.reward_coef else ([0.0] * len(samples), [], {})
        teacher = self.teacher.score(samples)
        diffs = []  # per sample, log p_teacher - log p_student per token: minus the reverse-KL estimate
        for i, (s, t) in enumerate(zip(samples, teacher)):
            if len(t) != len(s.logprobs):
                raise RuntimeError(f"sample {i}: {len(t)} teacher log-probs for {len(s.logprobs)} student log-probs")
            diffs.append([tl - sl for sl, tl in zip(s.logprobs, t)])
        tokens = sum(len(d) for d in diffs)
        kl_sum = -sum(sum(d) for d in diffs)
        # A constant baseline leaves the gradient unbiased (E[grad log p] = 0) and removes the common part of the
        # advantages, which is large and noisy while the student is far from the teacher.
        b = -kl_sum / max(tokens, 1) if cfg.baseline else 0.0
        adv = [[cfg.teacher_coef * (x - b) + cfg.reward_coef * base[i] for x in d] for i, d in enumerate(diffs)]
        keep = keep if cfg.reward_coef and cfg.filter_groups else list(range(len(samples)))
        metrics = dict(metrics)
        metrics["reverse_kl"] = kl_sum / max(tokens, 1)
        metrics["teacher_logprob"] = sum(sum(t) for t in teacher) / max(tokens, 1)
        return adv, keep, metrics


SPEC = AlgorithmSpec(
    name="distill",
    description="on-policy distillation: a frozen teacher scores the student's samples, per-token reverse KL",
    config_cls=DistillConfig,
    loop="online",
    hooks=Distill,
    plot_series=(*PLOT_SERIES, "reverse_kl"),
)
