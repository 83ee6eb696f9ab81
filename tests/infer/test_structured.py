"""Structured outputs in the engine: the llguidance bitmask in the sampler (greedy = argmax over allowed tokens,
log-probs of the unmasked distribution, the mask's mismatch measured), grammars compiled once per schema, every
output of the random tiny model valid against its schema, max_tokens cuts reported as "length", unguided rows of
the same batch unchanged; and the same on CUDA (graph replay of the forward, mask after it)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from polyrl.errors import ConfigError, UserError
from polyrl.infer import LLM, RolloutConfig, SamplingParams, StructuredOutputs
from polyrl.infer.sampling_params import sample_seed
from polyrl.infer.structured import allowed_mask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    cfg = RolloutConfig(block_size=16, num_blocks=256, max_num_seqs=64, max_model_len=256)
    return LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="float32", device="cpu")


def test_every_output_matches_the_schema_and_compiles_once(llm):
    so = StructuredOutputs.json_schema(SCHEMA)
    cache = llm.grammar_cache()
    before = cache.compiles
    out = llm.generate(["a", "b"], SamplingParams(n=12, temperature=1.0, max_tokens=120, structured=so, seed=5))
    texts = [c.text for o in out for c in o.outputs]
    assert len(texts) == 24
    for o in out:
        for c in o.outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] in llm.eos_token_ids
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert list(json.loads(c.text)) == ["name", "age", "ok", "tag"]  # the schema's property order
    assert cache.compiles == before + 1  # 24 sequences, one compilation
    hits = cache.hits
    llm.generate(["c"], SamplingParams(max_tokens=120, structured=StructuredOutputs.json_schema(SCHEMA)))
    assert cache.compiles == before + 1 and cache.hits == hits + 1


def test_concurrent_requests_with_one_schema_compile_it_once(llm):
    """The server adds requests from many threads: a schema first seen by several at once compiles once."""
    from concurrent.futures import ThreadPoolExecutor

    cache = llm.grammar_cache()
    so = StructuredOutputs.json_schema({**SCHEMA, "title": "concurrent"})  # a schema no other test compiled
    before, hits = cache.compiles, cache.hits
    with ThreadPoolExecutor(8) as pool:
        guides = list(pool.map(lambda _: cache.guide(so), range(16)))
    assert cache.compiles == before + 1 and cache.hits == hits + 15
    assert len({id(g.matcher) for g in guides}) == 16  # each sequence its own matcher state


def test_greedy_logprobs_and_mismatch(llm):
    so = StructuredOutputs.choice(["yes", "no"])
    ref = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, logprobs=0))[0].outputs[0]
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, structured=so, logprobs=0))[0]
    c = out.outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"
    # the first token: the argmax over the grammar's allowed tokens, its log-prob from the UNMASKED distribution
    logits = _first_logits(llm, out.prompt_token_ids)
    guide = llm.grammar_cache().guide(so)
    mask = torch.zeros((1, llm.grammar_cache().words), dtype=torch.int32)
    llm.grammar_cache().fill_bitmask([guide.matcher], mask)
    allowed = allowed_mask(mask, logits.shape[-1])[0]
    assert c.token_ids[0] == int(logits.masked_fill(~allowed, float("-inf")).argmax())
    assert c.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[c.token_ids[0]]), abs=1e-4)
    assert c.token_ids[0] != ref.token_ids[0] or allowed[ref.token_ids[0]]
    assert 1 < int(allowed.sum()) < 10  # "y"/"ye"/"yes"/"n"/"no" ...: a few of 2048


def _first_logits(llm, ids):
    probe = LLM(llm.model, llm.tokenizer, RolloutConfig(block_size=16, num_blocks=32, max_model_len=256))
    seen = {}
    real = probe.sampler.__call__

    def spy(logits, seqs, suppress=None):
        seen.setdefault("logits", logits[0].float().clone())
        return real(logits, seqs, suppress)

    probe.sampler = type("S", (), {"__call__": staticmethod(spy), "rows": probe.sampler.rows})()
    probe.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return seen["logits"]


def test_mismatch_is_measured_on_the_guide(llm):
    so = StructuredOutputs("regex", "[0-9]{4}")
    llm.generate(["x"], SamplingParams(temperature=1.0, max_tokens=10, structured=so, seed=1))
    guide = llm.grammar_cache().guide(so)
    assert guide.masked_logmass == 0.0  # a fresh guide
    # run one sequence by hand to read its guide after the draws
    rid = llm.add_request("x", SamplingParams(temperature=1.0, max_tokens=10, structured=so, seed=1))
    llm.step()  # admits it (and prefills)
    seqs = list(llm._requests[rid].seqs)
    while llm.has_unfinished_requests():
        llm.step()
    g = seqs[0].guide
    assert g.num_tokens == 5 and g.masked_logmass < 0  # 4 digits + EOS; the mask removed probability mass
    assert len(seqs[0].output_token_ids) == 5


def test_length_cut_and_unguided_rows_unchanged(llm):
    so = StructuredOutputs.json_schema(SCHEMA)
    cut = llm.generate(["x"], SamplingParams(temperature=1.0, max_tokens=6, structured=so, seed=3))[0].outputs[0]
    assert cut.finish_reason == "length" and cut.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    plain = SamplingParams(temperature=1.0, max_tokens=12, seed=9)
    alone = llm.generate(["hi there"], plain)[0].outputs[0].token_ids
    guided = SamplingParams(temperature=1.0, max_tokens=40, structured=StructuredOutputs.json_schema(SCHEMA), seed=2)
    mixed = llm.generate(["hi there", "q"], [plain, guided])
    assert mixed[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)


def test_bad_grammars_are_user_errors(llm):
    with pytest.raises(UserError, match="regex"):
        llm.add_request("x", SamplingParams(structured=StructuredOutputs("regex", "[a-")))
    with pytest.raises(UserError, match="json"):
        llm.add_request("x", SamplingParams(structured=StructuredOutputs.json_schema({"type": "objectx"})))
    with pytest.raises(UserError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutputs("json_object"))
    with pytest.raises(UserError, match="kind"):
        StructuredOutputs("xml", "<a/>")


@pytest.mark.gpu
def test_structured_on_cuda_with_graphs(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = RolloutConfig(block_size=16, num_blocks=512, max_num_seqs=128, max_model_len=256)
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="bfloat16", device="cuda")
    so = StructuredOutputs.json_schema(SCHEMA)
    out = llm.generate(["a"] * 8, SamplingParams(n=8, temperature=1.0, max_tokens=120, structured=so, seed=1))
    for o in out:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.runner.graphs is not None and llm.runner.last_step_used_graph  # decode replayed graphs, mask after


def test_overlapped_guided_steps_equal_synchronous_ones(tiny_model_dir):
    """Decoding one step ahead (the forward of step N+1 queued before step N's tokens are read, the masked draw
    after the matchers consumed them) gives the synchronous engine's tokens, log-probs and mask mismatch exactly."""
    outs = []
    for overlap in (False, True):
        cfg = RolloutConfig(block_size=16, num_blocks=256, max_num_seqs=64, max_model_len=256, overlap_decode=overlap)
        llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="float32", device="cpu")
        guided = SamplingParams(n=6, temperature=1.0, max_tokens=80, structured=StructuredOutputs.json_schema(SCHEMA))
        free = SamplingParams(n=2, temperature=1.0, max_tokens=20, min_tokens=5)
        launched, real = [], llm._launch_guided
        llm._launch_guided = lambda *a, n=launched, f=real: n.append(1) or f(*a)
        res = llm.generate(["a", "b", "c"], [guided.clone(seed=1), free.clone(seed=2), guided.clone(seed=3)])
        outs.append([c for o in res for c in o.outputs])
        assert (len(launched) > 5) == overlap  # the guided rows' decode steps ran ahead (or never did)
        assert (llm.num_steps_ahead > 20) == overlap  # several steps per guided launch
    for sync, ahead in zip(*outs):
        assert ahead.token_ids == sync.token_ids and ahead.text == sync.text
        assert ahead.logprobs == pytest.approx(sync.logprobs, abs=1e-6)
        if sync.masked_logmass is not None:
            assert ahead.masked_logmass == pytest.approx(sync.masked_logmass, abs=1e-4)
            jsonschema.validate(json.loads(ahead.text), SCHEMA)


def test_mask_buffers_are_persistent_and_every_word_is_written(llm):
    """The host mask buffer is reused step after step (no allocation per step) and grows when a batch needs more
    rows; llguidance writes every word of a row, so a reused buffer needs no clearing."""
    from polyrl.infer.structured import MaskBuffers

    cache = llm.grammar_cache()
    so = StructuredOutputs.json_schema(SCHEMA)
    guides = [cache.guide(so) for _ in range(3)]
    for g, text in zip(guides[1:], ['{"name": "', '{"name": "ab", "age": 1']):
        assert g.matcher.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False))
    bufs = MaskBuffers()
    cpu = torch.device("cpu")
    calls, spent = cache.mask_calls, cache.mask_s
    first = bufs.fill(cache, cache.mask_pairs(guides), cpu)
    assert cache.mask_calls == calls + 1 and cache.mask_s > spent and cache.mask_max_s > 0  # the bench reads these
    assert first.shape == (3, cache.words)
    fresh = torch.zeros((3, cache.words), dtype=torch.int32)
    cache.fill_bitmask([g.matcher for g in guides], fresh)
    assert torch.equal(first, fresh)
    dirty = torch.full((3, cache.words), -1, dtype=torch.int32)  # every bit set before the fill
    cache.fill_bitmask([g.matcher for g in guides], dirty)
    assert torch.equal(dirty, fresh)
    n_allowed = allowed_mask(fresh, llm.vocab_size).sum(1).tolist()
    assert n_allowed[0] == 1 and n_allowed[1] > 100 and 1 < n_allowed[2] < 100  # '{', any string token, digits
    again = bufs.fill(cache, cache.mask_pairs(guides[::-1]), cpu)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, fresh.flip(0))
    more = [cache.guide(so) for _ in range(6)] + guides  # a matcher appears once per batch (llguidance borrows it)
    grown = bufs.fill(cache, cache.mask_pairs(more), cpu)
    assert grown.shape == (9, cache.words) and torch.equal(grown[6:], fresh)


def test_guided_draw_equals_the_plain_torch_computation(llm):
    """The sampler's guided draw (mask op, then sample_tokens, unmasked log-prob from the op's logsumexp) against
    the same draw written out in torch: tokens, log-probs and masked mass, with unguided rows in the batch."""
    from polyrl.infer.sampler import Sampler
    from polyrl.infer.sequence import Sequence
    from polyrl.kernels.sampling.reference import sample_tokens

    cache = llm.grammar_cache()
    so = StructuredOutputs.json_schema(SCHEMA)
    seqs = []
    for i, (t, guided) in enumerate([(1.0, True), (0.7, False), (0.0, True), (1.3, True)]):
        s = Sequence(i, f"r{i}", 0, [1, 2, 3], SamplingParams(temperature=t, seed=10 + i, max_tokens=5), 0.0, False)
        if guided:
            s.guide = cache.guide(so)
        seqs.append(s)
    seqs[3].guide.matcher.consume_tokens(llm.tokenizer.encode('{"name": "', add_special_tokens=False))
    logits = torch.randn(4, llm.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    out = Sampler()(logits, seqs)
    bm = torch.zeros((4, cache.words), dtype=torch.int32)
    cache.fill_bitmask([s.guide.matcher if s.guide else cache.guide(so).matcher for s in seqs], bm)
    allowed = allowed_mask(bm, llm.vocab_size)
    allowed[1] = True  # the unguided row
    masked = logits.masked_fill(~allowed, float("-inf"))
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3])
    seeds = torch.tensor([sample_seed(10 + i, 0) for i in range(4)])
    tokens, _ = sample_tokens(
        masked, temps, seeds, torch.zeros(4, dtype=torch.int64), torch.tensor([0, 0, 1, 0]).bool()
    )
    assert out.tokens == tokens.tolist()
    z = logits / temps[:, None]
    want_lp = torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0]
    assert out.logprobs == pytest.approx(want_lp.tolist(), abs=1e-5)
    mass = torch.logsumexp(masked / temps[:, None], -1) - torch.logsumexp(z, -1)
    assert out.masses == pytest.approx(mass.tolist(), abs=1e-5)
    assert out.masses[1] == 0.0 and out.masses[0] < 0 and out.masses[3] > -1.0  # the string state allows most
    assert bool(allowed[0, out.tokens[0]]) and bool(allowed[3, out.tokens[3]])


def test_executor_is_sized_to_the_host_and_lanes_round_robin(llm):
    """llguidance's executor gets a thread per CPU this process may run on (its affinity, at most 32) unless told;
    lanes are automatic by default (one per thread from 4 threads up, else 1); a given count N hands copies out
    round-robin, each spec compiled once per lane (separate lexers: copies of one template share its lexer) as the
    round-robin reaches the lanes."""
    import os

    from polyrl.infer.structured import GrammarCache, auto_lanes, host_threads

    assert host_threads() == min(len(os.sched_getaffinity(0)), 32)
    cache = llm.grammar_cache()
    assert cache.num_threads == host_threads() and cache.auto and cache.lanes == auto_lanes(host_threads())
    assert [auto_lanes(n) for n in (1, 2, 3, 4, 16, 32)] == [1, 1, 1, 4, 16, 32]
    cache = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, num_threads=3)
    assert (cache.num_threads, cache.lanes, cache.rows_per_lane) == (3, 1, 16)
    cache = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, num_threads=2, lanes=3)
    assert (cache.auto, cache.rows_per_lane) == (False, 1)
    so = StructuredOutputs.json_schema(SCHEMA)
    guides = [cache.guide(so)]
    assert len(cache._cache[so][0]) == 1  # a lone request compiles once; the other lanes as copies reach them
    guides += [cache.guide(so) for _ in range(6)]
    assert [g.lane for g in guides] == [0, 1, 2, 0, 1, 2, 0]  # round-robin over the lanes
    assert cache.compiles == 1 and cache.hits == 6
    templates = cache._cache[so][0]
    assert len(templates) == 3 and len({id(t) for t in templates}) == 3
    for bad in ({"lanes": 0}, {"rows_per_lane": 0}):
        with pytest.raises(UserError, match="must be >= 1"):
            GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, **bad)


def test_automatic_lanes_follow_threads_and_rows_per_schema(llm):
    """Automatic lanes on a 16-thread executor: a schema's copies fill a lane 16 rows at a time, so a lone request
    and the next 15 rows compile once (the issue's "second request: no compile"), and a B256 rollout spreads over 16
    lanes of 16 rows, each lane compiled once, the rows then handed to the executor grouped by lane."""
    from polyrl.infer.structured import ROWS_PER_LANE, GrammarCache

    cache = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, num_threads=16)
    assert (cache.auto, cache.lanes, cache.rows_per_lane) == (True, 16, ROWS_PER_LANE) and ROWS_PER_LANE == 16
    so = StructuredOutputs.json_schema(SCHEMA)
    first = [cache.guide(so) for _ in range(16)]
    assert {g.lane for g in first} == {0} and len(cache._cache[so][0]) == 1 and cache.compiles == 1
    rest = [cache.guide(so) for _ in range(256 + 8)]
    guides = first + rest
    assert [g.lane for g in guides] == [(i // 16) % 16 for i in range(len(guides))]  # wraps after 16 x 16 rows
    assert len(cache._cache[so][0]) == 16 and cache.compiles == 1 and cache.hits == len(guides) - 1
    batch = guides[8:264]  # a B256 batch starting mid-lane: rows grouped by lane for the executor, stable in lane
    order = [i for _, i in cache.mask_pairs(batch)]
    assert [batch[i].lane for i in order] == sorted(g.lane for g in batch)
    assert all(a < b for a, b in zip(order, order[1:]) if batch[a].lane == batch[b].lane)
    other = StructuredOutputs.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    assert cache.guide(other).lane == 0  # each spec counts its own rows
    # the engine's own cache takes RolloutConfig.grammar_lanes (None: automatic)
    fixed = LLM(llm.model, llm.tokenizer, RolloutConfig(num_blocks=16, grammar_lanes=3)).grammar_cache()
    assert (fixed.auto, fixed.lanes, fixed.rows_per_lane) == (False, 3, 1)
    with pytest.raises(ConfigError, match="grammar_lanes must be >= 1"):
        RolloutConfig(grammar_lanes=0)


def test_lane_masks_equal_the_one_lane_reference(llm):
    """``fill_guides`` over several lanes (rows grouped by lane, separate lexers) against one-lane guides and
    ``fill_bitmask``: the same masks at every step (tokens drawn under them); a token a matcher refuses leaves it
    allowing only EOS in both."""
    from polyrl.infer.structured import GrammarCache

    so = StructuredOutputs.json_schema(SCHEMA)
    one = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, num_threads=1, lanes=1)
    many = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, num_threads=2, lanes=3)
    n = 10
    ref, new = [one.guide(so) for _ in range(n)], [many.guide(so) for _ in range(n)]
    gen = torch.Generator().manual_seed(0)
    want = torch.empty((n, one.words), dtype=torch.int32)
    got = torch.full((n, many.words), -1, dtype=torch.int32)
    eos = sorted(llm.eos_token_ids)
    for step in range(40):
        one.fill_bitmask([g.matcher for g in ref], want)
        many.fill_guides(new, got)
        assert torch.equal(got, want), step
        allowed = allowed_mask(want, llm.vocab_size)
        if step > 5:
            assert set(allowed[3].nonzero()[:, 0].tolist()) <= set(eos) and allowed[3].any()
        toks = torch.multinomial(allowed.float(), 1, generator=gen)[:, 0].tolist()
        if step == 5:
            toks[3] = int(torch.nonzero(~allowed[3])[0])  # refused: the matcher errs, its mask is EOS only
        for g, h, t in zip(ref, new, toks):
            g.advance(t, -0.5)
            h.advance(t, -0.5)
    assert ref[3].matcher.is_error() and new[3].matcher.is_error()


def test_outputs_do_not_depend_on_lanes_or_threads(tiny_model_dir):
    """The engine's guided outputs (tokens, log-probs, mask mismatch) are the same with one lane on one thread (every
    row a copy of one template) as with several lanes and threads, overlapped or not."""
    from polyrl.infer.structured import GrammarCache

    outs = []
    for lanes, threads, overlap in ((1, 1, False), (3, 2, True)):
        cfg = RolloutConfig(block_size=16, num_blocks=256, max_num_seqs=64, max_model_len=256, overlap_decode=overlap)
        llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="float32", device="cpu")
        llm._grammars = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, num_threads=threads, lanes=lanes)
        guided = SamplingParams(n=5, temperature=1.0, max_tokens=60, structured=StructuredOutputs.json_schema(SCHEMA))
        res = llm.generate(["a", "b"], [guided.clone(seed=1), guided.clone(seed=2)])
        outs.append([c for o in res for c in o.outputs])
        assert llm.grammar_cache().mask_calls > 10
    for one, many in zip(*outs):
        assert many.token_ids == one.token_ids
        assert many.logprobs == pytest.approx(one.logprobs, abs=1e-6)
        assert many.masked_logmass == pytest.approx(one.masked_logmass, abs=1e-4)


def test_first_grammar_cache_requests_from_several_threads_build_one_cache(tiny_model_dir, monkeypatch):
    """The server's preparation threads may ask a fresh engine for its grammar cache at once: one cache is built (its
    tokenizer index takes a second or more) and every thread gets it."""
    import threading

    from polyrl.infer import structured

    built = []
    real = structured.GrammarCache

    class SlowCache(real):
        def __init__(self, *args, **kwargs):
            built.append(1)
            threading.Event().wait(0.2)  # the index build's time, during which other threads arrive
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(structured, "GrammarCache", SlowCache)
    cfg = RolloutConfig(block_size=16, num_blocks=32, max_num_seqs=4, max_model_len=64)
    fresh = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="float32", device="cpu")
    got = []
    threads = [threading.Thread(target=lambda: got.append(fresh.grammar_cache())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1
    assert len(got) == 4 and all(c is got[0] for c in got)
