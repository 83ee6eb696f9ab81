"""LLM-as-judge rewards through any OpenAI-compatible chat endpoint (``polyrl serve``, vLLM, SGLang, OpenAI, ...).

``JudgeConfig`` is the ``[reward.judge]`` table; ``JudgeScorer.score(completions, examples)`` asks the judge about
each completion (``concurrency`` requests at once, from threads of this process), parses a score from its reply and
normalises it to ``[0, 1]``: ``(score - min_score) / (max_score - min_score)``.

- The prompt is ``template`` formatted with ``{prompt}`` (the example's last user message), ``{completion}`` and
  ``{answer}`` (the reference answer, empty when there is none), sent as one user message (after ``system`` if set).
- The score is the first group (else the whole match) of ``score_pattern`` in the reply, with any
  ``<think>...</think>`` removed first; the default pattern reads ``Score: 7`` and a reply that is only a number.
- Each call has ``timeout`` seconds; a refused connection, a timeout, an HTTP 429 or 5xx is retried ``retries``
  times, waiting ``backoff * 2**attempt`` seconds. What is still failing then is a counted failure of the usual
  kinds: ``timeout``, ``error`` (endpoint down, HTTP error, a reply without a message), ``non_number`` (no score in
  the reply, or one outside ``[min_score, max_score]``).
- ``api_key_env`` names the environment variable holding the key (sent as a bearer token when set); the key itself
  is never part of the config that a run saves.
Standard library only (urllib): no client package is needed.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from polyrl.errors import ConfigError

DEFAULT_TEMPLATE = (
    "You are a strict grader. Rate how well the response answers the question, from 0 (wrong or useless) to 10 "
    "(fully correct and clear).\n\nQuestion:\n{prompt}\n\nReference answer (may be empty):\n{answer}\n\n"
    "Response:\n{completion}\n\nReply with one line: Score: <number from 0 to 10>"
)
DEFAULT_PATTERN = r"(?i)score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)|^\s*(-?\d+(?:\.\d+)?)\s*$"
_THINK = re.compile(r"<think>.*?(</think>|\Z)", re.DOTALL)
Outcome = tuple[str, Any, dict[str, float]]


@dataclass
class JudgeConfig:
    """The ``[reward.judge]`` table (see the module docstring). ``url``: the server (``http://host:port``, its
    ``/v1`` base, or the full ``.../chat/completions`` address); ``--reward judge:URL`` sets it too. ``model``: the
    judge model's name (None: the first model the server lists at ``/v1/models``)."""

    url: str | None = None
    model: str | None = None
    template: str = DEFAULT_TEMPLATE
    system: str | None = None
    score_pattern: str = DEFAULT_PATTERN
    min_score: float = 0.0
    max_score: float = 10.0
    concurrency: int = 8
    retries: int = 2
    backoff: float = 0.5
    timeout: float = 60.0
    max_tokens: int = 256
    temperature: float = 0.0
    api_key_env: str = "OPENAI_API_KEY"

    def __post_init__(self) -> None:
        try:
            self.template.format(prompt="p", completion="c", answer="a")
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ConfigError(
                f"reward.judge.template is not a valid template ({type(exc).__name__}: {exc}); it may use {{prompt}}, "
                "{completion} and {answer} (double other braces: {{ }})"
            ) from None
        try:
            re.compile(self.score_pattern)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"reward.judge.score_pattern is not a regular expression: {exc}") from None
        if not (isinstance(self.max_score, (int, float)) and isinstance(self.min_score, (int, float))) or not (
            self.max_score > self.min_score
        ):
            raise ConfigError(f"reward.judge needs max_score > min_score, got {self.min_score!r}..{self.max_score!r}")
        for key in ("concurrency",):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"reward.judge.{key} must be a positive integer, got {v!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"reward.judge.retries must be an integer >= 0, got {self.retries!r}")
        if not self.timeout > 0 or not self.backoff >= 0:
            raise ConfigError("reward.judge.timeout must be > 0 and reward.judge.backoff >= 0 (seconds)")
        if self.url is not None:
            chat_url(self.url)


def chat_url(url: str) -> str:
    """The ``.../chat/completions`` address of ``url`` (a server, its ``/v1`` base or the full address)."""
    if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url.strip()):
        raise ConfigError(f"judge URL {url!r} is not an http(s) address; e.g. --reward judge:http://localhost:8000/v1")
    url = url.strip().rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if re.search(r"/v\d+$", url):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def parse_score(reply: str, cfg: JudgeConfig) -> float:
    """The normalised score in a judge's reply; ValueError when there is none or it is out of range."""
    text = _THINK.sub("", reply or "").strip()
    m = re.search(cfg.score_pattern, text, re.MULTILINE)
    if m is None:
        raise ValueError(f"no score in the judge's reply {text[:80]!r}")
    groups = [g for g in m.groups() if g is not None]
    raw = groups[0] if groups else m.group(0)
    try:
        score = float(raw)
    except ValueError:
        raise ValueError(f"the judge's score {raw!r} is not a number") from None
    if not math.isfinite(score) or not cfg.min_score <= score <= cfg.max_score:
        raise ValueError(f"the judge's score {score:g} is outside [{cfg.min_score:g}, {cfg.max_score:g}]")
    return (score - cfg.min_score) / (cfg.max_score - cfg.min_score)


class _Retryable(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class JudgeScorer:
    """Scores completions with the judge of ``cfg`` (``cfg.url`` must be set)."""

    def __init__(self, cfg: JudgeConfig) -> None:
        if not cfg.url:
            raise ConfigError(
                "the judge reward has no URL; pass --reward judge:http://HOST:PORT/v1 or set reward.judge.url"
            )
        self.cfg = cfg
        self.url = chat_url(cfg.url)
        self._model = cfg.model
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="polyrl-judge")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        key = os.environ.get(self.cfg.api_key_env or "", "")
        if key:
            h["Authorization"] = f"Bearer {key}"
        return h

    def _request(self, url: str, body: dict | None) -> dict:
        """One HTTP call (POST when ``body``), its JSON; ``_Retryable`` for what a retry may fix."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers=self._headers(), method="POST" if body else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace")
            if exc.code == 429 or exc.code >= 500:
                raise _Retryable("error", f"judge HTTP {exc.code} from {url}: {detail}") from None
            raise RuntimeError(f"judge HTTP {exc.code} from {url}: {detail}") from None
        except TimeoutError as exc:
            raise _Retryable("timeout", f"no judge reply within {self.cfg.timeout:g}s from {url}") from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise _Retryable("timeout", f"no judge reply within {self.cfg.timeout:g}s from {url}") from None
            raise _Retryable("error", f"judge endpoint {url} unreachable: {exc.reason}") from None
        except (ConnectionError, OSError) as exc:
            raise _Retryable("error", f"judge endpoint {url} failed: {type(exc).__name__}: {exc}") from None
        try:
            return json.loads(payload)
        except ValueError:
            raise RuntimeError(f"the judge at {url} answered with something that is not JSON") from None

    def _with_retries(self, url: str, body: dict | None) -> dict:
        for attempt in range(self.cfg.retries + 1):
            try:
                return self._request(url, body)
            except _Retryable:
                if attempt == self.cfg.retries:
                    raise
                time.sleep(self.cfg.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def model(self) -> str:
        """The judge model's name: ``cfg.model``, else the first one the server lists (asked once)."""
        if self._model is None:
            listing = self._with_retries(self.url.rsplit("/chat/completions", 1)[0] + "/models", None)
            try:
                self._model = str(listing["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise RuntimeError("the judge server lists no model at /models; set reward.judge.model") from None
        return self._model

    def messages(self, completion: str, example: Mapping[str, Any]) -> list[dict[str, str]]:
        answer = example.get("answer")
        text = self.cfg.template.format(
            prompt=example.get("prompt", ""), completion=completion, answer="" if answer is None else str(answer)
        )
        system = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return [*system, {"role": "user", "content": text}]

    def score_one(self, completion: str, example: Mapping[str, Any]) -> Outcome:
        """``("ok", score in [0, 1], {})`` or ``(failure kind, message, {})``."""
        try:
            body = {
                "model": self.model(),
                "messages": self.messages(completion, example),
                "max_tokens": self.cfg.max_tokens,
                "temperature": self.cfg.temperature,
            }
            reply = self._with_retries(self.url, body)
        except _Retryable as exc:
            return exc.kind, str(exc), {}
        except Exception as exc:  # noqa: BLE001 - any other failure of the judge is a counted error
            return "error", f"{type(exc).__name__}: {exc}"[:300], {}
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            return "error", f"the judge's reply has no choices[0].message.content: {str(reply)[:120]}", {}
        try:
            return "ok", parse_score(content if isinstance(content, str) else "", self.cfg), {}
        except ValueError as exc:
            return "non_number", str(exc), {}

    def outcomes(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        """One outcome per completion, in order (at most ``concurrency`` requests in flight)."""
        return list(self._pool.map(self.score_one, completions, examples))


__all__ = ["DEFAULT_TEMPLATE", "JudgeConfig", "JudgeScorer", "chat_url", "parse_score"]
