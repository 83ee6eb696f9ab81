"""Canonical examples every dataset format is parsed into, before and after tokenisation.

A format parser (``formats.py``) turns a raw row into one of ``ChatExample``, ``TokensExample``,
``PreferenceExample`` or ``PromptExample``; ``chat.py`` turns them into ``TokenizedSeq``. These are plain
containers: no parsing, validation or tokenisation lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}


@dataclass
class ChatExample:
    """A conversation for SFT; the loss policy (``DataConfig.loss_on``) picks which assistant turns are trained.
    ``tools``: the row's OpenAI tool definitions (``[{type: function, function: {name, ...}}]``), rendered by the
    chat template into the prompt (never trained on); None when the row has none."""

    messages: list[Message]
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


@dataclass
class TokensExample:
    """Already tokenised: ``loss_mask[t]`` is 1 where token t is a training target."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class PreferenceExample:
    """A DPO pair: a shared prompt conversation and two assistant continuations (each a message list).
    ``tools``: the row's tool definitions, rendered into both sequences' prompt (as ``ChatExample.tools``)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass
class PromptExample:
    """An RL prompt: the conversation to continue, the reference answer when known, and task metadata.
    ``tools``: the row's tool definitions, rendered by the chat template into the prompt the policy samples from
    (as ``ChatExample.tools``) and given to reward functions; None when the row has none."""

    messages: list[Message]
    answer: str | None = None
    task: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


@dataclass
class TokenizedSeq:
    """One token sequence: ``loss_mask[t] == 1`` means token t is predicted and counted in the loss."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(self.loss_mask))
