"""A distillation teacher behind an OpenAI-compatible server (``--teacher-url URL``): ``polyrl serve`` or vLLM.

``RemoteTeacher.score(samples)`` sends each ``prompt + completion`` as a token-id prompt to ``/v1/completions`` with
``prompt_logprobs: 0`` (vLLM's field, which ``polyrl serve`` answers the same way: per prompt position a
``{token_id: {"logprob": ...}}`` entry, the first ``null``), ``max_tokens: 1`` and greedy sampling, and reads the
log-prob of every completion token (of every policy token of a masked sample). Requests carry ``batch_size``
prompts each and at most ``concurrency`` are in flight; a connection error, a timeout (``timeout`` seconds), a 429
or a 5xx is retried ``retries`` times with exponential back-off; any other answer raises at once with the server's
message.

The tokenizer check (on the first step): the server's model is asked to score a probe text sent as TEXT; the ids
it reports (the keys of its ``prompt_logprobs`` entries) must be the ids the student's tokenizer gives that text
(one leading BOS the server adds is allowed), and the ids the student can sample must be below the server's
vocabulary (a 400 for an out-of-range id says which). A mismatch is a ``ConfigError`` naming both.

Standard library only (urllib). Not here: the in-process teacher (``distill.TeacherScorer``), the advantages.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from polyrl.algorithms.rl_batch import Sample
from polyrl.errors import ConfigError

PROBE_TEXT = "What is 57 + 2? The answer: 59. Hello, world!"
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class TeacherServerError(ConfigError):
    """The teacher server answered with an error that retrying cannot fix (or kept failing)."""


def base_url(url: str) -> str:
    """``http://host:port``, ``.../v1`` or ``.../v1/completions`` -> ``http://host:port/v1``."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise ConfigError(f"teacher_url {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
    for tail in ("/completions", "/v1"):
        if u.endswith(tail):
            u = u[: -len(tail)]
    return u + "/v1"


class RemoteTeacher:
    """The teacher's per-token log-probs of the student's samples, from a server (see the module docstring)."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        timeout: float = 120.0,
        retries: int = 3,
        concurrency: int = 4,
        batch_size: int = 16,
        backoff: float = 0.5,
        api_key_env: str = "OPENAI_API_KEY",
    ) -> None:
        self.base = base_url(url)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.concurrency, self.batch_size = max(1, concurrency), max(1, batch_size)
        self.api_key_env = api_key_env
        self._model = model
        self.requests = 0  # HTTP requests sent (retries included)
        self.retried = 0

    # ---- HTTP ---------------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env or "", "")
        if key:
            h["Authorization"] = f"Bearer {key}"
        return h

    def _once(self, path: str, body: dict | None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers=self._headers())
        self.requests += 1
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw, kind = resp.read(), resp.headers.get("Content-Type", "no content type")
        try:
            out = json.loads(raw.decode(errors="replace"))
        except ValueError:
            out = None
        if not isinstance(out, dict):  # a web page, a login proxy: not an OpenAI-compatible server
            head = raw[:200].decode(errors="replace")
            raise TeacherServerError(
                f"teacher server {self.base}{path} answered {kind}, not JSON: {head!r}; --teacher-url must point "
                "at an OpenAI-compatible server (polyrl serve, vLLM)"
            )
        return out

    def request(self, path: str, body: dict | None = None) -> dict:
        """POST ``body`` (GET when None) to ``<base>/<path>``, retrying transient failures."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._once(path, body)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:500]
                if exc.code not in RETRY_STATUS:
                    raise TeacherServerError(
                        f"teacher server {self.base}{path} answered {exc.code}: {detail}"
                    ) from None
                last = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        raise TeacherServerError(
            f"teacher server {self.base}{path} failed {self.retries + 1} time(s), last: {last}; check --teacher-url "
            "and that the server is up (raise distill timeout/retries for a slow one)"
        )

    @property
    def model(self) -> str:
        """The served model's name (the first ``/v1/models`` lists, unless given)."""
        if self._model is None:
            cards = self.request("/models").get("data") or []
            if not cards:
                raise TeacherServerError(f"teacher server {self.base} lists no model at /v1/models")
            self._model = str(cards[0]["id"])
        return self._model

    # ---- scoring ------------------------------------------------------------------------------------------
    def prompt_logprobs(self, prompts: list[Any]) -> list[list[tuple[int | None, float | None]]]:
        """Per prompt (token ids or text), per position: (token id, log-prob) as the server reports them
        (``(None, None)`` at position 0)."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        out = self.request("/completions", body)
        choices = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise TeacherServerError(f"teacher server returned {len(choices)} choices for {len(prompts)} prompts")
        rows = []
        for c in choices:
            entries = c.get("prompt_logprobs")
            if entries is None:
                raise TeacherServerError(
                    f"teacher server {self.base} returned no prompt_logprobs; it must support vLLM's prompt_logprobs "
                    "field on /v1/completions (polyrl serve and vLLM do)"
                )
            rows.append([_own_logprob(e) for e in entries])
        return rows

    def check_tokenizer(self, student: Any, vocab_size: int | None = None) -> None:
        """A ``ConfigError`` unless the server tokenizes the probe text into the student's ids."""
        if student is None or not hasattr(student, "encode"):
            return
        want = list(student.encode(PROBE_TEXT, add_special_tokens=False))
        (row,) = self.prompt_logprobs([PROBE_TEXT])
        got = [t for t, _ in row[1:]]
        tail = want[1:]
        if len(got) < len(tail) or got[len(got) - len(tail) :] != tail or len(row) > len(want) + 1:
            raise ConfigError(
                f"the teacher at {self.base} ({self.model}) tokenizes differently from the student: the probe "
                f"{PROBE_TEXT!r} is {len(want)} student tokens {want[:8]}... and {len(row)} server tokens "
                f"(ids after the first: {got[:8]}...); distillation compares log-probs of the same token ids, so "
                "serve a teacher of the student's tokenizer family"
            )

    def score(self, samples: list[Sample]) -> list[list[float]]:
        """Per sample, the teacher's log-prob of each completion token (each policy token of a masked sample)."""
        prompts = [list(s.prompt_ids) + list(s.completion_ids) for s in samples]
        chunks = [prompts[i : i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]
        if len(chunks) == 1 or self.concurrency == 1:
            rows = [r for ch in chunks for r in self.prompt_logprobs(ch)]
        else:
            with ThreadPoolExecutor(min(self.concurrency, len(chunks))) as pool:
                rows = [r for part in pool.map(self.prompt_logprobs, chunks) for r in part]
        out = []
        for i, (s, ids, row) in enumerate(zip(samples, prompts, rows)):
            if len(row) != len(ids):
                raise TeacherServerError(f"sample {i}: {len(row)} prompt log-probs for a {len(ids)}-token prompt")
            lps = []
            for pos in range(len(s.prompt_ids), len(ids)):
                tok, lp = row[pos]
                if tok is not None and tok != ids[pos] or lp is None:
                    raise TeacherServerError(f"sample {i}, token {pos}: the server scored id {tok}, not {ids[pos]}")
                lps.append(float(lp))
            if s.mask is not None:
                lps = [lp for lp, m in zip(lps, s.mask) if m]
            out.append(lps)
        return out


def _own_logprob(entry: Any) -> tuple[int | None, float | None]:
    """(token id, log-prob) of a vLLM ``prompt_logprobs`` entry ``{id: {"logprob", "rank", ...}}`` with k = 0: the
    prompt token itself (rank given) is the one entry, or the one whose rank is not among the top-k."""
    if entry is None:
        return None, None
    if len(entry) == 1:
        ((tok, info),) = entry.items()
        return int(tok), float(info["logprob"] if isinstance(info, dict) else info)
    raise TeacherServerError(f"expected one prompt_logprobs entry per position (prompt_logprobs: 0), got {len(entry)}")


__all__ = ["RemoteTeacher", "TeacherServerError", "base_url"]
