"""Structured outputs: a request's grammar (JSON schema, any JSON object, regex, choice, Lark grammar) as a token
mask applied to its rows' logits in the sampler, so every completion that ends by EOS matches the grammar.

Engine: llguidance (the ``llguidance`` package: a Rust core behind an abi3 wheel, no torch dependency, the grammar
engine vLLM and SGLang offer). Chosen over xgrammar because it computes masks lazily per step (no per-schema
precompilation over the whole vocabulary, so a new schema costs ~1 ms, not seconds, which matters when every
request may bring its own schema), supports JSON schema, regex, Lark and choices through one API, handles
tokenizers with any vocabulary through its token trie, and its wheel installs without a matching torch build.

- ``GrammarCache(tokenizer, vocab_size, eos_ids, num_threads=None, lanes=None, rows_per_lane=None)``: the llguidance
  tokenizer (built once per engine) and, per distinct ``StructuredOutputs`` (kind, spec), up to ``lanes`` compiled
  matchers kept as templates (an LRU of ``max_entries`` specs): a request's sequences get ``deep_copy()`` s of them.
  A ``deep_copy`` shares its template's lexer (the lazily built DFA behind one mutex in llguidance; measured: a copy
  reuses the DFA states another copy built), so the masks of rows sharing one lexer contend for its mutex; a lane is
  a separately compiled template (its own lexer and DFA; a compile each, ~0.5 ms for the bench schema, up to ~100 ms
  for huge grammars), compiled when a copy first reaches it. Copy number ``c`` of a spec goes to lane
  ``(c // rows_per_lane) % lanes``.

  **Lanes rule** (``lanes=None``, the engine's default, ``RolloutConfig.grammar_lanes = None``): ``auto_lanes``:
  one lane per executor thread on a host with at least ``AUTO_LANES_MIN_THREADS`` (4) of them, else 1, and copies
  handed out ``ROWS_PER_LANE`` (16) at a time. So a spec with at most 16 rows in flight (a lone request and the next
  15 rows: the second request never compiles) stays on one template, and a B256 rollout on a 16-thread host spreads
  over 16 lanes of 16 rows (16 compiles of the spec in all, each once). Below 4 threads there is nothing to spread over
  (2 CPUs: 2 lanes gave no measurable gain, and each lane rebuilds its own DFA states), so the path is one lane as
  before. ``lanes=N`` (``RolloutConfig.grammar_lanes = N``, ``polyrl bench rollout --grammar-lanes N``) forces N
  lanes, round-robin (``rows_per_lane`` 1). H200 (16 CPUs, 16 executor threads; qwen3-0.6b, B256, 128 in / 256 out,
  ``BENCH_SCHEMA``; 2026-12-02 round3d call2): free decode 4.43 ms per step; 1 lane: masks 3.82 ms per step,
  guided step 6.88 ms, cost 35.6%; 16 lanes: masks 1.47 ms, step 5.09 ms, cost 12.9% (before the trims below).
  ``compiles`` / ``hits`` count how often a spec was new or reused; ``mask_calls`` / ``mask_s`` / ``mask_max_s``
  the host time of the batched masks per step (what a guided step waits for when it exceeds the forward). A grammar
  llguidance refuses is a ``UserError`` naming what it found, raised in ``LLM.add_request`` (the caller's thread:
  the server answers 400).
- The executor (llguidance's ``LLExecutor``: a rayon pool; its calls release the GIL) has ``num_threads`` threads,
  default ``host_threads()``: the CPUs this process may run on (``os.sched_getaffinity``), at most 32. llguidance's
  own default is 80% of them (1 thread on a 2-CPU host: B256 masks 2.12 ms there vs 1.58 ms with 2 threads).
- ``fill_guides(guides, bitmask)``: each guided row's allowed tokens as bits (int32 words, LSB first) in a host
  buffer, one executor call, the rows handed over grouped by lane (the pool splits the list into contiguous chunks,
  so threads mostly work on different lanes). ``mask_pairs(guides)`` is that (matcher, row) list, built once per
  draw plan (a launch's steps reuse it) and filled by ``fill_pairs``; ``fill_bitmask(matchers, bitmask)`` is the
  same for bare matchers.
- Tokens are consumed one row at a time outside guided launches (``Guide.consume_at`` / ``Guide.advance``). Inside
  a guided launch ``GrammarCache.consume(pairs, tokens)`` feeds a step's rows: with several lanes (``par_consume``)
  one ``LLExecutor.consume_token_par`` call in lane order (the GIL released, each lane's lexer on the executor's
  threads: a single ``consume_token`` holds the GIL for its whole Rust body, ~3 us per row, 0.53 ms of every B256
  step on the H200 with one lane); with one lane the per-row calls (one lexer mutex: ``consume_token_par`` was
  slower at B256 on 2 CPUs, 0.88-0.94 ms vs 0.73 ms per step). No llguidance call consumes and computes the next
  mask at once (``unsafe_compute_mask_ptr_with_draft_token`` rolls its draft back).
- ``MaskBuffers``: the persistent pinned host buffer those bits are computed into and the device buffer they are
  copied to (queued, no host wait, no allocation per step; on CUDA on a side stream, so the copy overlaps the forward
  and only the apply waits for it: ``MaskBuffers.applied`` marks where the previous masks' reader was queued). The
  sampler applies them with
  ``kernels.apply_token_bitmask`` (one pass per guided row on the device: the masked logits and the logsumexps
  of the unmasked and the masked rows; Triton on CUDA, torch reference elsewhere); ``allowed_mask`` is
  that op's mask alone, as booleans. The mask is applied to the logits *after* the model's forward (and
  after a CUDA graph replay of it), so captured graphs stay valid. ``fill(..., beside=f)`` computes the masks on a
  worker thread while ``f()`` runs on the caller's (the engine reads the previous launch there); ``start(pairs)``
  computes a step's first rows' masks on that worker while the caller feeds the other rows' matchers, and the
  next ``fill`` computes the rest and joins (the feed/mask pipeline of ``overlap.GuidedDraws``).
- Overlap (``overlap.GuidedDraws``, ``LLM._launch_guided``): the mask of step N+1 depends on the token of step N,
  but the forward of step N+1 does not. So with ``overlap_decode`` a guided batch decodes ``decode_steps`` steps
  per launch like a free one: each step's forward is queued first, then the host reads the previous step's tokens,
  the matchers consume them (ahead of the engine accepting them: ``Guide.consumed`` vs ``Guide.num_tokens``) and
  the masks are computed while the device runs the forward; only the masked draw waits for them. Opt-in
  (``overlap.PIPELINE``, off: slower on the H200, see there): from a launch's second step on, with 32+ rows over
  several lanes, half the rows (cut where the lane changes) are fed and their
  masks started on the worker before the other half is fed, so feeding overlaps masks (``overlap.PIPELINE_ROWS``;
  one lane: no pipeline, every consume would wait for the lexer mutex the masks hold). No launch graphs for guided
  batches (a draw needs the host between steps). ``HostTimes`` says where that host time goes.

JSON grammars use one fixed layout (``JSON_STYLE``: ``{"a": 1, "b": [2, 3]}``, as ``json.dumps`` and chat templates
write it): llguidance's default allows any run of whitespace, which an untrained or weakly trained model fills until
``max_tokens``; a schema's own ``x-guidance`` options override it.
Not here: which rows are guided (``sampler.py``), request fields (``polyrl.server``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from polyrl.errors import UserError
from polyrl.infer.sampling_params import StructuredOutputs
from polyrl.kernels.token_bitmask.reference import unpack_bitmask
from polyrl.platform import device as platform_device

# JSON as Python's json.dumps writes it (and as chat templates render tool calls): ", " and ": ", no other whitespace
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar_text(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance's compact-whitespace option (``x-guidance``) added at its top level."""
    out = dict(schema)
    out["x-guidance"] = {**JSON_STYLE, **(schema.get("x-guidance") or {})}
    return out


def host_threads() -> int:
    """The CPUs this process may run on (its affinity mask, which container CPU sets also restrict), at most 32."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 32))


# Automatic lanes (GrammarCache(lanes=None)): consecutive copies of a spec share a lane in blocks of this many rows, so
# a spec with at most this many rows in flight (a lone request, a few concurrent ones) stays on one compiled template
# and a B256 rollout spreads over 16 lanes
ROWS_PER_LANE = 16
# ... and below this many executor threads a spec keeps one lane (CPU measurement in docs/performance.md)
AUTO_LANES_MIN_THREADS = 4


# MaskBuffers: the masks' upload on a side stream where the device has streams (off: on the compute stream, after the
# forward, as before; ``polyrl bench rollout --guided-ab inline-upload`` times that)
SIDE_STREAM_UPLOAD = True


def auto_lanes(threads: int) -> int:
    """The lanes ``GrammarCache`` gives a spec by default: one per executor thread on a host with at least
    ``AUTO_LANES_MIN_THREADS`` of them (threads then mask rows of separate lexers), else 1."""
    return threads if threads >= AUTO_LANES_MIN_THREADS else 1


def _llg() -> Any:
    try:
        # lazy: llguidance is an optional dependency (the `serve` extra), needed only for structured outputs
        import llguidance
    except ImportError as exc:
        raise UserError(
            "structured outputs need the llguidance package: pip install 'polyrl[serve]' (or llguidance)"
        ) from exc
    return llguidance


def to_grammar(so: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of a structured-output spec; ``UserError`` for a malformed one."""
    llg = _llg()
    try:
        if so.kind == "json":
            schema = json.loads(so.spec)
            if not isinstance(schema, dict):
                raise UserError("a JSON schema must be a JSON object")
            return llg.LLMatcher.grammar_from_json_schema(json_schema_grammar_text(schema))
        if so.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(json_schema_grammar_text({"type": "object"}))
        if so.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(so.spec)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            lark = "start: " + " | ".join(json.dumps(c) for c in choices)
            return llg.LLMatcher.grammar_from_lark(lark)
        if so.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(so.spec)
        if so.kind == "grammar":
            return llg.grammar_from("grammar", so.spec)  # Lark, or GBNF (converted)
    except UserError:
        raise
    except Exception as exc:  # llguidance's ValueError / RuntimeError for what it cannot parse
        raise UserError(f"invalid {so.kind} for structured output: {exc}") from None
    raise UserError(f"unknown structured output kind {so.kind!r}")


class GrammarCache:
    """Compiled grammars per structured-output spec for one engine (one tokenizer). Thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: list[int] | frozenset[int],
        max_entries: int = 256,
        num_threads: int | None = None,
        lanes: int | None = None,
        rows_per_lane: int | None = None,
    ):
        if tokenizer is None:
            raise UserError("structured outputs need a tokenizer; build the LLM with one")
        llg = _llg()
        # lazy: llguidance.hf imports transformers, which only engines with a tokenizer have loaded anyway
        import llguidance.hf

        try:
            self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        except ValueError as exc:
            raise UserError(f"structured outputs need a fast (Rust) tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.max_entries = max_entries
        self.num_threads = max(1, num_threads or host_threads())
        if lanes is not None and lanes < 1:
            raise UserError(f"grammar lanes must be >= 1 (or None: chosen from the host's threads), got {lanes}")
        if rows_per_lane is not None and rows_per_lane < 1:
            raise UserError(f"rows_per_lane must be >= 1, got {rows_per_lane}")
        # lanes None: auto_lanes(threads), copies handed out in blocks of ROWS_PER_LANE; a given N: round-robin
        self.auto = lanes is None
        self.lanes = auto_lanes(self.num_threads) if lanes is None else lanes
        self.rows_per_lane = rows_per_lane or (ROWS_PER_LANE if lanes is None else 1)
        # consume a step's tokens in one executor call (``consume``): only across lanes (separate lexer mutexes) and
        # from AUTO_LANES_MIN_THREADS threads: with one lane the per-row calls were faster, and on 2 CPUs over 2 lanes
        # too (engine, B256: 3.1 vs 1.4 ms per step; scripts/structured_host_profile.py)
        self.par_consume = self.lanes > 1 and self.num_threads >= AUTO_LANES_MIN_THREADS
        self.compiles = 0
        self.hits = 0
        self.mask_calls = 0  # fill calls (one per guided step), their total and slowest host seconds
        self.mask_s = 0.0
        self.mask_max_s = 0.0
        self.times = HostTimes()  # where a guided launch's host time goes (filled by overlap.GuidedDraws)
        # per spec: its lanes' templates (compiled as copies reach them), its grammar, the copies handed out so far
        self._cache: OrderedDict[StructuredOutputs, list] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llg.LLExecutor(num_threads=self.num_threads)
        self._llg = llg

    def _copy(self, so: StructuredOutputs) -> tuple[Any, int]:
        """(a fresh matcher for ``so``, its lane). The compile runs under the cache's lock, so concurrent requests
        with one schema compile it once (the others wait for it: milliseconds)."""
        with self._lock:
            entry = self._cache.get(so)
            if entry is not None:
                self._cache.move_to_end(so)
                self.hits += 1
            else:
                grammar = to_grammar(so)
                entry = [[self._compile(so, grammar)], grammar, 0]
                self.compiles += 1
                self._cache[so] = entry
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
            templates, grammar, copies = entry
            entry[2] = copies + 1
            lane = (copies // self.rows_per_lane) % self.lanes
            while len(templates) <= lane:  # lanes are compiled as copies reach them: a lone request compiles once
                templates.append(self._compile(so, grammar))
            return templates[lane].deep_copy(), lane

    def _compile(self, so: StructuredOutputs, grammar: str) -> Any:
        template = self._llg.LLMatcher(self.lltok, grammar, log_level=0)
        if template.is_error():
            raise UserError(f"invalid {so.kind} for structured output: {template.get_error()}")
        return template

    def matcher(self, so: StructuredOutputs) -> Any:
        """A fresh matcher (its own state) for one sequence of a request with ``so``."""
        return self._copy(so)[0]

    def guide(self, so: StructuredOutputs) -> Guide:
        matcher, lane = self._copy(so)
        return Guide(matcher, self, lane)

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` (int32 ``[>= len(matchers), words]``, CPU, contiguous) = the tokens matcher ``i``
        allows next (every word of the row is written). A matcher in an error state (it cannot happen for tokens
        drawn under its own mask) allows only EOS, so the sequence ends."""
        self.fill_pairs([(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_guides(self, guides: list[Guide], bitmask: torch.Tensor) -> None:
        """``fill_bitmask`` of the guides' matchers, handed to the executor grouped by lane (module docstring)."""
        self.fill_pairs(self.mask_pairs(guides), bitmask)

    def mask_pairs(self, guides: list[Guide]) -> list[tuple[Any, int]]:
        """(matcher, row) per guide, grouped by lane: what ``fill_pairs`` hands the executor. A batch's pairs stay
        valid while its guides do (the sampler builds them once per draw plan, not every step)."""
        return [(guides[i].matcher, i) for i in self._order(guides)]

    def fill_pairs(self, pairs: list[tuple[Any, int]], bitmask: torch.Tensor, account: bool = True) -> float:
        """Row ``i`` of ``bitmask`` = the tokens the matcher paired with ``i`` allows next (``mask_pairs``); returns
        the call's host seconds, counted as one step's masks unless ``account`` is False (a part of a step's rows:
        the caller then counts the parts' sum with ``account_mask``)."""
        t0 = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])
        dt = time.perf_counter() - t0
        if account:
            self.account_mask(dt)
        return dt

    def consume(self, pairs: list[tuple[Any, int]], tokens: list[int]) -> None:
        """Each matcher of ``pairs`` (``mask_pairs``: (matcher, row), grouped by lane) consumes ``tokens[row]``. With
        several lanes: one ``LLExecutor.consume_token_par`` call (the GIL released, the lanes' lexers on the
        executor's threads; ``par_consume``); with one lane a ``consume_token`` per row from this thread (every consume
        would take the one lexer's mutex, so the pool's hand-off would buy nothing). Same calls into llguidance either
        way (``consume_token`` is ``consume_token_par``'s per-row body), so the matchers end in the same states; a
        token a matcher refuses leaves it in its error state in both (its next mask allows only EOS)."""
        if self.par_consume and len(pairs) > 1:
            self._executor.consume_token_par([(m, tokens[i]) for m, i in pairs])
        else:
            for m, i in pairs:
                m.consume_token(tokens[i])

    def account_mask(self, seconds: float) -> None:
        """Count one step's masks that took ``seconds`` of executor calls (the bench's mask ms per step)."""
        self.mask_calls += 1
        self.mask_s += seconds
        self.times.mask += seconds
        self.mask_max_s = max(self.mask_max_s, seconds)

    def _order(self, guides: list[Guide]) -> range | list[int]:
        """The indices of ``guides`` grouped by lane (stable; no sort with one lane)."""
        if self.lanes == 1:
            return range(len(guides))
        lanes = [g.lane for g in guides]
        return sorted(range(len(guides)), key=lanes.__getitem__)


class HostTimes:
    """Host seconds of the guided decode launches (``overlap.GuidedDraws`` and ``LLM._launch_guided``), for the
    bench's breakdown: ``wait`` for a step's tokens to reach the host, ``consume`` (the matchers eat them; with the
    feed/mask pipeline also handing the first half's masks to the worker), ``mask`` (computing the next masks: the
    executor calls' seconds summed, also in ``GrammarCache.mask_s``; with the pipeline the first half's call runs
    during the second half's consumes), ``draw`` (queueing the mask upload, the masked draw and the token copy;
    the time the draw's ``MaskBuffers.fill`` waited for masks excluded), ``read`` (the previous launch's
    bookkeeping: accepting its tokens, stop checks; run on the engine's thread a step at a time, each while a step's
    masks are computed on a worker, so its time overlaps ``mask``), ``launch`` (whole launches: all of the above
    plus queueing the forwards and building the draw plan), over ``steps`` decode steps in ``launches`` launches."""

    __slots__ = ("wait", "consume", "mask", "draw", "launch", "read", "steps", "launches")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wait = self.consume = self.mask = self.draw = self.launch = self.read = 0.0
        self.steps = self.launches = 0

    def ms_per_step(self) -> dict[str, float]:
        """Each part in host milliseconds per guided decode step."""
        n = max(self.steps, 1)
        parts = ("wait", "consume", "mask", "draw", "launch", "read")
        return {k: 1e3 * getattr(self, k) / n for k in parts}


class Guide:
    """One sequence's grammar state: its matcher, the cache that made it (for the batched mask), its lane there, and
    the mismatch the mask caused so far: the sum over its tokens of log(probability mass the grammar allowed).

    ``num_tokens`` counts the tokens the engine accepted (appended to the sequence), ``consumed`` those the matcher
    has consumed: inside a multi-step guided launch (``overlap.GuidedDraws``) the matcher consumes a token as soon as
    the host has read it, before the engine accepts it, and ``advance`` then only adds its mass."""

    __slots__ = ("matcher", "cache", "lane", "masked_logmass", "num_tokens", "consumed")

    def __init__(self, matcher: Any, cache: GrammarCache, lane: int = 0) -> None:
        self.matcher, self.cache, self.lane = matcher, cache, lane
        self.masked_logmass = 0.0
        self.num_tokens = 0
        self.consumed = 0

    def advance(self, token: int, logmass: float) -> None:
        """Accept output token number ``num_tokens`` (consumed here unless a launch consumed it already)."""
        if self.consumed == self.num_tokens:
            self.matcher.consume_token(token)
            self.consumed += 1
        self.masked_logmass += logmass
        self.num_tokens += 1

    def consume_at(self, position: int, token: int) -> None:
        """Feed output token number ``position`` to the matcher ahead of its acceptance (no-op if it has it)."""
        if self.consumed == position:
            self.matcher.consume_token(token)
            self.consumed += 1
        elif position > self.consumed:  # a token skipped: the next mask would be computed on a stale state
            raise RuntimeError(f"grammar matcher fed token {position} before token {self.consumed}")


class MaskBuffers:
    """The guided rows' bitmask of one step, made on the host and handed to the device without new allocations:
    a persistent pinned host buffer that llguidance fills in place, and a persistent device buffer it is copied to
    (queued, no wait). Before the host buffer is refilled, the host waits for the previous copy out of it (an event;
    long done by then: the engine has read that step's tokens). Grows (to the next power of two rows) when a batch
    has more guided rows than it holds. On the CPU the host buffer is the mask.

    ``start`` computes the masks of a step's first rows on a worker thread while the caller feeds the other rows'
    matchers their tokens (``overlap.GuidedDraws`` at steps >= 1); the next ``fill`` computes the rest and joins.
    ``last_s``: the host seconds the last ``fill`` spent on masks (its own executor call, waiting for the worker's,
    or the whole of ``beside``), which the bench's draw time excludes."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._event: Any = None
        # the side stream of the uploads (_upload), its copy-done event, the previous masks' readers' event and whether
        # applied() marked it since the last upload
        self._stream: Any = None
        self._copied: Any = None
        self._readers: Any = None
        self._marked = False
        self.side_copies = 0  # uploads queued on the side stream
        self._pool: ThreadPoolExecutor | None = None  # the worker of fill(beside=...) and start, made on first use
        self._ahead: tuple[Any, int] | None = None  # start's (future of its seconds, rows it took)
        self.last_s = 0.0
        self.starts = 0  # steps whose masks were pipelined (start)

    def _buffer(self, n: int, words: int, dev: torch.device) -> torch.Tensor:
        """The host buffer, holding at least ``n`` rows for ``dev``, the previous copy out of it done."""
        pinned = dev.type != "cpu"
        host = self._host
        if (
            host is None
            or host.shape[0] < n
            or host.shape[1] != words
            or (self._dev is not None) != pinned
            or (pinned and self._dev.device != dev)
        ):
            if self._ahead is not None:  # start and fill of one step agree on its rows
                raise RuntimeError("MaskBuffers.fill: the rows differ from the ones start was given")
            cap = 1 << max(n - 1, 0).bit_length()
            self._wait()
            host = self._host = torch.empty((cap, words), dtype=torch.int32, pin_memory=pinned)
            self._dev = torch.empty((cap, words), dtype=torch.int32, device=dev) if pinned else None
        self._wait()
        return host

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-grammar-mask")
        return self._pool

    def start(self, cache: GrammarCache, pairs: list[tuple[Any, int]], n: int, dev: torch.device) -> None:
        """Compute the masks of ``pairs`` (the first of the step's ``n`` rows' ``mask_pairs``) on the worker thread
        now; returns once the worker is inside llguidance. The caller must not touch those matchers until the next
        ``fill`` (given all ``n`` pairs, these first) has joined it."""
        if self._ahead is not None:
            raise RuntimeError("MaskBuffers.start: the previous start was not joined by a fill")
        host = self._buffer(n, cache.words, dev)[:n]
        started = threading.Event()

        def work() -> float:
            started.set()
            return cache.fill_pairs(pairs, host, account=False)

        self._ahead = (self._worker().submit(work), len(pairs))
        self.starts += 1
        started.wait()

    def fill(
        self,
        cache: GrammarCache,
        pairs: list[tuple[Any, int]],
        dev: torch.device,
        beside: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """int32 ``[len(pairs), words]`` on ``dev``: the tokens each guide allows next (``pairs``:
        ``cache.mask_pairs(guides)``). ``beside``: host work run on this thread while the masks are computed on a
        worker thread (llguidance releases the GIL), which then must not touch these guides' matchers. After
        ``start`` (no ``beside`` then), the rows it did not take are computed here while the worker finishes."""
        n = len(pairs)
        host = self._buffer(n, cache.words, dev)
        t0 = time.perf_counter()
        if self._ahead is not None:
            future, h = self._ahead
            self._ahead = None
            if beside is not None:
                future.result()
                raise RuntimeError("MaskBuffers.fill: beside work after start")
            try:
                dt = cache.fill_pairs(pairs[h:], host[:n], account=False)
            finally:
                ahead_s = future.result()  # joined also when this thread's part raised
            cache.account_mask(dt + ahead_s)
        elif beside is None:
            cache.fill_pairs(pairs, host[:n])
        else:
            self._fill_beside(cache, pairs, host[:n], beside)
        self.last_s = time.perf_counter() - t0
        if self._dev is None:
            return host[:n]
        return self._upload(host[:n], self._dev[:n])

    def _upload(self, host: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Queue the copy of the filled host rows to the device buffer; ``out`` is ready for the current stream.

        Where the device has streams the copy runs on a side stream (made once), so it overlaps the forward already
        queued on the current stream (4.9 MB per B256 step over PCIe, ~0.1 ms that the masked draw otherwise waits
        for after the forward); the current stream waits for the copy's event before the caller's apply. The copy
        itself first waits for the previous masks' readers: the point of the current stream ``applied()`` marked
        (the previous step's apply), or without that mark all the work queued there (never overwriting masks an
        apply still has to read)."""
        streams = platform_device.stream_api() if SIDE_STREAM_UPLOAD else None
        if streams is None:  # a device without streams (or graphs): the copy on the current stream, as it is ordered
            out.copy_(host, non_blocking=True)
            self._event = platform_device.event(enable_timing=False)
            if self._event is not None:
                self._event.record()
            return out
        main = streams.current_stream(out.device)
        if self._stream is None or self._stream.device != out.device:
            self._stream = streams.Stream(device=out.device)
            self._copied = streams.Event(enable_timing=False)
            self._readers = streams.Event(enable_timing=False)
        side = self._stream
        if self._marked:
            side.wait_event(self._readers)
        else:
            side.wait_stream(main)
        with streams.stream(side):
            out.copy_(host, non_blocking=True)
            self._copied.record(side)
        main.wait_event(self._copied)
        self._event = self._copied  # the host buffer is refilled after this copy (_wait)
        self._marked = False
        self.side_copies += 1
        return out

    def applied(self) -> None:
        """Mark the current stream right after the work reading the masks ``fill`` returned was queued (the sampler's
        apply): the next ``fill``'s copy into the device buffer waits for that point only, not for the forward queued
        after it. A no-op on the CPU and where the copy is not on a side stream."""
        if self._stream is not None:
            self._readers.record()
            self._marked = True

    def _fill_beside(self, cache: GrammarCache, pairs: list, host: torch.Tensor, beside: Callable) -> None:
        """``cache.fill_pairs`` on the worker thread while ``beside()`` runs here. This thread waits until the worker
        is about to enter llguidance (which releases the GIL), so ``beside``'s Python does not hold the worker back
        for a GIL switch interval; it waits for the masks after ``beside`` returns (or raises). The worker must make
        one llguidance call only: back in Python between two, it would wait for the GIL ``beside`` holds."""
        started = threading.Event()

        def work() -> None:
            started.set()
            cache.fill_pairs(pairs, host)

        future = self._worker().submit(work)
        started.wait()
        try:
            beside()
        finally:
            future.result()

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def allowed_mask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[B, vocab]``: which tokens a bitmask ``[B, words]`` (int32 words, LSB first) allows."""
    return unpack_bitmask(bitmask, vocab)


__all__ = [
    "GrammarCache",
    "Guide",
    "HostTimes",
    "MaskBuffers",
    "allowed_mask",
    "host_threads",
    "to_grammar",
    "json_schema_grammar_text",
    "JSON_STYLE",
]
