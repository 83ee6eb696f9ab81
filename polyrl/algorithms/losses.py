"""Policy-loss mathematics shared by GRPO, GSPO and PPO: clipped ratios, loss aggregation, KL estimators, truncated
importance sampling. Pure tensor functions, no model, no batches, no config.

Layout: every per-token tensor is flat ``[T]`` (a packed micro-batch, or a padded ``[B, L]`` batch flattened), with
``mask [T]`` (1.0 on tokens that count: the sampled completion tokens, 0.0 on prompt tokens and padding) and
``seq_index [T]`` int64 (which sequence each token belongs to, ``0 .. num_seqs-1``). Masked positions may hold any
value (even inf/NaN): they are selected away with ``torch.where`` before any arithmetic reaches the sum.

Conventions (all log-probs are ``log_softmax(logits / T)`` at the sampled token):

- token ratio ``r_t = exp(logp_t - old_t)``; PPO/GRPO per-token loss ``max(-A r_t, -A clip(r_t, 1-lo, 1+hi))``
  (``lo``/``hi`` asymmetric: DAPO's clip-higher). The clipped branch is active (zero gradient) when ``A > 0`` and
  ``r > 1+hi``, or ``A < 0`` and ``r < 1-lo``.
- GSPO: ``s_i = exp(mean_{t in i}(logp_t - old_t))`` (length-normalised sequence ratio), used per token as
  ``s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])`` (GSPO-token: the value is ``s_i``, the gradient flows through each
  token's log-prob), clipped with the sequence ratio's own (much smaller) range.
- aggregation -> ``(loss_sum, normalizer)`` with the step loss = ``sum of loss_sum over micro-batches / normalizer``:
  ``token-mean`` (sum over tokens / tokens), ``seq-mean-token-mean`` (per-sequence token mean, averaged over
  sequences), ``constant`` (Dr. GRPO: sum over tokens / (max_new_tokens * sequences), no length bias).
- KL to a reference (samples drawn from the current policy): ``k1 = logp - ref``, ``k3 = exp(ref - logp) - (ref -
  logp) - 1`` (Schulman's unbiased, non-negative estimator).
- truncated importance sampling (rollout/train mismatch): ``w_t = min(exp(old_t - rollout_t), cap)``, detached,
  multiplies the per-token policy loss (``old`` recomputed by the trainer, ``rollout`` from the rollout engine).
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "constant")
KL_ESTIMATORS = ("k1", "k3")


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where mask is set, 0 elsewhere (safe against inf/NaN in padding)."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


def clipped_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO/GRPO per-token loss ``[T]``, the clip indicator ``[T]`` (1.0 where the clipped branch is taken and the
    token gets no gradient) and the ratio ``[T]``. ``advantages`` is per token (a sequence's value repeated)."""
    ratio = torch.exp(logp - old_logp)
    return _clip(ratio, advantages, clip_low, clip_high)


def _clip(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    active = (clipped > unclipped).to(ratio.dtype).detach()
    return loss, active, ratio


def sequence_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """``[num_seqs]``: mean over each sequence's masked tokens of ``logp - old_logp`` (0 for an empty sequence)."""
    diff = _masked(logp - old_logp, mask)
    sums = torch.zeros(num_seqs, dtype=diff.dtype, device=diff.device).index_add(0, seq_index, diff)
    counts = torch.zeros(num_seqs, dtype=diff.dtype, device=diff.device).index_add(0, seq_index, mask.to(diff.dtype))
    return sums / counts.clamp(min=1.0)


def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO-token per-token loss ``[T]``, clip indicator ``[T]`` and per-token ratio (= its sequence's ratio)."""
    seq_log_ratio = sequence_log_ratio(logp, old_logp, mask, seq_index, num_seqs)  # [num_seqs]
    # Clamp the exponent like verl does, so a diverged sequence cannot overflow exp (value only; grads unaffected).
    s = torch.exp(seq_log_ratio.detach().clamp(max=10.0))[seq_index]  # [T]
    ratio = s * torch.exp(logp - logp.detach())
    return _clip(ratio, advantages, clip_low, clip_high)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate ``[T]`` from samples of pi: ``k1`` or ``k3`` (see the module docstring)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-20.0, 20.0)  # keeps exp finite when the policies drift far apart
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old_train / pi_rollout, cap)`` per token, detached."""
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    mode: str = "token-mean",
    max_new_tokens: int | None = None,
) -> tuple[torch.Tensor, float]:
    """``(loss_sum, normalizer)`` of a per-token loss over one batch; the mean loss is ``loss_sum / normalizer``.
    Over several micro-batches of one optimizer step, sum the ``loss_sum`` s and divide by ``normalizer(...)`` of
    the whole step. Sequences without a masked token do not count."""
    m = mask.to(per_token.dtype)
    x = _masked(per_token, m)
    tokens = float(m.sum())
    counts = torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_index, m)
    seqs = int((counts > 0).sum())
    if mode == "seq-mean-token-mean":
        sums = torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_index, x)
        return (sums / counts.clamp(min=1.0)).sum(), normalizer(mode, tokens, seqs, max_new_tokens)
    if mode in ("token-mean", "constant"):
        return x.sum(), normalizer(mode, tokens, seqs, max_new_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGGREGATIONS}")


def aggregate_sum(
    per_token: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, mode: str = "token-mean"
) -> torch.Tensor:
    """``aggregate(...)[0]`` without the normaliser: the same device ops and no host sync (a CUDA-graphed step's
    loss may not read a tensor on the host; ``aggregate``'s token and sequence counts do)."""
    m = mask.to(per_token.dtype)
    x = _masked(per_token, m)
    if mode == "seq-mean-token-mean":
        counts = torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_index, m)
        sums = torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_index, x)
        return (sums / counts.clamp(min=1.0)).sum()
    if mode in ("token-mean", "constant"):
        return x.sum()
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGGREGATIONS}")


def token_weights(mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, mode: str) -> torch.Tensor:
    """Per-token weights ``[T]`` such that ``aggregate(x)[0] == (x * weights).sum()`` (masked tokens weigh 0):
    1 for ``token-mean``/``constant``, 1/len(sequence) for ``seq-mean-token-mean``."""
    m = mask.to(torch.float32)
    if mode == "seq-mean-token-mean":
        counts = torch.zeros(num_seqs, dtype=m.dtype, device=m.device).index_add(0, seq_index, m)
        return m / counts.clamp(min=1.0)[seq_index]
    if mode in ("token-mean", "constant"):
        return m
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGGREGATIONS}")


def normalizer(mode: str, num_tokens: float, num_seqs: int, max_new_tokens: int | None = None) -> float:
    """The divisor of a step's summed loss: its token count, sequence count, or ``max_new_tokens * sequences``."""
    if mode == "token-mean":
        return float(num_tokens)
    if mode == "seq-mean-token-mean":
        return float(num_seqs)
    if mode == "constant":
        if not max_new_tokens:
            raise ValueError("the 'constant' (Dr. GRPO) aggregation needs max_new_tokens")
        return float(max_new_tokens * num_seqs)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGGREGATIONS}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    *,
    ratio: str = "token",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full per-token RL loss ``[T]`` (clipped policy term x optional IS weights + ``kl_coef`` x KL) and per-token
    diagnostics ``{"clipped", "ratio", "kl"}`` (``[T]``, detached). ``ratio``: "token" (GRPO/PPO) or "sequence"
    (GSPO). Aggregate the result with ``aggregate``."""
    if ratio == "token":
        loss, clipped, r = clipped_token_loss(logp, old_logp, advantages, clip_low, clip_high)
    elif ratio == "sequence":
        loss, clipped, r = gspo_token_loss(logp, old_logp, advantages, mask, seq_index, num_seqs, clip_low, clip_high)
    else:
        raise ValueError(f"unknown ratio level {ratio!r}; use 'token' or 'sequence'")
    if is_weights is not None:
        loss = loss * is_weights
    info = {"clipped": clipped, "ratio": r.detach()}
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        info["kl"] = kl.detach()
        if kl_coef:
            loss = loss + kl_coef * kl
    return loss, info


__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "aggregate",
    "aggregate_sum",
    "clipped_token_loss",
    "gspo_token_loss",
    "kl_penalty",
    "normalizer",
    "policy_loss",
    "sequence_log_ratio",
    "tis_weights",
    "token_weights",
]
