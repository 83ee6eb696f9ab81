"""Group-relative advantages (GRPO, GSPO, Dr. GRPO) and the filter that drops groups without a learning signal.

A *group* is the ``n`` completions of one prompt. ``group_advantages`` gives each completion one scalar
``A_i = (r_i - mean_g) / (std_g + eps)`` (``scale="std"``, GRPO) or ``r_i - mean_g`` (``scale="none"``, Dr. GRPO),
``std_g`` being the unbiased sample standard deviation of the group as in TRL and verl; a group of one has
advantage 0. The loss broadcasts the scalar over the completion's tokens. GAE (PPO's per-token advantages with a
critic) lives with PPO, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SCALES = ("std", "none")


def group_advantages(
    rewards: Sequence[float], groups: Sequence[int], scale: str = "std", eps: float = 1e-6
) -> list[float]:
    """One advantage per completion. ``groups[i]`` is the group (prompt) id of completion i; groups may be in any
    order and of any size."""
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; use one of {SCALES}")
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} group ids")
    r = torch.tensor(list(rewards), dtype=torch.float64)
    out = torch.zeros_like(r)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(int(g), []).append(i)
    for idx in members.values():
        if len(idx) < 2:
            continue
        x = r[idx]
        a = x - x.mean()
        std = float(x.std(unbiased=True))
        if scale == "std" and std > 0:  # all-equal groups have a == 0 already
            a = a / (std + eps)
        out[idx] = a
    return out.tolist()


def informative_groups(rewards: Sequence[float], groups: Sequence[int], tol: float = 1e-9) -> set[int]:
    """The group ids whose rewards do not all agree (a group where every completion scored the same gives every
    completion advantage 0, so it only dilutes the batch: DAPO's dynamic-sampling filter)."""
    lo: dict[int, float] = {}
    hi: dict[int, float] = {}
    for r, g in zip(rewards, groups):
        lo[g] = min(lo.get(g, r), r)
        hi[g] = max(hi.get(g, r), r)
    return {g for g in lo if hi[g] - lo[g] > tol}


__all__ = ["SCALES", "group_advantages", "informative_groups"]
