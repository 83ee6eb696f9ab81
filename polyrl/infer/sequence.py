"""Sequence: the engine's state for one sample of one request, and the outputs handed to callers.

A request with ``n`` samples becomes ``n`` independent sequences that share a request id; prefix
caching (``block_manager``) lets them share the prompt's KV blocks. ``tokens`` is prompt plus generated
tokens; ``num_computed`` of them have their keys/values in the cache. Preemption by recompute sets
``num_computed`` back to 0 and keeps the tokens, so the sequence resumes exactly where it stopped. While a
one-step-ahead decode is in flight the last of ``tokens`` is a placeholder (``pending``), filled when read.

This module holds data only: scheduling, sampling and detokenising live in their own modules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from polyrl.infer.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CompletionOutput:
    """One sample. ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under log_softmax(logits / T)
    (T = temperature, or 1 for greedy), before top-k/top-p/min-p truncation. ``top_logprobs[i]`` maps
    token id -> log-prob for the top alternatives when ``SamplingParams.logprobs`` was set."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    cumulative_logprob: float
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    top_logprobs: list[dict[int, float]] | None = None
    new_token_ids: list[int] = field(default_factory=list)  # streaming: tokens since the last step's output
    new_text: str = ""  # streaming: text since the last step's output
    # structured outputs: sum over the tokens of log(probability mass the grammar allowed); None when unconstrained
    masked_logmass: float | None = None
    # RolloutConfig.record_routing (MoE): int [prompt + output tokens, MoE layers, k], the experts each MoE layer chose
    # for every token the engine fed (prefix-cache hits included); the last token was never fed: its row is -1.
    # On the engine's device from step(), on the host from generate().
    routed_experts: Any = None
    # per token of ``token_ids``, the engine's ``policy_version`` that generated it (partial rollouts: a weight swap
    # in the middle of the generation, ``LLM.swap_weights``); None when the engine tracks no version
    token_versions: list[int] | None = None


@dataclass
class PromptLogprobs:
    """Per prompt token (``SamplingParams.prompt_logprobs``): ``logprobs[i]`` is ``log p(prompt[i] | prompt[:i])``
    (None for position 0 and before ``prompt_logprobs_from``); ``top_logprobs[i]`` maps token id -> log-prob for
    the top-k alternatives there (None where ``logprobs[i]`` is; ``{}`` when k = 0); ``ranks[i]`` is the rank of
    ``prompt[i]`` in that distribution (1 = likeliest), known when k > 0 (None otherwise)."""

    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    ranks: list[int | None] = field(default_factory=list)
    # positions scored by a step whose results are still on their way to the host (``prompt_logprobs.PromptScores``)
    queued: int = 0

    @property
    def filled(self) -> int:
        """Positions stored or queued: the next position to score is ``filled - 1``'s hidden state."""
        return len(self.logprobs) + self.queued


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs was set

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class Sequence:
    __slots__ = (
        "seq_id",
        "request_id",
        "index",
        "tokens",
        "num_prompt",
        "params",
        "status",
        "block_table",
        "num_computed",
        "num_hashed_blocks",
        "last_hash",
        "logprobs",
        "top_logprobs",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
        "detok",
        "stop_screen",
        "stream",
        "emitted_tokens",
        "emitted_text",
        "arrival",
        "pending",
        "pending_row",
        "draw",
        "guide",
        "prompt_lps",
        "routed_experts",
        "versions",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float = 0.0,
        stream: bool = False,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.tokens: list[int] = list(prompt_token_ids)
        self.num_prompt = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.last_hash: int | None = None  # hash of the last registered block (parent of the next)
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detok: Any = None  # IncrementalDetokenizer when stop strings or streaming need text
        self.stop_screen: Any = None  # stopping.StopScreen of params.stop, set with detok when there are stop strings
        self.stream = stream
        self.emitted_tokens = 0
        self.emitted_text = 0
        self.arrival = arrival
        # Decoding ahead (``overlap.py``): the last ``pending`` tokens are placeholders whose values are still on
        # the device, in row ``pending_row`` of the launch in flight.
        self.pending = 0  # how many of them
        self.pending_row = -1
        self.draw: tuple[float, bool, int] | None = None  # the sampler's (temperature, greedy, seed), made once
        self.guide: Any = None  # structured outputs: this sample's grammar matcher (infer/structured.py)
        # Prompt log-probs (sample 0 of a request asking for them; ``prompt_logprobs.py``): filled position by
        # position as the prefill chunks run; None when not wanted.
        self.prompt_lps: PromptLogprobs | None = None
        if params.prompt_logprobs is not None and index == 0:
            first = min(params.prompt_logprobs_from, self.num_prompt)
            self.prompt_lps = PromptLogprobs([None] * first, [None] * first, [None] * first)
        self.routed_experts: Any = None  # record_routing: gathered when it finishes (kv_cache.read_routing)
        # per generated token, the engine's ``policy_version`` when it was computed (partial rollouts: a weight
        # swap mid-generation, ``LLM.swap_weights``); stays empty while the engine's ``policy_version`` is None
        self.versions: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.index}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed}, blocks={len(self.block_table)})"
        )
