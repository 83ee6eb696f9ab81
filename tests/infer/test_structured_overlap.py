"""Guided decode launches of several steps (``overlap.GuidedDraws``): the matchers consume each token as soon as the
host reads it, each step's mask is computed while that step's forward is queued, and the engine accepts the tokens
a launch later. These tests pin that the overlapped engine draws exactly the synchronous engine's tokens for a
fixed seed (greedy and sampled rows, guided and free rows in one batch, stops inside a launch, preemptions while
tokens are in flight, prefix-cache hits), that its outputs are valid against the schema, and that a matcher is
never fed a token out of order."""

from __future__ import annotations

import json

import jsonschema
import pytest

from polyrl.infer import LLM, RolloutConfig, SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _engine(model_dir, overlap: bool, **over) -> LLM:
    kw = dict(block_size=16, num_blocks=256, max_num_seqs=64, max_model_len=256, overlap_decode=overlap)
    kw.update(over)
    return LLM.from_pretrained(str(model_dir), RolloutConfig(**kw), dtype="float32", device="cpu")


def _run(llm: LLM, temperature: float, prompts: list | None = None) -> list:
    so = StructuredOutputs.json_schema(SCHEMA)
    guided = SamplingParams(n=4, temperature=temperature, max_tokens=70, structured=so)
    free = SamplingParams(n=2, temperature=1.0, max_tokens=23)
    short = SamplingParams(n=2, temperature=temperature, max_tokens=9, structured=so)  # cut inside a launch
    params = [guided.clone(seed=1), free.clone(seed=2), short.clone(seed=3), guided.clone(seed=4)]
    res = llm.generate(prompts or ["a", "b c", "d", "e f g"], params)
    return [c for o in res for c in o.outputs]


def _same(sync: list, ahead: list) -> None:
    assert len(sync) == len(ahead)
    for s, a in zip(sync, ahead):
        assert a.token_ids == s.token_ids and a.text == s.text
        assert a.finish_reason == s.finish_reason
        assert a.logprobs == pytest.approx(s.logprobs, abs=1e-6)
        assert (a.masked_logmass is None) == (s.masked_logmass is None)
        if s.masked_logmass is not None:
            assert a.masked_logmass == pytest.approx(s.masked_logmass, abs=1e-4)
            if s.finish_reason == "stop":
                jsonschema.validate(json.loads(a.text), SCHEMA)


@pytest.mark.parametrize(("temperature", "steps", "pipeline"), [(0.0, 4, 4), (1.0, 4, 4), (1.0, 4, 32), (1.0, 1, 4)])
def test_multi_step_guided_launches_draw_the_synchronous_tokens(
    tiny_model_dir, monkeypatch, temperature, steps, pipeline
):
    """``pipeline``: the guided rows from which steps >= 1 pipeline feeding and masks (overlap.PIPELINE_ROWS; the
    batch has 10 over 2 grammar lanes, so 4 pipelines every step of a launch after the first and 32 none)."""
    from polyrl.infer import overlap

    monkeypatch.setattr(overlap, "PIPELINE", True)  # opt-in
    monkeypatch.setattr(overlap, "PIPELINE_ROWS", pipeline)
    sync = _run(_engine(tiny_model_dir, overlap=False), temperature)
    llm = _engine(tiny_model_dir, overlap=True, decode_steps=steps, grammar_lanes=2)
    ahead = _run(llm, temperature)
    _same(sync, ahead)
    pipelined = llm.sampler.mask_buffers.starts
    assert pipelined > 10 if pipeline == 4 and steps > 1 else pipelined == 0
    times = llm.grammar_cache().times
    per_launch = 3 if steps == 4 else 1  # mostly 4 guided steps per launch (the tail launches fewer)
    assert times.launches > 0 and times.steps >= per_launch * times.launches
    assert llm.num_steps_ahead >= per_launch * llm.num_launches_ahead
    assert any(c.finish_reason == "stop" for c in ahead if c.masked_logmass is not None)  # closed the object
    assert [len(c.token_ids) for c in ahead if c.masked_logmass is not None and len(c.token_ids) == 9]  # the cut


def test_preemption_and_prefix_cache_hits_keep_the_tokens(tiny_model_dir, monkeypatch):
    """A cache too small for the batch preempts sequences with tokens in flight (their matchers then consume those
    tokens when the launch is read); a second run over the same prompts starts from cached prefixes. Both give the
    synchronous engine's tokens (with feeding and masks pipelined: overlap.PIPELINE_ROWS below the batch's rows)."""
    from polyrl.infer import overlap

    monkeypatch.setattr(overlap, "PIPELINE", True)  # opt-in
    monkeypatch.setattr(overlap, "PIPELINE_ROWS", 3)
    prompts = [[5 + (i * 7 + j) % 80 for j in range(21)] for i in range(4)]  # 5 full blocks of 4 each
    sync = _run(_engine(tiny_model_dir, overlap=False, block_size=4, num_blocks=40), 1.0, prompts)
    llm = _engine(tiny_model_dir, overlap=True, block_size=4, num_blocks=40, decode_steps=3, grammar_lanes=3)
    first = _run(llm, 1.0, prompts)
    assert llm.scheduler.total_preemptions > 0
    _same(sync, first)
    hits_before = llm.block_manager.hit_tokens
    _same(sync, _run(llm, 1.0, prompts))
    assert llm.block_manager.hit_tokens > hits_before
    assert llm.sampler.mask_buffers.starts > 0


def test_pipeline_splits_where_the_lane_changes(monkeypatch):
    """``overlap.pipeline_split``: the lane change nearest the middle of a step's (lane-grouped) rows; none below
    ``PIPELINE_ROWS`` rows or with a single lane (each consume would wait for the other half's masks)."""
    from polyrl.infer import overlap
    from polyrl.infer.overlap import PIPELINE_ROWS, pipeline_split

    assert PIPELINE_ROWS == 32 and overlap.PIPELINE is False  # opt-in: slower on the H200 (overlap.PIPELINE)
    assert pipeline_split([0] * 16 + [1] * 16) == 0
    monkeypatch.setattr(overlap, "PIPELINE", True)
    assert pipeline_split([0] * 16 + [1] * 16) == 16
    assert pipeline_split(sorted(i // 16 for i in range(256))) == 128  # auto lanes, B256 on 16 threads
    assert pipeline_split([0] * 20 + [1] * 5 + [2] * 7) == 20 and pipeline_split([0] * 3 + [1] * 29) == 3
    assert pipeline_split([0] * 64) == 0 and pipeline_split([0] * 16 + [1] * 15) == 0


def test_matchers_consume_in_order_exactly_once(tiny_model_dir):
    """``Guide.consume_at`` feeds a token once (a repeat is a no-op, so ``advance`` after it only adds the mass) and
    refuses a gap (the next mask would be computed on a stale state)."""
    llm = _engine(tiny_model_dir, overlap=True)
    guide = llm.grammar_cache().guide(StructuredOutputs.json_schema(SCHEMA))
    brace = llm.tokenizer.encode("{", add_special_tokens=False)
    assert len(brace) == 1
    guide.consume_at(0, brace[0])
    guide.consume_at(0, brace[0])  # already consumed: nothing happens (a second "{" would be an error state)
    assert guide.consumed == 1 and not guide.matcher.is_error()
    guide.advance(brace[0], -0.5)
    assert (guide.consumed, guide.num_tokens, guide.masked_logmass) == (1, 1, -0.5)
    with pytest.raises(RuntimeError, match="before token 1"):
        guide.consume_at(2, brace[0])


@pytest.mark.gpu
def test_multi_step_guided_launches_on_cuda_with_graphs(tiny_model_dir, monkeypatch):
    """On CUDA (graph replays, masks computed while the forward runs, tokens copied to pinned memory per step, the
    feed/mask pipeline over 4 grammar lanes) every guided output is valid and the launches ran several steps each."""
    import torch

    from polyrl.infer import overlap

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(overlap, "PIPELINE", True)  # opt-in; exercised here on CUDA
    cfg = RolloutConfig(
        block_size=16, num_blocks=512, max_num_seqs=128, max_model_len=256, decode_steps=4, grammar_lanes=4
    )
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="bfloat16", device="cuda")
    so = StructuredOutputs.json_schema(SCHEMA)
    params = SamplingParams(n=16, temperature=1.0, max_tokens=120, structured=so, seed=1)
    out = llm.generate(["a", "b", "c", "d"], [params, params.clone(temperature=0.0), params, params])
    for o in out:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    times = llm.grammar_cache().times
    assert times.steps >= 3 * times.launches > 0 and llm.runner.last_step_used_graph
    assert llm.sampler.mask_buffers.starts > 0  # 64 rows over 4 lanes: steps >= 1 pipelined feeding and masks
    assert llm.sampler.mask_buffers.side_copies > 0  # uploads on the side stream


@pytest.mark.gpu
def test_side_stream_upload_never_overwrites_masks_a_queued_apply_reads(tiny_model_dir):
    """On CUDA ``MaskBuffers.fill`` copies on a side stream: the current stream's reader of one fill's masks (queued
    behind a long kernel, then marked with ``applied()``) sees those masks although the next fill's copy was queued
    before it ran; without the mark the next copy waits for everything queued. Each fill equals the CPU's."""
    import torch

    from polyrl.infer.structured import MaskBuffers

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = _engine(tiny_model_dir, overlap=True)
    cache = llm.grammar_cache()
    so = StructuredOutputs.json_schema(SCHEMA)
    brace = llm.tokenizer.encode("{", add_special_tokens=False)[0]
    a = cache.mask_pairs([cache.guide(so) for _ in range(4)])
    b = cache.mask_pairs([cache.guide(so) for _ in range(4)])
    for m, _ in b:
        m.consume_token(brace)  # other masks than a's
    cpu = torch.device("cpu")
    want_a, want_b = MaskBuffers().fill(cache, a, cpu).clone(), MaskBuffers().fill(cache, b, cpu).clone()
    assert not torch.equal(want_a, want_b)
    dev = torch.device("cuda")
    for marked in (True, False):
        buffers = MaskBuffers()
        got = buffers.fill(cache, a, dev)
        torch.cuda._sleep(50_000_000)  # the current stream busy (~tens of ms) before the reader runs
        seen = got.clone()  # the reader (an apply) of a's masks
        if marked:
            buffers.applied()
        got_b = buffers.fill(cache, b, dev).clone()
        torch.cuda.synchronize()
        assert torch.equal(seen.cpu(), want_a) and torch.equal(got_b.cpu(), want_b)
        assert buffers.side_copies == 2


def test_mask_fill_beside_runs_on_a_worker_and_joins(tiny_model_dir):
    """``MaskBuffers.fill(beside=f)``: the masks are computed on a worker thread while ``f`` runs on the caller's, the
    result equals a plain fill's, and an error in ``f`` is raised after the worker finished (its mask complete)."""
    import threading

    import torch

    from polyrl.infer.structured import MaskBuffers

    llm = _engine(tiny_model_dir, overlap=True)
    cache = llm.grammar_cache()
    guides = cache.mask_pairs([cache.guide(StructuredOutputs.json_schema(SCHEMA)) for _ in range(5)])
    plain = MaskBuffers().fill(cache, guides, torch.device("cpu")).clone()
    threads = []
    real = cache.fill_pairs
    cache.fill_pairs = lambda g, b, account=True: threads.append(threading.get_ident()) or real(g, b, account)
    buffers = MaskBuffers()
    ran = []
    got = buffers.fill(cache, guides, torch.device("cpu"), lambda: ran.append(threading.get_ident()))
    assert torch.equal(got, plain) and ran == [threading.get_ident()] and threads[-1] != ran[0]

    def fail() -> None:
        raise ValueError("beside failed")

    with pytest.raises(ValueError, match="beside failed"):
        buffers.fill(cache, guides, torch.device("cpu"), fail)
    assert torch.equal(buffers._host[:5], plain) and len(threads) == 2  # the worker's mask was complete

    # start: the first rows' masks on the worker, the rest in the next fill, which joins it (one step counted)
    buffers._host.fill_(-1)
    calls, spent = cache.mask_calls, cache.mask_s
    buffers.start(cache, guides[:2], 5, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not joined"):
        buffers.start(cache, guides[:2], 5, torch.device("cpu"))
    got = buffers.fill(cache, guides, torch.device("cpu"))
    assert torch.equal(got, plain) and threads[-2] != threads[-1] == ran[0]  # worker first, then this thread
    assert cache.mask_calls == calls + 1 and cache.mask_s > spent and buffers.last_s > 0 and buffers.starts == 1
    buffers.start(cache, guides[:2], 5, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="beside work after start"):
        buffers.fill(cache, guides, torch.device("cpu"), fail)
    assert buffers._ahead is None  # joined all the same


class _CountingExecutor:
    """An ``LLExecutor`` stand-in that counts the calls it forwards."""

    def __init__(self, real) -> None:
        self.real, self.consume_calls, self.consumed_rows = real, 0, 0

    def consume_token_par(self, pairs):
        self.consume_calls += 1
        self.consumed_rows += len(pairs)
        return self.real.consume_token_par(pairs)

    def unsafe_compute_mask_ptr(self, *args):
        return self.real.unsafe_compute_mask_ptr(*args)


def _par_engine(model_dir, **over) -> tuple[LLM, _CountingExecutor]:
    llm = _engine(model_dir, overlap=True, **over)
    cache = llm.grammar_cache()
    cache.par_consume = True  # also on a 1-CPU host (the executor then has one thread: same calls, same states)
    spy = cache._executor = _CountingExecutor(cache._executor)
    return llm, spy


@pytest.mark.parametrize(("temperature", "split"), [(0.0, True), (1.0, True), (1.0, False)])
def test_parallel_consumes_draw_the_synchronous_tokens(tiny_model_dir, monkeypatch, temperature, split):
    """With several grammar lanes a guided launch feeds each step's tokens in one executor call
    (``GrammarCache.consume``; step 0's on the mask worker beside the previous launch's read), with a cache small
    enough to preempt sequences with tokens in flight and a second run over cached prefixes: the tokens, log-probs
    and mask mismatch are the synchronous engine's, with the previous launch read a step at a time beside each
    step's masks (``overlap.SPLIT_READ``) or all of it beside step 0's."""
    from polyrl.infer import overlap

    assert overlap.PIPELINE is False and overlap.SPLIT_READ is True
    monkeypatch.setattr(overlap, "SPLIT_READ", split)
    prompts = [[5 + (i * 7 + j) % 80 for j in range(21)] for i in range(4)]
    sync = _run(_engine(tiny_model_dir, overlap=False, block_size=4, num_blocks=60), temperature, prompts)
    llm, spy = _par_engine(tiny_model_dir, block_size=4, num_blocks=60, decode_steps=4, grammar_lanes=3)
    _same(sync, _run(llm, temperature, prompts))
    assert llm.scheduler.total_preemptions > 0
    assert spy.consume_calls > 0 and spy.consumed_rows >= 10 * spy.consume_calls // 2
    hits = llm.block_manager.hit_tokens
    _same(sync, _run(llm, temperature, prompts))
    assert llm.block_manager.hit_tokens > hits


def test_guided_launch_steps(tiny_model_dir, monkeypatch):
    """A guided launch takes ``GUIDED_LAUNCH_STEPS`` steps (or ``decode_steps`` if more), one when multi-step
    launches are off; a free launch keeps ``decode_steps``. The previous launch is read beside several steps' masks.
    With several lanes the guides' consumed counts, moved
    once per launch, end at the tokens the engine accepted (plus those drawn after the stop inside the launch)."""
    from polyrl.infer import overlap
    from polyrl.infer.overlap import guided_launch_steps

    assert overlap.GUIDED_LAUNCH_STEPS == 8
    assert [guided_launch_steps(k) for k in (1, 2, 4, 8, 12)] == [1, 8, 8, 8, 12]
    llm, spy = _par_engine(tiny_model_dir, decode_steps=4, grammar_lanes=2)
    besides = []
    buffers = llm.sampler.mask_buffers
    real_beside = buffers._fill_beside
    buffers._fill_beside = lambda *a: besides.append(1) or real_beside(*a)
    launched = []
    real = llm.runner.execute_steps
    llm.runner.execute_steps = lambda sched, feed, steps, draw, rows=None: (
        launched.append((steps, any(it.seq.guide is not None for it in sched.items)))
        or real(sched, feed, steps, draw, rows)
    )
    so = StructuredOutputs.json_schema(SCHEMA)
    guided = llm.add_request("a", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, structured=so))
    llm.step(ahead=True)  # takes the request in (its prefill)
    seqs = llm._requests[guided].seqs
    while llm.has_unfinished_requests():
        llm.step(ahead=True)
    llm._flush()
    llm.generate(["b"], SamplingParams(temperature=1.0, seed=6, max_tokens=20))
    assert max(k for k, g in launched if g) == 8 and max(k for k, g in launched if not g) == 4
    # the previous launch is read a step at a time, each beside one step's masks (not all beside step 0's)
    guided_launches = sum(g for _, g in launched)
    assert len(besides) > 2 * guided_launches
    assert spy.consume_calls > 0
    for s in seqs:  # rows consume the tokens drawn after their stop too (dropped): the rest of the launch where it
        # stopped and the next one, scheduled before the stop was read
        assert s.guide.num_tokens == len(s.output_token_ids) <= s.guide.consumed < s.guide.num_tokens + 16
    monkeypatch.setattr(overlap, "GUIDED_LAUNCH_STEPS", 4)
    assert [guided_launch_steps(k) for k in (1, 2, 4, 8)] == [1, 4, 4, 8]


def test_grammar_cache_consume_matches_per_row_consumes(tiny_model_dir):
    """``GrammarCache.consume``: one executor call over several lanes leaves every matcher where a ``consume_token``
    per row does (same masks after each step), a refused token included (error state: the next mask is EOS only);
    with one lane it is the per-row calls."""
    import torch

    from polyrl.infer.structured import GrammarCache, MaskBuffers

    llm = _engine(tiny_model_dir, overlap=True)
    so = StructuredOutputs.json_schema(SCHEMA)
    cache = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, num_threads=4, lanes=3)
    assert cache.par_consume and not GrammarCache(llm.tokenizer, llm.vocab_size, [0], lanes=1).par_consume
    assert not GrammarCache(llm.tokenizer, llm.vocab_size, [0], num_threads=3, lanes=3).par_consume
    par, one = [cache.guide(so) for _ in range(7)], [cache.guide(so) for _ in range(7)]
    pairs = cache.mask_pairs(par)
    assert [par[i].lane for _, i in pairs] == sorted(g.lane for g in par)  # lane order
    text = llm.tokenizer.encode('{"name": "ab", "age": 7', add_special_tokens=False)
    bad = llm.tokenizer.encode("}", add_special_tokens=False)[0]
    cpu = torch.device("cpu")
    a, b = MaskBuffers(), MaskBuffers()
    for step, tok in enumerate(text):
        toks = [tok] * 7
        if step == len(text) - 1:
            toks[2] = bad  # refused: row 2 ends in its error state in both
        cache.consume(pairs, toks)
        for i, g in enumerate(one):
            g.matcher.consume_token(toks[i])
        got, want = a.fill(cache, pairs, cpu), b.fill(cache, cache.mask_pairs(one), cpu)
        assert torch.equal(got, want)
    assert par[2].matcher.is_error() and one[2].matcher.is_error() and not par[1].matcher.is_error()
