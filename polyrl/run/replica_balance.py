"""Load balancing of a batch's prompts over rollout replicas (``polyrl.run.rollout_workers``): what each prompt costs,
how fast each replica is, and the split that gives each replica work in proportion to its speed. Pure functions and
one small tracker, no processes: the same costs and timings give the same split.

- Cost model (``prompt_cost(prompt_len, params)``): ``n * max_tokens + PREFILL_WEIGHT * prompt_len`` work units. The
  decode of a generated token is the unit (its ``n`` samples each decode up to ``max_tokens``; a prompt without
  ``max_tokens`` counts ``DEFAULT_MAX_TOKENS``); a prompt token is prefilled once per prompt (the ``n`` samples
  share it through the prefix cache) and costs ``PREFILL_WEIGHT`` (0.1) of a decoded token, since the prefill runs
  many tokens per forward. The estimate is an upper bound (a sequence may stop early at EOS): the split is right
  when the prompts of a batch stop early alike, as the samples of one task do.
- Episodes (an agentic run's examples, ``polyrl.agents.remote``): ``episode_cost(n, max_turns, max_new_tokens,
  max_episode_tokens)`` = ``n * min(max_turns * max_new_tokens, max_episode_tokens)``, the most policy tokens the
  ``n`` episodes of one example can decode (the opening prompt is built by the environment in the replica, so it is
  not known when the split is made; environment calls are not counted). Equal for every example of a call, so the
  split of episodes follows the replicas' measured speeds alone (equal speeds: example i to replica i mod W).
- ``split_by_count(num_prompts, num_replicas)``: prompt i to replica i mod W (equal counts; ``balance = "count"``).
- ``split_by_work(costs, speeds)``: each replica's estimated work in proportion to its speed. Greedy: the prompts in
  order of decreasing cost (ties: the lower index first), each to the replica that would finish its share soonest
  with it, ``(load + cost) / speed`` (ties: the lower replica). Then, while there are prompts enough, no replica is
  left without one: an empty one takes the cheapest prompt (the last of equal ones) of the replica that would finish
  last among those holding two or more, so every replica keeps being measured (a replica slow once, say warming up,
  is not shut out for good; it costs the run one cheap prompt on it). Equal costs and speeds give i mod W; each
  replica's share in prompt order. Every prompt goes to exactly one replica; a prompt is one GRPO group (``n`` is in its
  ``SamplingParams``), so groups are never cut.
- ``ReplicaSpeeds(num_replicas)``: work units per second of each replica, from its replies (``observe(w, work,
  seconds)``: the share's estimated work over the time from when its job was sent to when its reply arrived). The
  first reply sets a replica's speed, later ones move it by an EMA (``EMA_WEIGHT`` 0.5: ``s <- s/2 + measured/2``).
  A replica not measured yet (at the start, or restarted: ``reset(w)``) counts at the mean of the measured others
  (every replica equal when none is measured). ``effective(replicas)``: the speeds a split uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BALANCES = ("work", "count")
DEFAULT_MAX_TOKENS = 512  # the decode cost of a prompt whose max_tokens is None (up to the context length)
PREFILL_WEIGHT = 0.1  # a prompt token's prefill, in decoded tokens
EMA_WEIGHT = 0.5  # the weight of a new measurement in a replica's speed


def prompt_cost(prompt_len: int, params: Any) -> float:
    """Estimated work units of one prompt (its ``n`` samples): ``n * max_tokens + PREFILL_WEIGHT * prompt_len``."""
    max_tokens = getattr(params, "max_tokens", None) or DEFAULT_MAX_TOKENS
    return float(getattr(params, "n", 1) * max_tokens) + PREFILL_WEIGHT * prompt_len


def episode_cost(n: int, max_turns: int, max_new_tokens: int, max_episode_tokens: int) -> float:
    """Estimated work units of one example's ``n`` episodes: ``n * min(max_turns * max_new_tokens,
    max_episode_tokens)``."""
    return float(n * min(max_turns * max_new_tokens, max_episode_tokens))


def split_by_count(num_prompts: int, num_replicas: int) -> list[list[int]]:
    """Prompt i to replica i mod ``num_replicas``: each replica's prompt indices, in order."""
    return [list(range(w, num_prompts, num_replicas)) for w in range(num_replicas)]


def split_by_work(costs: Sequence[float], speeds: Sequence[float]) -> list[list[int]]:
    """Each replica's prompt indices (in order), its estimated work about proportional to its speed (greedy on the
    finish time ``(load + cost) / speed``, costliest prompt first; at least one prompt each when there are enough;
    see the module docstring)."""
    if not speeds:
        raise ValueError("split_by_work needs at least one replica")
    if any(not s > 0 for s in speeds):
        raise ValueError(f"replica speeds must be > 0, got {list(speeds)}")
    load = [0.0] * len(speeds)
    shares: list[list[int]] = [[] for _ in speeds]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(len(speeds)), key=lambda w: ((load[w] + costs[i]) / speeds[w], w))
        load[w] += costs[i]
        shares[w].append(i)
    for empty in [w for w, s in enumerate(shares) if not s]:
        donors = [w for w, s in enumerate(shares) if len(s) > 1]
        if not donors:
            break
        d = max(donors, key=lambda w: (load[w] / speeds[w], -w))
        i = min(shares[d], key=lambda i: (costs[i], -i))
        shares[d].remove(i)
        shares[empty].append(i)
        load[d] -= costs[i]
        load[empty] += costs[i]
    return [sorted(s) for s in shares]


class ReplicaSpeeds:
    """Each replica's measured work units per second (an EMA over its replies; None until its first one)."""

    def __init__(self, num_replicas: int, ema: float = EMA_WEIGHT) -> None:
        self.measured: list[float | None] = [None] * num_replicas
        self.ema = ema

    def observe(self, w: int, work: float, seconds: float) -> None:
        """Replica ``w`` did ``work`` units in ``seconds`` (job sent to reply arrived)."""
        if not work > 0:
            return
        rate = work / max(seconds, 1e-6)
        old = self.measured[w]
        self.measured[w] = rate if old is None else (1.0 - self.ema) * old + self.ema * rate

    def reset(self, w: int) -> None:
        """Forget replica ``w``'s speed (restarted: it counts at the mean of the others until it replies)."""
        self.measured[w] = None

    def effective(self, replicas: Sequence[int]) -> list[float]:
        """The speeds of ``replicas`` for a split: measured, else the mean of the measured others (all 1.0 when
        none of them is measured)."""
        known = [self.measured[w] for w in replicas if self.measured[w] is not None]
        mean = sum(known) / len(known) if known else 1.0
        return [mean if self.measured[w] is None else self.measured[w] for w in replicas]  # type: ignore[misc]


__all__ = [
    "BALANCES",
    "DEFAULT_MAX_TOKENS",
    "EMA_WEIGHT",
    "PREFILL_WEIGHT",
    "ReplicaSpeeds",
    "episode_cost",
    "prompt_cost",
    "split_by_count",
    "split_by_work",
]
