"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay.

A pure function of the optimizer-step index, so a resumed run gets exactly the lr it would have had;
there is no scheduler object with state to save. It does not touch an optimizer: the engine passes
the value to ``MasterAdamW.step(lr=...)``.
"""

from __future__ import annotations

import math

from polyrl.train.config import ScheduleConfig

# decay name -> shape d(p) in [0, 1] over progress p in [0, 1]; lr factor = m + (1 - m) * d(p).
DECAY_SHAPES = {
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "linear": lambda p: 1.0 - p,
}


def warmup_steps(cfg: ScheduleConfig, total_steps: int | None) -> int:
    """Warmup length in steps: ``warmup_steps``, or ``ceil(warmup_ratio * total_steps)``."""
    if cfg.warmup_ratio is None:
        return cfg.warmup_steps
    if total_steps is None:
        raise ValueError("schedule.warmup_ratio needs the total number of steps")
    return int(math.ceil(cfg.warmup_ratio * total_steps))


def lr_factor(step: int, cfg: ScheduleConfig, total_steps: int | None) -> float:
    """Multiplier of the base lr for the optimizer step with 0-based index ``step``.

    Warmup: ``(step + 1) / warmup`` for ``step < warmup`` (the first step already moves the weights).
    Decay over the remaining steps with progress ``p = (step - warmup) / max(1, total - warmup - 1)``
    clamped to [0, 1], so the last step (``total - 1``) reaches ``min_lr_ratio`` exactly:
    cosine ``m + (1 - m) * (1 + cos(pi p)) / 2``, linear ``m + (1 - m) * (1 - p)``, constant ``1``.
    Without ``total_steps`` only warmup + constant is defined.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warm = warmup_steps(cfg, total_steps)
    if step < warm:
        return (step + 1) / warm
    if cfg.decay == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"schedule.decay = {cfg.decay!r} needs the total number of steps")
    span = max(1, total_steps - warm - 1)
    progress = min(1.0, max(0.0, (step - warm) / span))
    m = cfg.min_lr_ratio
    return m + (1.0 - m) * DECAY_SHAPES[cfg.decay](progress)


def lr_at(step: int, base_lr: float, cfg: ScheduleConfig, total_steps: int | None) -> float:
    """The learning rate of optimizer step ``step`` (0-based)."""
    return base_lr * lr_factor(step, cfg, total_steps)
