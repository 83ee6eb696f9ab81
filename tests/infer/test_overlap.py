"""One-step-ahead decoding (``polyrl/infer/overlap.py``): ``generate()`` launches decode step N+1 before it reads
step N's tokens. It must give exactly what the synchronous engine gives - tokens, log-probs, finish reasons, stop
strings, min_tokens, n > 1, prefix sharing and preemption - and leave no placeholder anywhere."""

from __future__ import annotations

import copy

import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.infer.overlap import PENDING

from .conftest import EOS


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=7, max_tokens=20, n=3),  # n > 1 shares the prompt's blocks
        SamplingParams(temperature=0.8, seed=3, max_tokens=17, min_tokens=9, stop_token_ids=[5, 6]),
        SamplingParams(temperature=0.0, max_tokens=25),  # greedy, may stop at EOS
        SamplingParams(temperature=1.0, seed=11, top_k=7, top_p=0.9, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, stop_token_ids=[EOS, 9, 10, 11]),
    ]


def _run(model, overlap: bool, num_blocks: int, prompts, params, decode_steps: int = 4):
    cfg = RolloutConfig(
        num_blocks=num_blocks, block_size=4, max_num_seqs=8, overlap_decode=overlap, decode_steps=decode_steps
    )
    llm = LLM(model, None, cfg)
    outs = llm.generate(prompts, params)
    return llm, [
        (o.prompt_token_ids, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs
    ]


def test_overlapped_generate_equals_synchronous(tiny_model):
    prompts = _prompts(10)
    params = [_params()[i % 5] for i in range(10)]
    sync_llm, sync = _run(tiny_model, False, 256, prompts, params)
    one_llm, one_ahead = _run(tiny_model, True, 256, prompts, params, decode_steps=1)
    assert one_llm.stats()["num_steps_ahead"] == one_llm.stats()["num_launches_ahead"] > 0
    assert [r[1] for r in one_ahead] == [r[1] for r in sync]
    ahead_llm, ahead = _run(tiny_model, True, 256, prompts, params)
    stats = ahead_llm.stats()
    assert stats["num_steps_ahead"] > 0.5 * stats["num_steps"]
    assert stats["num_steps_ahead"] > 1.5 * stats["num_launches_ahead"]  # several decode steps per launch
    assert stats["num_mixed_ahead"] > 1  # prompt steps (new prompts beside decode rows) were queued ahead too
    assert sync_llm.stats()["num_steps_ahead"] == 0
    for (p, t1, l1, f1, s1), (q, t2, l2, f2, s2) in zip(sync, ahead):
        assert p == q and t1 == t2 and (f1, s1) == (f2, s2)
        assert PENDING not in t2
        assert torch.allclose(torch.tensor(l1), torch.tensor(l2), atol=1e-5)
    assert {r[3] for r in ahead} == {"stop", "length"}  # both kinds of ending happened
    assert ahead_llm.stats()["num_generated_tokens"] == sync_llm.stats()["num_generated_tokens"]
    assert not ahead_llm.has_unfinished_requests() and ahead_llm._inflight is None


def test_overlapped_generate_under_preemption_equals_synchronous(tiny_model):
    """A cache too small for the batch: sequences are preempted while their last token is still pending."""
    prompts = _prompts(8, seed=1)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=24, ignore_eos=True)
    sync_llm, sync = _run(tiny_model, False, 40, prompts, params)
    ahead_llm, ahead = _run(tiny_model, True, 40, prompts, params)
    assert ahead_llm.stats()["num_preemptions"] > 0
    assert ahead_llm.stats()["num_mixed_ahead"] > 0
    assert [r[1] for r in ahead] == [r[1] for r in sync]


def test_generated_blocks_enter_the_prefix_cache_once_read(tiny_model):
    """Blocks holding a pending token are registered after the token is read: a follow-up prompt made of a
    reply hits the same cached blocks with and without overlap."""
    hits = {}
    for overlap in (False, True):
        llm = LLM(tiny_model, None, RolloutConfig(num_blocks=128, block_size=4, overlap_decode=overlap))
        first = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=21, ignore_eos=True))[0]
        follow = first.prompt_token_ids + first.outputs[0].token_ids + [7]
        bm = llm.block_manager
        before = bm.hit_tokens
        llm.generate([follow], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        hits[overlap] = bm.hit_tokens - before
    assert hits[True] == hits[False] == 20  # 24 known tokens, the last one never computed: 5 full blocks of 4


def test_abort_while_a_step_is_in_flight_leaves_no_placeholder(tiny_model):
    llm = LLM(tiny_model, None, RolloutConfig(num_blocks=64, block_size=4, overlap_decode=True))
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)
    keep = llm.add_request([2, 3, 4], params)
    drop = llm.add_request([5, 6], params)
    for _ in range(5):
        llm.step(ahead=True)
    assert llm._inflight is not None
    llm.abort_request(drop)
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step(ahead=True):
            if o.finished:
                outs[o.request_id] = o
    llm._flush()
    assert outs[drop].outputs[0].finish_reason == "abort"
    assert PENDING not in outs[drop].outputs[0].token_ids and 1 <= len(outs[drop].outputs[0].token_ids) < 30
    assert len(outs[drop].outputs[0].logprobs) == len(outs[drop].outputs[0].token_ids)
    assert len(outs[keep].outputs[0].token_ids) == 30


def test_launching_ahead_is_off_by_default_on_the_cpu(tiny_model):
    """Nothing on the CPU runs asynchronously: launching ahead would only compute rows of stopped sequences."""
    llm = LLM(tiny_model, None, RolloutConfig(num_blocks=64, block_size=4))
    llm.generate([[2, 3, 4]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.config.overlap_decode is None and llm.stats()["num_steps_ahead"] == 0


def test_a_whole_batch_prefill_is_queued_ahead_and_its_draws_feed_the_first_decode_launch(tiny_model):
    """All prompts prefilled in one step (the eval and RL rollout shape): that step is launched without waiting
    for its draws, and the first decode launch takes them on the device; same tokens and log-probs as the
    synchronous engine, for greedy and seeded rows, with and without a stop at the first token."""
    prompts = _prompts(12, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=14, min_tokens=2, stop_token_ids=[5, 6, 7, 8]),
        SamplingParams(temperature=1.0, seed=9, max_tokens=1),  # stops at the prefill's token
    ]
    params = [params[i % 3] for i in range(12)]
    cfg = {"num_blocks": 256, "block_size": 4, "max_num_seqs": 16, "max_num_batched_tokens": 1024}
    sync_llm = LLM(tiny_model, None, RolloutConfig(overlap_decode=False, **cfg))
    ahead_llm = LLM(tiny_model, None, RolloutConfig(overlap_decode=True, **cfg))
    sync = sync_llm.generate(prompts, params)
    ahead = ahead_llm.generate(prompts, params)
    assert ahead_llm.stats()["num_mixed_ahead"] == 1 and sync_llm.stats()["num_mixed_ahead"] == 0
    for a, b in zip(sync, ahead):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-5)
    assert [len(o.outputs[0].token_ids) for o in ahead[2::3]] == [1] * 4


def test_prompt_steps_with_topk_alternatives_stay_synchronous(tiny_model):
    """Top-k alternatives of the draws are read on the host between steps: those prompt steps are not launched
    ahead."""
    cfg = RolloutConfig(num_blocks=128, block_size=4, overlap_decode=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    llm = LLM(tiny_model, None, cfg)
    out = llm.generate([[2, 3, 4, 5, 6], [7, 8, 9]], params)
    assert llm.stats()["num_mixed_ahead"] == 0
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)


def test_scoring_steps_launched_ahead_equal_synchronous(tiny_model):
    """Prompt log-probs ride a prompt step queued ahead (stored when the step is read): chunked prompts (several
    chunks of one prompt, ``queued`` rows counted before they are stored), top-k alternatives of the prompt, a
    continuation scored after a cached context, and batches whose every row ends at the prefill's token all give
    what the synchronous engine gives, with the ahead steps counted."""
    g = torch.Generator().manual_seed(5)
    ctx = torch.randint(2, 96, (18,), generator=g).tolist()
    prompts = [ctx + torch.randint(2, 96, (int(k),), generator=g).tolist() for k in (3, 5, 2, 7)]
    prompts += _prompts(6, seed=4)
    cases = [
        [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, prompt_logprobs_from=18)] * 4
        + [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)] * 6,
        [SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, prompt_logprobs=0)] * 10,
    ]
    for params in cases:
        outs, stats = {}, {}
        for overlap in (False, True):
            cfg = RolloutConfig(
                num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, overlap_decode=overlap
            )
            llm = LLM(tiny_model, None, cfg)
            outs[overlap] = llm.generate(prompts, params)
            stats[overlap] = llm.stats()
            assert not llm.has_unfinished_requests() and llm._inflight is None
        assert stats[True]["num_mixed_ahead"] > 0 and stats[False]["num_mixed_ahead"] == 0
        for a, b in zip(outs[False], outs[True]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            pa, pb = a.prompt_logprobs, b.prompt_logprobs
            assert len(pb.logprobs) == len(b.prompt_token_ids) and pb.queued == 0
            assert pa.ranks == pb.ranks  # the steps batch other rows: numbers within float rounding
            assert [x is None for x in pa.logprobs] == [x is None for x in pb.logprobs]
            got = [x for x in pb.logprobs if x is not None]
            assert got and torch.allclose(torch.tensor(got), torch.tensor([x for x in pa.logprobs if x is not None]))
            for ta, tb in zip(pa.top_logprobs, pb.top_logprobs):
                assert (ta is None) == (tb is None) and (ta is None or ta.keys() == tb.keys())
                assert ta is None or all(abs(ta[i] - tb[i]) < 1e-5 for i in ta)


def test_rows_ending_by_length_are_not_scheduled_while_their_token_is_in_flight(tiny_model):
    """A row whose tokens in flight reach max_tokens finishes when they are read: the ahead engine schedules no
    decode step for it (no more steps than the synchronous engine), and the blocks it filled still enter the prefix
    cache when it finishes."""
    prompts = _prompts(5, seed=8)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    sync_llm, sync = _run(tiny_model, False, 128, prompts, params, decode_steps=4)
    ahead_llm, ahead = _run(tiny_model, True, 128, prompts, params, decode_steps=4)
    assert [r[1] for r in ahead] == [r[1] for r in sync]
    assert ahead_llm.stats()["num_generated_tokens"] == sync_llm.stats()["num_generated_tokens"] == 60
    assert ahead_llm.num_steps <= sync_llm.num_steps
    for llm, rows in ((sync_llm, sync), (ahead_llm, ahead)):
        bm = llm.block_manager
        before = bm.hit_tokens
        follow = rows[0][0] + rows[0][1] + [7]
        llm.generate([follow], SamplingParams(temperature=0, max_tokens=1))
        assert bm.hit_tokens - before == (len(follow) - 2) // 4 * 4  # every full block of known, computed tokens


def test_rows_reaching_the_model_length_are_not_computed_past_it(tiny_model):
    """A row whose tokens (those in flight included) reach max_model_len finishes when they are read, like one that
    reaches max_tokens: the ahead engine neither schedules it again nor queues launch steps whose draws fall past
    the model length, so no sequence ever holds more than max_model_len - 1 computed positions (what the synchronous
    engine computes), whether the cache or max_model_len sets the length."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (k,), generator=g).tolist() for k in (5, 9, 14, 3)]
    params = SamplingParams(temperature=1.0, seed=3, ignore_eos=True, max_tokens=200)
    for num_blocks, max_len in ((256, 30), (8, None)):  # 8 blocks of 4: the cache caps the model length at 32
        runs = {}
        for overlap in (False, True):
            cfg = RolloutConfig(
                num_blocks=num_blocks, block_size=4, max_num_seqs=8, overlap_decode=overlap, max_model_len=max_len
            )
            llm = LLM(tiny_model, None, cfg)
            held = [0]
            allocate = llm.block_manager.allocate

            def tracked(seq, num_tokens, allocate=allocate, held=held):
                held[0] = max(held[0], num_tokens)
                return allocate(seq, num_tokens)

            llm.block_manager.allocate = tracked
            outs = llm.generate(prompts, params)
            runs[overlap] = [o.outputs[0].token_ids for o in outs], held[0], llm
        (sync, sync_held, _), (ahead, ahead_held, ahead_llm) = runs[False], runs[True]
        limit = ahead_llm.max_model_len
        assert ahead == sync and [len(p) + len(t) for p, t in zip(prompts, ahead)] == [limit] * 4
        assert ahead_llm.stats()["num_steps_ahead"] > 0
        assert sync_held == limit - 1
        assert ahead_held == limit - 1  # no position at or past the last token's was computed


def test_blocks_computed_across_a_weight_swap_never_enter_the_prefix_cache(tiny_model):
    """After ``swap_weights`` a running sequence keeps its KV of the old weights, and every block it fills later
    attends to that KV: none of its blocks may be registered (neither when allocated nor when it finishes,
    ``BlockManager.free_sequence``), or a later prompt hitting them reads KV no fresh engine computes. A prompt
    that extends the swapped sequence, run twice (the second hits what the first registered), gives what an engine
    without a prefix cache gives under the new weights."""
    model = copy.deepcopy(tiny_model)
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}

    def load():
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(new[k])

    cfg = RolloutConfig(num_blocks=256, block_size=4, overlap_decode=True)
    llm = LLM(model, None, cfg)
    prompt = list(range(10, 23))

    def swap(engine, steps):
        if steps == 2:
            engine.swap_weights(load, 1)

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True), between_steps=swap)
    follow = prompt + out[0].outputs[0].token_ids + [7]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    fresh = LLM(model, None, RolloutConfig(num_blocks=256, block_size=4, enable_prefix_caching=False))
    want = fresh.generate([follow], greedy)[0].outputs[0]
    for _ in range(2):
        got = llm.generate([follow], greedy)[0].outputs[0]
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    assert llm.block_manager.hit_tokens > 0  # the second run took the blocks the first one computed
