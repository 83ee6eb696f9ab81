"""SamplingParams: how one request is sampled and when it stops, validated on construction.

Semantics follow the OpenAI / vLLM conventions an experienced user expects:

- ``temperature == 0`` is greedy; ``top_k`` in {0, -1} and ``top_p == 1`` and ``min_p == 0`` disable
  those filters.
- ``seed`` makes a request reproducible regardless of what else is in the batch (sample ``i`` of ``n``
  uses a stream derived from ``(seed, i)``).
- ``max_tokens`` counts generated tokens; ``min_tokens`` suppresses EOS and ``stop_token_ids`` (not
  stop strings' tokens) until that many tokens were generated.
- ``stop`` strings are matched on the detokenised text; the text is cut before the stop string, the
  token ids (and their log-probs) are kept whole, because RL trains on the tokens that were sampled.
- ``structured`` constrains the output to a grammar (``StructuredOutputs``: JSON schema, regex, choice, Lark);
  the reported log-probs stay those of the unmasked distribution, like top-k/top-p (``sampler.py``).
- ``logprobs = k`` asks for the top-``k`` alternatives per generated token (the sampled token's own
  log-prob is always returned).
- ``prompt_logprobs = k`` (vLLM's name) asks for every prompt token's log-prob and its top-``k`` alternatives,
  under the raw distribution (T = 1, no truncation), from ``prompt_logprobs_from`` on (earlier positions are
  ``None``; the first token always is). Computed in the prefill (``infer/prompt_logprobs.py``).

This module only describes a request; it does not sample (``sampler.py``) or detokenise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from polyrl.errors import UserError

MAX_TOP_LOGPROBS = 20

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")


@dataclass(frozen=True)
class StructuredOutputs:
    """A grammar the output must match (``infer/structured.py`` compiles it; equal specs share one compilation).

    ``kind``: ``json`` (``spec`` = a JSON schema as JSON text), ``json_object`` (any JSON object; ``spec`` ""),
    ``regex``, ``choice`` (``spec`` = a JSON list of strings), ``grammar`` (Lark, or llama.cpp GBNF, detected) or
    ``lark`` (llguidance's Lark, ``%json`` included: what forced tool calls use)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise UserError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise UserError(f"a structured output of kind {self.kind!r} needs a non-empty spec string")

    @classmethod
    def json_schema(cls, schema: dict) -> StructuredOutputs:
        return cls("json", json.dumps(schema, separators=(",", ":")))  # property order kept: it is the output's

    @classmethod
    def from_spec(cls, text: str) -> StructuredOutputs | None:
        """A config string as a grammar (RL rollouts: ``--set grpo.rollout_response_format=...``): "" = none,
        ``json_object``, ``json_schema:<file.json>`` or ``json_schema:{...}``, ``regex:<pattern>``,
        ``choice:a|b|c``, ``grammar:<file.lark>`` or ``grammar:<Lark text>``."""
        text = (text or "").strip()
        if not text:
            return None
        if text == "json_object":
            return cls("json_object")
        kind, sep, rest = text.partition(":")
        if not sep or kind not in ("json_schema", "regex", "choice", "grammar") or not rest:
            raise UserError(
                f"response format {text!r} is not one of json_object, json_schema:<file or JSON>, regex:<pattern>, "
                "choice:a|b|c, grammar:<file or Lark>"
            )
        if kind == "regex":
            return cls("regex", rest)
        if kind == "choice":
            return cls.choice(rest.split("|"))
        body = rest
        if kind == "json_schema" and not rest.lstrip().startswith("{") or kind == "grammar" and "\n" not in rest:
            try:
                with open(rest) as f:
                    body = f.read()
            except OSError as exc:
                if kind == "json_schema":
                    raise UserError(f"cannot read the JSON schema file {rest!r}: {exc.strerror}") from None
        if kind == "grammar":
            return cls("grammar", body)
        try:
            schema = json.loads(body)
        except json.JSONDecodeError as exc:
            raise UserError(f"the JSON schema {rest[:60]!r} is not valid JSON: {exc.msg}") from None
        if not isinstance(schema, dict):
            raise UserError("a JSON schema must be a JSON object")
        return cls.json_schema(schema)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutputs:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise UserError("a choice needs a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    adapter: str | None = None  # LoRA adapter (a name given to LLM.load_adapters) to run with; None = the base
    structured: StructuredOutputs | None = None  # a grammar the output must match (infer/structured.py)
    prompt_logprobs: int | None = None  # top-k alternatives per prompt token (0 = the token's own log-prob only)
    prompt_logprobs_from: int = 1  # first prompt position scored (a scorer's context before it may hit the cache)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> UserError:
            return UserError(f"invalid sampling parameter: {msg}")

        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise bad(f"adapter must be an adapter name or None, got {self.adapter!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:  # nan fails too
            raise bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 1, or 0/-1 to disable it, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(
                f"max_tokens must be an integer >= 1 (or None for up to the context length), got {self.max_tokens!r}"
            )
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad(
                f"logprobs (top alternatives per token) must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad(
                f"prompt_logprobs (top alternatives per prompt token) must be in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        if not isinstance(self.prompt_logprobs_from, int) or self.prompt_logprobs_from < 1:
            raise bad(f"prompt_logprobs_from must be an integer >= 1, got {self.prompt_logprobs_from!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad(f"stop strings must be non-empty strings, got {s!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                raise bad(f"structured must be a StructuredOutputs or None, got {type(self.structured).__name__}")
            if self.min_tokens:
                raise bad("min_tokens cannot be combined with a structured output (the grammar decides when it ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0 and not self.greedy

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0 and not self.greedy

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0 and not self.greedy

    @property
    def truncates(self) -> bool:
        """Whether sampling masks the distribution (top-k, top-p or min-p); one test, asked per row per step."""
        return self.temperature != 0.0 and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes) -> SamplingParams:
        return replace(self, **changes)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample ``index`` of a request seeded with ``seed`` (sample 0 uses ``seed``)."""
    if index == 0:
        return seed % (2**63)
    return (seed * 6364136223846793005 + index * 1442695040888963407) % (2**63)
