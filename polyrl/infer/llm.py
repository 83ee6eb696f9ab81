"""``LLM``: the rollout and serving engine's public API (see ``polyrl/infer/__init__.py`` for the contract).

Wires the parts: ``KVCache`` (tensors), ``BlockManager`` (blocks, prefix cache), ``Scheduler`` (continuous
batching), ``ModelRunner`` (forward, CUDA graphs), ``Sampler`` and ``stopping``. One ``step()`` schedules,
runs the model once, samples, checks stops and reports the requests that changed. ``generate()`` launches
decode steps one ahead of reading their tokens (``overlap.py``; ``RolloutConfig.overlap_decode``).

Weight swaps mid-generation (partial rollouts of async RL): ``generate(..., between_steps=fn)`` calls ``fn(llm,
steps)`` at every step boundary; there ``swap_weights(load, version)`` reads the step in flight, lets ``load()``
change the weights in place and from then on stamps each generated token with ``version`` (``policy_version``;
``CompletionOutput.token_versions``). The sequences in flight keep their KV cache: the keys and values of their
earlier tokens stay those the older weights computed (as in AReaL's partial rollouts); only new positions use the
new weights.

Threading: ``add_request`` and ``abort_request`` may be called from any thread (they validate in the
caller's thread and hand the request over through a queue); ``step()``, ``generate()`` and ``chat()`` must
be driven by one thread at a time (the server's engine thread, or the trainer).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from polyrl.errors import UserError
from polyrl.infer.block_manager import BlockManager
from polyrl.infer.config import RolloutConfig
from polyrl.infer.detokenizer import Detokenizers
from polyrl.infer.fp8_weights import Fp8Weights
from polyrl.infer.fused_projections import FusedProjections
from polyrl.infer.kv_cache import KVCache
from polyrl.infer.model_runner import ModelRunner
from polyrl.infer.overlap import GuidedDraws, InflightStep, feed_rows, guided_launch_steps
from polyrl.infer.sampler import Sampler
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.scheduler import Scheduler
from polyrl.infer.sequence import CompletionOutput, PromptLogprobs, RequestOutput, Sequence, Status
from polyrl.infer.stopping import check_stop
from polyrl.models.checkpoint import load_model, load_tokenizer
from polyrl.models.lora.multi import attach_adapters
from polyrl.platform import device as platform_device
from polyrl.platform.host import gc_paused


class _Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "seqs", "stream")

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, stream: bool
    ):
        self.stream = stream
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs: list[Sequence] = []


def _drop_pending(seqs: list[Sequence]) -> None:
    """Aborted sequences lose the placeholder of a step in flight (that row's result is dropped when read)."""
    for s in seqs:
        if s.pending:
            del s.tokens[-s.pending :]
            s.pending = 0


class LLM:
    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: RolloutConfig | None = None) -> None:
        self.model = model  # a reference: colocated training updates these very tensors
        self.tokenizer = tokenizer
        self.detokenizers = Detokenizers(tokenizer)  # per-sequence detokenizers for stop strings and streaming
        self.config = config or RolloutConfig()
        mcfg = model.config
        param = next(model.parameters())
        # FP8 rollout weights (RolloutConfig.weight_precision): made before the KV cache is sized from free memory
        fp8 = Fp8Weights.for_engine(model, self.config.weight_precision, self.config.fuse_projections)
        # ... and so are fused q/k/v + gate/up copies (RolloutConfig.fuse_projections; under FP8 weights the FP8 copies
        # fuse their groups instead)
        fused = FusedProjections.for_engine(model, self.config.fuse_projections, self.config.weight_precision)
        self.kv = KVCache(self.config, mcfg, param.dtype, param.device)
        limit = self.config.max_model_len or mcfg.max_position_embeddings
        # A sequence can never need more than the whole cache: that also guarantees a preempted
        # sequence fits again once the others are gone.
        self.max_model_len = min(limit, self.kv.num_blocks * self.config.block_size)
        self.block_manager = BlockManager(self.kv.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(model, self.kv, self.config, self.max_model_len, fp8, fused)
        self.sampler = Sampler()
        eos = set(mcfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = mcfg.vocab_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._inflight: InflightStep | None = None  # a decode step launched ahead and not yet read
        self.num_steps_ahead = 0  # decode steps launched before the previous launch was read
        self.num_launches_ahead = 0  # launches of those steps (decode_steps per launch where possible)
        self.num_mixed_ahead = 0  # prompt (or prompt + decode) steps launched before the previous one was read
        self._grammars: Any = None  # structured outputs: GrammarCache, made on the first request that has one
        self._grammars_lock = threading.Lock()  # the server's request-preparation threads may ask for it at once
        self._finished: list[Sequence] | None = None  # sequences finished since generate() last looked (on_finish)
        # stamped on every generated token when not None (Sequence.versions; partial rollouts, swap_weights)
        self.policy_version: int | None = None
        self._held: list[RequestOutput] = []  # outputs read by swap_weights' flush, returned by the next step()

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str,
        config: RolloutConfig | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> LLM:
        """Load an HF checkpoint directory (weights + tokenizer) and build an engine over it."""
        dev = torch.device(device) if device is not None else platform_device.torch_device()
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if dtype is None:
            dtype = torch.bfloat16 if dev.type != "cpu" and platform_device.supports_bf16() else torch.float32
        model = load_model(path, dtype=dtype, device=dev)
        model.eval()
        return cls(model, load_tokenizer(path), config)

    # ---- requests -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError("text prompts need a tokenizer; pass token ids or build the LLM with a tokenizer")
            return prompt, list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return None, ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = False,
    ) -> str:
        """Queue a request (thread-safe). Raises UserError for an empty or too long prompt."""
        params = params or SamplingParams()
        if params.adapter is not None:
            self._adapter_slot(params.adapter)  # unknown names fail here, in the caller's thread
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise UserError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise UserError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_model_len} (prompt + output); "
                f"shorten the prompt or raise max_model_len / the KV cache size"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = _Request(rid, text, ids, params, stream)
        now = time.monotonic()
        guides = [self.grammar_cache().guide(params.structured) for _ in range(params.n)] if params.structured else None
        for i in range(params.n):
            req.seqs.append(Sequence(next(self._seq_ids), rid, i, ids, params, now, stream))
            if guides:
                req.seqs[-1].guide = guides[i]
        self._inbox.put(("add", req))
        return rid

    # ---- LoRA adapters (serving) ------------------------------------------------------------------
    def load_adapters(self, adapters: dict[str, Any]) -> list[str]:
        """Serve PEFT adapter folders (name -> folder) on this engine's base model; a request picks one with
        ``SamplingParams(adapter=name)``. Adapter steps run eagerly (no CUDA graphs) and prefix caching is turned
        off (cached KV of one adapter is wrong for another). Call before any request."""
        bank = attach_adapters(self.model, adapters)
        self.block_manager.enable_prefix_caching = False
        self.runner.invalidate_graphs()
        if self.runner.fused is not None:  # the adapted modules replaced their plain linears: their copies go unused
            self.runner.fused.prune(self.model)
        return bank.names

    def _adapter_slot(self, name: str) -> int:
        bank = getattr(self.model, "lora_bank", None)
        if bank is None:
            raise UserError(f"this engine serves no LoRA adapters, so adapter {name!r} is unknown")
        return bank.slot(name)

    def grammar_cache(self) -> Any:
        """The engine's compiled structured-output grammars (``infer/structured.py``), made on first use."""
        if self._grammars is None:
            # lazy: structured.py needs llguidance, an optional package, only when a request asks for a grammar
            from polyrl.infer.structured import GrammarCache

            with self._grammars_lock:  # one cache: building the tokenizer's index takes a second or more
                if self._grammars is None:
                    cfg = self.config
                    lanes = cfg.grammar_lanes
                    self._grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids, lanes=lanes)
        return self._grammars

    def abort_request(self, request_id: str) -> None:
        """Stop a request (thread-safe); it is reported once more with finish_reason "abort"."""
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        """Drop every queued and running request now, without reporting them (e.g. after a failed
        ``generate``, so the cache can be released). Not thread-safe: call from the engine's thread."""
        self._drain_inbox()
        self._inflight = None
        for rid in list(self._requests):
            _drop_pending(self.scheduler.abort(rid))
        self._requests.clear()

    def _drain_inbox(self) -> list[_Request]:
        aborted = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return aborted
            if kind == "add":
                if item.request_id in self._requests:
                    raise UserError(f"request id {item.request_id!r} is already running; use unique ids")
                self._requests[item.request_id] = item
                for s in item.seqs:
                    self.scheduler.add(s)
            elif item in self._requests:
                _drop_pending(self.scheduler.abort(item))
                aborted.append(self._requests[item])

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or not self._inbox.empty()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self, ahead: bool = False) -> list[RequestOutput]:
        """Run one engine step. Returns an output for every streaming request that got tokens and for
        every request that finished (or was aborted) in this step.

        ``ahead=True`` (what ``generate()`` does): decode steps may be queued before the previous ones are read
        (``overlap.py``), so a request's output arrives a launch after its tokens were computed, and host work
        done between calls overlaps the device. A later plain ``step()`` or ``release()`` reads what is left."""
        if self._held:  # read by swap_weights' flush
            held, self._held = self._held, []
            return held + self._step(ahead)
        return self._step(ahead)

    def swap_weights(self, load: Callable[[], None], version: int | None = None) -> None:
        """Change the weights between two steps, requests in flight included (partial rollouts): read the step in
        flight (its tokens were computed by the current weights and are stamped with the current version; their
        outputs come with the next ``step()``), call ``load()`` (which updates the model's tensors in place), forget
        the prefix cache (its KV is the old weights') and stamp every later token with ``version``. Running
        sequences keep their blocks: the KV of their earlier tokens stays the old weights'. Call it from the thread
        driving the engine (e.g. in ``generate``'s ``between_steps``), or while the engine is idle."""
        self._held.extend(self._flush())
        load()
        self.reset_prefix_cache()
        self.policy_version = version

    def _step(self, ahead: bool) -> list[RequestOutput]:
        """One step; with ``ahead`` a decode-only step is launched before the previous one is read
        (``overlap.py``), so outputs come one step later than the tokens were computed."""
        if not self.kv.allocated:
            raise UserError("the KV cache is released; call LLM.reallocate() before generating")
        touched: dict[str, _Request] = {r.request_id: r for r in self._drain_inbox()}
        sched = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        if sched.items and ahead and self._can_launch_ahead(sched):
            seqs = [it.seq for it in sched.items]
            rows = feed_rows(seqs)
            k = self._steps_per_launch(sched)
            suppress = self._suppress(seqs) if k == 1 else None
            # Draws that need only (temperature, seed, offset, greedy) can run inside a decode launch graph.
            fused = suppress is None and k == self.config.decode_steps and self.config.launch_graphs
            draw_rows = self.sampler.rows(seqs) if fused and self.runner.use_graphs else None
            plan = []

            def draw(logits: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
                if not plan:  # built on first use: a launch graph samples without it
                    plan.append(self.sampler.plan(seqs, self.runner.device))
                return self.sampler.draw_planned(logits, plan[0], suppress, j)

            feed = (rows, prev.tokens) if rows is not None else None
            tokens, logprobs = self.runner.execute_steps(sched, feed, k, draw, draw_rows)
            for it in sched.items:
                it.seq.num_computed = it.start + k
            launched = InflightStep(seqs, tokens, logprobs)
            if prev is not None:
                self._read(prev, touched)
            launched.mark_pending()
            self._inflight = launched
            self.num_steps += k
            self.num_steps_ahead += k
            self.num_launches_ahead += 1
        elif sched.items and ahead and self._can_guide_ahead(sched):
            self._launch_guided(sched, prev, touched)
        elif sched.items and ahead and self._can_launch_mixed_ahead(sched):
            self._launch_mixed(sched, prev, touched)
        else:
            if prev is not None:
                self._read(prev, touched)
                sched.items = [it for it in sched.items if not it.seq.is_finished]  # stopped at that step
            if sched.items:
                logits = self.runner.execute(sched)
                sampling = [it.seq for it in sched.items if it.sample]
                for it in sched.items:
                    it.seq.num_computed = it.start + it.num_new
                out = self.sampler(logits, sampling, self._suppress(sampling)) if sampling else None
                for scores in self.runner.take_prompt_scores():  # before the draws: a finished request is complete
                    scores.store()
                if out is not None:
                    self._accept(sampling, out.tokens, out.logprobs, out.top_logprobs, touched, out.masses)
                self.num_steps += 1
        return self._report(touched)

    def _report(self, touched: dict[str, _Request]) -> list[RequestOutput]:
        # Non-streaming requests are reported once, when finished (building outputs copies token lists).
        outputs = [self._output(r) for r in touched.values() if r.stream or all(s.is_finished for s in r.seqs)]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _can_launch_ahead(self, sched) -> bool:
        """Decode-only steps whose results the host needs only to append and check stops (top-k alternatives
        are read on the host, so requests asking for them run synchronously)."""
        overlap = self.config.overlap_decode
        if overlap is None:
            overlap = self.runner.device.type != "cpu"
        return (
            overlap
            and sched.is_decode_only
            and not any(it.seq.params.logprobs or it.seq.guide is not None for it in sched.items)
        )

    def _can_launch_mixed_ahead(self, sched) -> bool:
        """A step with prompt chunks (and maybe decode rows) whose draws the host needs only to append and check
        stops: it is queued before the step in flight is read, like a decode launch (``overlap.py``), so the next
        step's schedule and inputs are built while its prefill runs. Prompt log-probs ride along (their copies are
        stored when the step is read, ``prompt_logprobs.PromptScores``); a row that stops by length at this token is
        not scheduled again while its token is in flight (``scheduler._stops_by_length``). Not when a row asks for
        top-k alternatives or follows a grammar (read on the host), or when a prompt chunk would need a token still
        in flight (a preempted sequence coming back)."""
        overlap = self.config.overlap_decode
        if overlap is None:
            overlap = self.runner.device.type != "cpu"
        if not overlap:
            return False
        sampling = False
        for it in sched.items:
            s = it.seq
            if s.pending and it.num_new != 1:
                return False
            if it.sample:
                if s.params.logprobs or s.guide is not None:
                    return False
                sampling = True
        return sampling

    def _launch_mixed(self, sched, prev: InflightStep | None, touched: dict[str, _Request]) -> None:
        """Queue a step with prompt chunks on the device, its draws left there (``_can_launch_mixed_ahead``); then read
        the step in flight, whose tokens feed this step's decode rows on the device."""
        rows = feed_rows([it.seq for it in sched.items])
        feed = None
        if rows is not None and prev is not None:  # per token of the step: a pending row is a one-token item
            token_rows: list[int] = []
            for it, r in zip(sched.items, rows):
                token_rows.append(r)
                token_rows.extend([-1] * (it.num_new - 1))
            feed = (token_rows, prev.tokens)
        logits = self.runner.execute(sched, feed)
        sampling = [it.seq for it in sched.items if it.sample]
        tokens, logprobs = self.sampler.draw(logits, sampling, self._suppress(sampling))
        for it in sched.items:
            it.seq.num_computed = it.start + it.num_new
        launched = InflightStep(sampling, tokens[None], logprobs[None], prompt_scores=self.runner.take_prompt_scores())
        if prev is not None:
            self._read(prev, touched)
        launched.mark_pending()
        self._inflight = launched
        self.num_steps += 1
        self.num_mixed_ahead += 1

    def _can_guide_ahead(self, sched) -> bool:
        """A decode-only batch with structured-output rows that can still run one step ahead: the forward of step
        N+1 is queued before step N's tokens are read; its draw waits for the masks (``_launch_guided``)."""
        overlap = self.config.overlap_decode
        if overlap is None:
            overlap = self.runner.device.type != "cpu"
        return overlap and sched.is_decode_only and not any(it.seq.params.logprobs for it in sched.items)

    def _launch_guided(self, sched, prev: InflightStep | None, touched: dict[str, _Request]) -> None:
        """Decode steps of a batch with grammar rows, ``_steps_per_launch`` of them per launch as on the free path:
        each step's forward is queued, then the host reads the previous step's tokens, the matchers consume them and
        the masks are computed while the device runs that forward, then the masked draw is queued
        (``overlap.GuidedDraws``). The previous launch is read (its tokens accepted, stops checked) on this thread
        a step at a time, each beside one step's masks computed on a worker thread (``_read_steps``; the rest after the
        launch); sequences that stopped there keep their rows, whose draws are dropped when read, as in
        ``overlap.py``."""
        times = self.grammar_cache().times
        t0 = time.perf_counter()
        seqs = [it.seq for it in sched.items]
        rows = feed_rows(seqs)
        k = self._steps_per_launch(sched, guided_launch_steps(self.config.decode_steps))

        reader = self._read_steps(prev, touched) if prev is not None else None

        def read_prev() -> bool:  # one step of the previous launch; False once all are read
            t = time.perf_counter()
            more = next(reader, False) is None
            times.read += time.perf_counter() - t
            return more

        beside = read_prev if prev is not None else None
        draws = GuidedDraws(self.sampler, seqs, prev, self._suppress(seqs) if k == 1 else None, k, times, beside)
        tokens, logprobs = self.runner.execute_steps(sched, (rows, prev.tokens) if rows is not None else None, k, draws)
        draws.finish_beside()  # the previous launch's steps not read beside a mask
        finished = Status.FINISHED
        for it in sched.items:
            if it.seq.status is not finished:  # finished by the read beside the masks: its blocks are freed
                it.seq.num_computed = it.start + k
        launched = InflightStep(seqs, tokens, logprobs, draws.stacked_masses())
        times.launch += time.perf_counter() - t0
        launched.mark_pending()
        self._inflight = launched
        self.num_steps += k
        self.num_steps_ahead += k
        self.num_launches_ahead += 1
        times.launches += 1

    def _steps_per_launch(self, sched, steps: int | None = None) -> int:
        """Decode steps to queue in this launch: ``decode_steps`` (``steps`` if given: a guided launch's,
        ``overlap.guided_launch_steps``) when no row needs the host between steps (a ``min_tokens`` mask changes every
        step), no more than any row has draws left before the model length (its last draw makes ``max_model_len``
        tokens), and no more than the longest-remaining row can use."""
        k = self.config.decode_steps if steps is None else steps
        if k == 1:
            return 1
        useful = 1
        for it in sched.items:
            s = it.seq
            p = s.params
            generated = it.start + 1 - s.num_prompt  # drawn before this launch, placeholders included
            if generated < p.min_tokens:
                return 1
            k = min(k, self.max_model_len - 1 - it.start)  # the last draw makes max_model_len tokens
            useful = max(useful, (p.max_tokens - generated) if p.max_tokens is not None else k)
        k = max(1, min(k, useful))
        if k > 1:
            allocate = self.block_manager.allocate
            for it in sched.items:  # blocks for every position the launch computes
                if not allocate(it.seq, it.start + k):
                    return 1
        return k

    def _read(self, step: InflightStep, touched: dict[str, _Request]) -> None:
        """Read a launch's tokens and do their host work, step by step; rows of sequences that stopped meanwhile
        are dropped, and so are the tokens a sequence drew after it stopped."""
        for _ in self._read_steps(step, touched):
            pass

    def _read_steps(self, step: InflightStep, touched: dict[str, _Request]):
        """``_read`` as a generator: each ``next`` accepts one more step of the launch (a guided launch reads the
        previous one a step at a time, each beside one step's masks: ``_launch_guided``)."""
        for scores in step.prompt_scores:  # before the tokens: a request finished by them is complete
            scores.store()
        tokens, logprobs = step.read()  # [K][B]
        finished = Status.FINISHED
        live = []
        for row, s in enumerate(step.seqs):
            if s.status is finished:
                continue
            del s.tokens[-s.pending :]  # the placeholders; _accept appends the real tokens
            s.pending = 0
            live.append((row, s))
        masses = step.masses or [None] * len(tokens)
        for toks, lps, ms in zip(tokens, logprobs, masses):
            if not live:
                break
            seqs, got, lp = [s for _, s in live], [toks[r] for r, _ in live], [lps[r] for r, _ in live]
            self._accept(seqs, got, lp, None, touched, [ms[r] for r, _ in live] if ms is not None else None)
            live = [(r, s) for r, s in live if s.status is not finished]
            yield

    def _flush(self) -> list[RequestOutput]:
        """Read the step in flight, if any (before anything that needs every token on the host)."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return []
        touched: dict[str, _Request] = {}
        self._read(prev, touched)
        return self._report(touched)

    def _suppress(self, seqs: list[Sequence]) -> list[list[int] | None] | None:
        """Per row, the token ids ``min_tokens`` still forbids (EOS and stop ids), or None when no row has any."""
        if not any(s.params.min_tokens for s in seqs):
            return None
        suppress: list[list[int] | None] = []
        for s in seqs:
            p = s.params
            if s.num_generated < p.min_tokens:
                eos = () if p.ignore_eos else self.eos_token_ids
                suppress.append(list(eos) + list(p.stop_token_ids))
            else:
                suppress.append(None)
        return suppress

    def _accept(self, seqs: list[Sequence], tokens, logprobs, tops, touched: dict[str, _Request], masses=None) -> None:
        """Append each sequence's new token, check its stops, finish the stopped ones (``tops``: per-row top-k
        alternatives, or None when no row asked for them; ``masses``: per-row log(mass the grammar allowed) when
        a row has a grammar, whose matcher consumes the token here)."""
        # Per sequence per step: keep this loop lean (it is host time at large batches).
        eos_ids, max_len, detoks, finish = self.eos_token_ids, self.max_model_len, self.detokenizers, None
        requests, version = self._requests, self.policy_version
        for i, (s, tok, lp, top) in enumerate(zip(seqs, tokens, logprobs, tops or [None] * len(seqs))):
            if s.guide is not None:
                s.guide.advance(tok, masses[i] if masses is not None else 0.0)
            s.tokens.append(tok)
            s.logprobs.append(lp)
            if version is not None:  # computed by the weights of this version (swap_weights reads ahead steps first)
                s.versions.append(version)
            s.cumulative_logprob += lp
            if s.top_logprobs is not None:
                s.top_logprobs.append(top or {})
            stop = check_stop(s, tok, eos_ids, max_len, detoks)
            if stop is not None:
                finish = finish or []
                finish.append((s, stop))
            touched[s.request_id] = requests[s.request_id]
        self.num_generated_tokens += len(seqs)
        for s, stop in finish or ():
            if self.kv.routing is not None:  # before its blocks are freed (a later step may reuse them)
                s.routed_experts = self._read_routing(s)
            self.scheduler.finish(s, *stop)
        if finish and self._finished is not None:  # generate(on_finish=...) reports them after this step
            self._finished.extend(s for s, _ in finish)

    def _read_routing(self, s: Sequence) -> torch.Tensor:
        """``s``'s recorded experts ``[tokens, L, k]`` on the device, gathered by slot (queued, no sync); the last
        token's row -1 (never fed to the model)."""
        n, bs = len(s.tokens) - 1, self.config.block_size
        pos = np.arange(n, dtype=np.int64)
        slots = np.asarray(s.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs
        dev = self.runner.device
        idx = torch.from_numpy(slots)
        idx = idx if dev.type == "cpu" else idx.pin_memory().to(dev, non_blocking=True)
        rows = self.kv.read_routing(idx)
        return torch.cat([rows, rows.new_full((1, *rows.shape[1:]), -1)])

    def _output(self, req: _Request) -> RequestOutput:
        outs = [self._completion(s) for s in req.seqs]
        finished = all(s.is_finished for s in req.seqs)
        out = RequestOutput(req.request_id, req.prompt_token_ids, outs, finished, req.prompt)
        pl = req.seqs[0].prompt_lps
        if pl is not None and len(pl.logprobs) >= len(req.prompt_token_ids):  # complete (prompt_logprobs.py)
            out.prompt_logprobs = PromptLogprobs(list(pl.logprobs), list(pl.top_logprobs), list(pl.ranks))
        return out

    def _completion(self, s: Sequence) -> CompletionOutput:
        ids = s.output_token_ids
        text = ""
        if s.detok is not None:
            text = s.detok.text
        elif s.is_finished and self.tokenizer is not None:
            ends_with_stop_token = s.finish_reason == "stop" and not isinstance(s.stop_reason, str) and ids
            text = self.tokenizer.decode(
                ids[:-1] if ends_with_stop_token else ids, skip_special_tokens=s.params.skip_special_tokens
            )
        new_ids = ids[s.emitted_tokens :]
        s.emitted_tokens = len(ids)
        new_text = ""
        if s.stream and s.detok is not None:
            upto = len(text) if s.is_finished else max(s.emitted_text, len(text) - max(0, s.params.max_stop_len - 1))
            new_text = text[s.emitted_text : upto]
            s.emitted_text = upto
        return CompletionOutput(
            index=s.index,
            token_ids=list(ids),
            text=text,
            logprobs=list(s.logprobs),
            cumulative_logprob=s.cumulative_logprob,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            top_logprobs=list(s.top_logprobs) if s.top_logprobs is not None else None,
            new_token_ids=new_ids,
            new_text=new_text,
            masked_logmass=s.guide.masked_logmass if s.guide is not None else None,
            routed_experts=s.routed_experts,
            token_versions=list(s.versions) if self.policy_version is not None else None,
        )

    # ---- batch API ----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        on_finish: Callable[[int, int, CompletionOutput], None] | None = None,
        between_steps: Callable[[LLM, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) until all finish; outputs in prompt order.

        ``on_finish(request_index, sample_index, output)`` is called once per sequence, right after the engine step
        in which it finished (before the other sequences of the batch are done), from the thread driving this call:
        ``request_index`` is the prompt's position, ``sample_index`` the sequence's index among its prompt's ``n``,
        ``output`` its finished ``CompletionOutput`` (text decoded; ``routed_experts`` may still be on the device).
        It runs between decode steps, so it must be cheap (hand the output to another thread or process); an
        exception it raises ends this call.

        ``between_steps(llm, steps)`` is called after each engine step but the last (``steps``: the steps of this
        call so far), from the same thread: it may ``swap_weights`` (partial rollouts), and must otherwise be cheap."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise UserError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        index = {rid: k for k, rid in enumerate(ids)} if on_finish is not None else None
        self._finished = [] if on_finish is not None else None
        try:
            with gc_paused(self.config.pause_gc):  # its full passes would stall the launches (platform/host.py)
                steps = 0
                while len(done) < len(ids):
                    outs = self.step(ahead=True)
                    steps += 1
                    for out in outs:
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
                    if between_steps is not None and len(done) < len(ids):  # not after the last step
                        between_steps(self, steps)
                        held, self._held = self._held, []  # what a swap_weights read from the step in flight
                        for out in held:
                            if out.finished and out.request_id in wanted:
                                done[out.request_id] = out
                    if self._finished:
                        self._report_finished(on_finish, index, done)
        finally:
            self._finished = None
        self._flush()  # rows of finished sequences only, unless another thread's requests share the engine
        outs = [done[i] for i in ids]
        if self.kv.routing is not None:  # the recorded experts to the host, in one transfer
            recs = [c for o in outs for c in o.outputs if c.routed_experts is not None]
            if recs:
                host = torch.cat([c.routed_experts for c in recs]).cpu().split([len(c.routed_experts) for c in recs])
                for c, h in zip(recs, host):
                    c.routed_experts = h
        return outs

    def _report_finished(
        self,
        on_finish: Callable[[int, int, CompletionOutput], None],
        index: dict[str, int],
        done: dict[str, RequestOutput],
    ) -> None:
        """Hand the sequences finished since the last call to ``on_finish`` (``generate``); another thread's
        requests sharing the engine are skipped. A sequence whose request is done already has its output (decoded
        once); the others' are built here, leaving a non-streaming request's emitted counters untouched."""
        seqs, self._finished = self._finished, []
        for s in seqs:
            k = index.get(s.request_id)
            if k is None:
                continue
            req = done.get(s.request_id)
            if req is not None:
                out = req.outputs[s.index]
            else:
                emitted = s.emitted_tokens, s.emitted_text
                out = self._completion(s)
                s.emitted_tokens, s.emitted_text = emitted
            on_finish(k, s.index, out)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise UserError("this tokenizer has no chat template; use generate() with plain prompts")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(
        self,
        messages_list: list[list[dict]] | list[dict],
        params: SamplingParams | list[SamplingParams] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (lists of {"role", "content"}) through the chat template."""
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]  # type: ignore[list-item]
        prompts = [self.apply_chat_template(m, **template_kwargs) for m in messages_list]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    # ---- colocated training -------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes: call after the model's weights changed (their KV is stale; FP8 rollout weights are
        requantised and fused projection copies rewritten before the next forward, ``ModelRunner.weights_changed``).
        Sequences still holding blocks (a swap mid-generation) register none of them from now on: their KV, and that
        of every later position attending to it, is the old weights'."""
        sched = self.scheduler  # sequences holding KV of the old weights: their blocks are never registered
        self.block_manager.reset_prefix_cache([*sched.running, *sched.waiting])
        self.runner.weights_changed()

    def release(self) -> None:
        """Free the KV cache memory for training. No request may be in flight."""
        if self.has_unfinished_requests():
            raise UserError("cannot release the KV cache while requests are running; finish or abort them first")
        self._flush()
        self.runner.invalidate_graphs()
        self.runner.release_weights()  # FP8 / fused rollout copies, made again at the next forward
        self.kv.release()
        self.block_manager.reset()

    def reallocate(self) -> None:
        """Take the KV cache memory back after ``release()`` (same number of blocks)."""
        self.kv.allocate()
        self.block_manager.reset_prefix_cache()  # the new tensors hold none of the cached KV

    def capture_graphs(self, max_batch: int | None = None) -> float:
        """Capture the CUDA graphs of every decode batch size up to ``max_batch`` (default ``max_num_seqs``) now,
        instead of on first use; returns the seconds spent. A no-op where decode runs eagerly."""
        before = self.runner.graph_capture_s
        self.runner.capture_graphs(max_batch or self.config.max_num_seqs)
        return self.runner.graph_capture_s - before

    # ---- introspection --------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": bm.usage(),
            "kv_num_blocks": bm.num_blocks,
            "prefix_cache_hit_rate": bm.hit_tokens / bm.query_tokens if bm.query_tokens else 0.0,
            "num_preemptions": self.scheduler.total_preemptions,
            "num_steps": self.num_steps,
            "num_steps_ahead": self.num_steps_ahead,
            "num_launches_ahead": self.num_launches_ahead,
            "num_mixed_ahead": self.num_mixed_ahead,
            "num_generated_tokens": self.num_generated_tokens,
            "graph_capture_s": self.runner.graph_capture_s,
        }
