"""A frozen distillation teacher and the per-token term it adds to an online run's advantages.

- ``TeacherScorer``: the teacher in-process (frozen, on the default device) in its own rollout engine: its log-probs
  are the engine's prompt log-probs of ``prompt + completion`` scored from the completion on
  (``infer/prompt_logprobs.py``), the ``n`` samples of a prompt sharing the prompt's KV through the prefix cache.
- ``TeacherTerm``: ``teacher_coef * (log p_teacher(y_t) - log p_student(y_t) - b)`` per sampled token, from a
  ``TeacherScorer`` (``teacher``) or a ``RemoteTeacher`` (``teacher_url``, ``remote_teacher.py``), opened on the
  first step with the tokenizer check (a local teacher's tokenizer is checked before any weights load too:
  ``check_teacher_tokenizer``, from ``OnlineRun``). ``--algo distill`` uses it as the whole advantage; GRPO / GSPO /
  PPO with a teacher add it to the task reward's advantage (``OnlineRun.step``).

Not here: the loop, the loss (GRPO's clipped token-ratio loss takes per-token advantages as they are).
"""

from __future__ import annotations

import time
from typing import Any

from polyrl.algorithms.online_config import OnlineConfig
from polyrl.algorithms.rl_batch import Sample
from polyrl.errors import ConfigError


def same_vocabulary(teacher: Any, student: Any) -> None:
    """A ConfigError unless the two tokenizers have one vocabulary (skipped where either cannot say)."""
    if not hasattr(student, "get_vocab") or not hasattr(teacher, "get_vocab"):
        return
    if student.get_vocab() != teacher.get_vocab():
        raise ConfigError(
            "distill: the teacher's tokenizer differs from the student's (their vocabularies are not the same); "
            "distillation compares log-probs of the same token ids, so give a teacher of the same tokenizer family"
        )


def check_teacher_tokenizer(path: str, student: Any) -> None:
    """The tokenizer check of a local teacher folder ``path``, with its tokenizer alone: the run calls it before the
    student's weights load (the teacher's weights load on the first step, which found a mismatch only then)."""
    # lazy: tokenizers load only for a run with a teacher
    from polyrl.models.checkpoint import load_tokenizer

    same_vocabulary(load_tokenizer(path), student)


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
        same_vocabulary(self.tokenizer, student)

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


class TeacherTerm:
    """The per-token distillation advantage ``coef * (log p_teacher(y_t) - log p_student(y_t) - b)`` (``b``: the
    step's mean of the difference when ``baseline``), from an in-process (``TeacherScorer``) or a remote
    (``RemoteTeacher``) teacher opened on the first call, its tokenizer checked against the run's."""

    def __init__(self, cfg: OnlineConfig, baseline: bool = True) -> None:
        self.cfg, self.baseline = cfg, baseline
        self.scorer: Any = None

    def open(self, tokenizer: Any = None) -> Any:
        cfg = self.cfg
        if self.scorer is None:
            if cfg.teacher_url:
                # lazy: the HTTP client only for runs with a remote teacher
                from polyrl.algorithms.remote_teacher import RemoteTeacher

                scorer = RemoteTeacher(
                    cfg.teacher_url,
                    timeout=cfg.teacher_timeout,
                    retries=cfg.teacher_retries,
                    concurrency=cfg.teacher_concurrency,
                )
            else:
                scorer = TeacherScorer(cfg.teacher, cfg.teacher_dtype)
            scorer.check_tokenizer(tokenizer)
            self.scorer = scorer
        return self.scorer

    def __call__(self, samples: list[Sample], tokenizer: Any = None) -> tuple[list[list[float]], dict[str, float]]:
        """(per sample, the per-token advantage term; metrics ``distill/reverse_kl``, ``distill/teacher_logprob``,
        ``distill/teacher_s``)."""
        t0 = time.perf_counter()
        teacher = self.open(tokenizer).score(samples)
        diffs = []  # per sample, log p_teacher - log p_student per token: minus the reverse-KL estimate
        for i, (s, t) in enumerate(zip(samples, teacher)):
            if len(t) != len(s.logprobs):
                raise RuntimeError(f"sample {i}: {len(t)} teacher log-probs for {len(s.logprobs)} student log-probs")
            diffs.append([tl - sl for sl, tl in zip(s.logprobs, t)])
        tokens = max(sum(len(d) for d in diffs), 1)
        kl = -sum(sum(d) for d in diffs) / tokens
        # A constant baseline leaves the gradient unbiased (E[grad log p] = 0) and removes the common part of the
        # advantages, which is large and noisy while the student is far from the teacher.
        b = -kl if self.baseline else 0.0
        c = self.cfg.teacher_coef
        adv = [[c * (x - b) for x in d] for d in diffs]
        metrics = {
            "distill/reverse_kl": kl,
            "distill/teacher_logprob": sum(sum(t) for t in teacher) / tokens,
            "distill/teacher_s": time.perf_counter() - t0,
        }
        return adv, metrics


def add_token_term(adv: list[Any], term: list[list[float]]) -> list[list[float]]:
    """Per-sample advantages (a number, or one per token) plus a per-token term: one advantage per token."""
    out = []
    for a, t in zip(adv, term):
        out.append([x + y for x, y in zip(a, t)] if isinstance(a, list) else [a + y for y in t])
    return out


__all__ = ["TeacherScorer", "TeacherTerm", "add_token_term"]
