"""GSPO (Group Sequence Policy Optimization) as a registered online algorithm: GRPO's advantages and loop with a
sequence-level, length-normalised importance ratio ``s_i = exp(mean_t(logp_t - old_t))`` clipped in its own, much
smaller range (default 3e-4 below / 4e-4 above, the paper's), applied per token as GSPO-token
(``sg[s_i] * exp(logp_t - sg[logp_t])``: the value of ``s_i``, the gradient of each token's log-prob) and averaged
per sequence (``seq-mean-token-mean``), which gives exactly the GSPO paper's gradient. Math in
``polyrl.algorithms.losses``; this module only sets the defaults and registers ``gspo``.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.algorithms.grpo import PLOT_SERIES, GroupRelative, GRPOConfig
from polyrl.algorithms.spec import AlgorithmSpec


@dataclass
class GSPOConfig(GRPOConfig):
    """The ``[gspo]`` table: GRPO's settings with GSPO's clip range and per-sequence aggregation."""

    RATIO = "sequence"

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    loss_agg: str = "seq-mean-token-mean"
    # The sequence ratio's clip range (~1e-4) is below the rollout/trainer numeric mismatch of bf16 engines, so the
    # old log-probs default to the trainer's own recompute (as in the GSPO paper), not the rollout engine's.
    old_logprobs: str = "recompute"

    def table_name(self) -> str:
        return "gspo"


SPEC = AlgorithmSpec(
    name="gspo",
    description="GSPO: GRPO with a length-normalised sequence-level ratio and its own clip range",
    config_cls=GSPOConfig,
    loop="online",
    hooks=GroupRelative,
    plot_series=PLOT_SERIES,
)
