"""``Episode``: the token-level record of one multi-turn episode, the unit agentic RL trains on.

``prompt_ids`` (the opening prompt from ``Environment.reset``) + ``ids`` (everything after it, in order: the tokens
the engine sampled for each assistant turn, and the template/observation tokens appended between turns). ``mask``
(one per ``ids`` entry) is 1 exactly on sampled tokens; ``logprobs`` holds the engine's log-prob of each sampled
token (one per masked position, in order: the RL old log-probs; unmasked by any output format, whose cost is
``masked_logmass``). ``turns`` are the ``(start, end)`` spans of the
sampled turns in ``ids``. ``versions`` (partial rollouts of async RL, else None): one per ``ids`` entry, the policy
version of the engine that sampled the token (a weight update may land in the middle of a turn, so one turn can hold
two versions); a template/observation token (mask 0, not sampled) carries the version of the sampled token before
it, so the list never decreases along the episode and its oldest entry is the oldest sampled token's.
``to_sample()`` gives the ``colocated.Sample`` the RL loop packs (its ``mask`` keeps the loss on the policy's own
tokens; tool outputs and user turns are context only; ``versions`` become its ``token_versions``).
``status``: ``done`` (the environment ended it), ``max_turns``, ``max_tokens`` (the episode token budget),
``env_error`` (the environment raised, hung or returned garbage; reward = the failure reward).
Not here: producing episodes (``rollout``), rewards or advantages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polyrl.algorithms.rl_batch import Sample

STATUSES = ("running", "done", "max_turns", "max_tokens", "env_error")


@dataclass
class Episode:
    group: int  # index of the prompt example in the rollout call
    index: int  # j of the n episodes of that example
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    status: str = "running"
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    masked_logmass: float | None = None  # constrained turns: sum of log(mass the grammar allowed) over their tokens
    versions: list[int] | None = None  # partial rollouts: per ids entry, the policy version that sampled it

    @property
    def context(self) -> list[int]:
        """Every id so far: the prompt of the next turn."""
        return self.prompt_ids + self.ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def finished(self) -> bool:
        return self.status != "running"

    @property
    def trainable(self) -> bool:
        """Has at least one sampled token (an episode whose reset failed has none)."""
        return bool(self.turns)

    def add_turn(self, token_ids: list[int], logprobs: list[float], versions: list[int] | None = None) -> None:
        """A sampled turn: its ids, their log-probs and (partial rollouts) the policy version of each."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"a turn of {len(token_ids)} tokens came with {len(logprobs)} log-probs")
        if versions is not None and len(versions) != len(token_ids):
            raise ValueError(f"a turn of {len(token_ids)} tokens came with {len(versions)} policy versions")
        if (versions is None) != (self.versions is None) and self.turns:
            raise ValueError("every turn of an episode records policy versions (partial rollouts), or none does")
        start = len(self.ids)
        self.ids.extend(int(t) for t in token_ids)
        self.mask.extend([1] * len(token_ids))
        self.logprobs.extend(float(x) for x in logprobs)
        if versions is not None:
            self.versions = (self.versions or []) + [int(v) for v in versions]
        self.turns.append((start, len(self.ids)))

    def add_observation(self, token_ids: list[int]) -> None:
        self.ids.extend(int(t) for t in token_ids)
        self.mask.extend([0] * len(token_ids))
        if self.versions is not None and token_ids:  # not sampled: the version of the sampled token before them
            self.versions.extend([self.versions[-1]] * len(token_ids))

    def count(self, key: str, value: float = 1.0) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + float(value)

    def end(self, status: str, error: str | None = None) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown episode status {status!r}")
        if self.status == "running":
            self.status, self.error = status, error

    def to_sample(self, text: str = "") -> Any:
        finish = "length" if self.status == "max_tokens" else "stop"
        return Sample(
            list(self.prompt_ids), list(self.ids), list(self.logprobs), finish, text, self.group, self.index,
            mask=list(self.mask), masked_logmass=self.masked_logmass,
            token_versions=list(self.versions) if self.versions is not None else None,
        )  # fmt: skip


__all__ = ["STATUSES", "Episode"]
