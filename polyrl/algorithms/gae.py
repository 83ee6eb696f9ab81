"""Generalised advantage estimation for PPO: token-level rewards, GAE(gamma, lambda) over masked token rows, and
masked whitening. Pure tensor functions on padded ``[B, L]`` rows (one row per completion, right-padded or with
holes), no model and no config.

- ``token_rewards``: the sequence's scalar reward on its last valid token, minus ``kl_coef`` x the per-token KL
  estimate on every valid token (the KL-in-reward form of InstructGPT / verl ``use_kl_in_reward``).
- ``gae``: ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lambda * A_next``, where "next" is
  the next VALID token of the row (masked positions are skipped, not discounted) and the value after the last valid
  token is 0 (the completion ends the episode; a length-truncated completion is treated the same, as verl and TRL
  do). Returns ``returns = A + V`` (the critic's targets). gamma = lambda = 1 gives ``A_t = sum_{k>=t} r_k - V_t``;
  lambda = 0 gives the one-step TD error.
- ``whiten``: ``(x - mean) / sqrt(var + eps)`` over the valid tokens of the whole batch (unbiased var, as verl);
  ``shift_mean=False`` keeps the mean.
Values at masked positions of the outputs are 0. Not here: the value loss (``ppo.py``), the critic.
"""

from __future__ import annotations

import torch


def _check(mask: torch.Tensor, *xs: torch.Tensor) -> None:
    for x in xs:
        if x.shape != mask.shape:
            raise ValueError(f"shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}; all inputs are [B, L]")


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """``[B, L]`` fp32 per-token rewards: ``scores [B]`` on each row's last valid token, ``- kl_coef * kl`` on every
    valid token (``kl [B, L]``, optional). A row without valid tokens gets no reward."""
    m = mask > 0
    B, L = m.shape
    rewards = torch.zeros(B, L, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef:
        _check(mask, kl)
        rewards = torch.where(m, -kl_coef * kl.float(), rewards)
    has = m.any(dim=1)
    last = (L - 1) - torch.flip(m, dims=[1]).int().argmax(dim=1)  # index of the last valid token per row
    rows = torch.arange(B, device=mask.device)[has]
    rewards[rows, last[has]] += scores.to(rewards.device, torch.float32)[has]
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages [B, L], returns [B, L])`` fp32 (see the module docstring); vectorised over rows."""
    _check(mask, rewards, values)
    m = (mask > 0).float()
    r = torch.where(m > 0, rewards.float(), torch.zeros_like(m))
    v = torch.where(m > 0, values.float(), torch.zeros_like(m))
    B, L = m.shape
    next_value = torch.zeros(B, dtype=torch.float32, device=m.device)
    next_adv = torch.zeros(B, dtype=torch.float32, device=m.device)
    adv = torch.zeros(B, L, dtype=torch.float32, device=m.device)
    for t in range(L - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        mt = m[:, t]
        adv[:, t] = a_t * mt
        # a masked position passes the next valid token's value and advantage through unchanged
        next_value = v[:, t] * mt + next_value * (1.0 - mt)
        next_adv = a_t * mt + next_adv * (1.0 - mt)
    returns = (adv + v) * m
    return adv, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``x`` whitened over its valid tokens (unbiased variance; needs >= 2 valid tokens); 0 where masked."""
    _check(mask, x)
    m = mask > 0
    n = int(m.sum())
    if n < 2:
        raise ValueError(f"whitening needs at least 2 valid tokens, got {n}")
    vals = x[m].float()
    mean, var = vals.mean(), vals.var(unbiased=True)
    out = (x.float() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros_like(out))


def pad_rows(rows: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D tensors of varying length -> ``(padded [B, L] fp32, mask [B, L] fp32)`` (right padding)."""
    L = max((int(r.numel()) for r in rows), default=0)
    out = torch.full((len(rows), L), value, dtype=torch.float32)
    mask = torch.zeros(len(rows), L, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.float().cpu()
        mask[i, : r.numel()] = 1.0
    return out, mask


def unpad_rows(x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of ``pad_rows``: each row's valid values."""
    return [x[i][mask[i] > 0] for i in range(x.shape[0])]


__all__ = ["gae", "pad_rows", "token_rewards", "unpad_rows", "whiten"]
