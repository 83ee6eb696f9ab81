"""Scheduler: chunked prefill under the token budget, decode batching, preemption by recompute, admission."""

from __future__ import annotations

from polyrl.infer.block_manager import BlockManager
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.scheduler import Scheduler
from polyrl.infer.sequence import Sequence, Status


def make(num_blocks=64, block_size=4, max_seqs=8, budget=16):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_seqs, budget)


def seq(i: int, n: int, base: int = 0) -> Sequence:
    return Sequence(i, f"r{i}", 0, [base + i * 1000 + t for t in range(n)], SamplingParams())


def run_step(sched: Scheduler, out) -> None:
    """What the engine does after a forward: mark tokens computed and append a token where sampled."""
    for it in out.items:
        it.seq.num_computed = it.start + it.num_new
        if it.sample:
            it.seq.tokens.append(7)


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    _, sched = make(budget=16)
    a = seq(0, 40)
    sched.add(a)
    chunks = []
    while True:
        out = sched.schedule()
        assert out.num_tokens <= 16
        chunks.append((out.items[0].start, out.items[0].num_new, out.items[0].sample))
        run_step(sched, out)
        if out.items[0].sample:
            break
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    out = sched.schedule()  # now a decode
    assert [(it.start, it.num_new, it.sample) for it in out.items] == [(40, 1, True)]
    assert out.is_decode_only


def test_decodes_first_then_new_prefills_share_the_budget():
    _, sched = make(budget=10)
    a, b = seq(0, 3), seq(1, 20)
    sched.add(a)
    run_step(sched, sched.schedule())  # a prefilled, sampled one token
    sched.add(b)
    out = sched.schedule()
    assert [(it.seq.seq_id, it.num_new) for it in out.items] == [(0, 1), (1, 9)]


def test_max_num_seqs_caps_running():
    _, sched = make(max_seqs=2, budget=100)
    for i in range(3):
        sched.add(seq(i, 5))
    out = sched.schedule()
    assert len(out.items) == 2 and sched.num_waiting == 1


def test_preemption_by_recompute_keeps_generated_tokens_and_resumes():
    bm, sched = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(0, 7), seq(1, 7)  # 2 blocks each: the cache is full after admitting both
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.items) == 2 and bm.num_free_blocks == 0
    run_step(sched, out)  # both hold 8 tokens, 7 computed: the decode of token 8 still fits
    out = sched.schedule()
    assert out.num_preempted == 0 and out.is_decode_only
    run_step(sched, out)  # 9 tokens each: the next decode needs a third block each
    out = sched.schedule()
    # a (older) keeps running: b is preempted to free its blocks, a takes one, and b waits.
    assert out.num_preempted == 1 and [it.seq.seq_id for it in out.items] == [0]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert b.tokens[-2:] == [7, 7] and b.num_tokens == 9  # generated tokens kept
    run_step(sched, out)
    sched.finish(a, "length")
    out = sched.schedule()
    # b is recomputed: its 9 known tokens are prefilled again (its cached full blocks may be reused).
    (it,) = out.items
    assert it.seq is b and it.start + it.num_new == 9 and it.sample and it.start % 4 == 0


def test_preempts_itself_when_alone_in_the_way():
    bm, sched = make(num_blocks=3, block_size=2, budget=64, max_seqs=4)
    a, b = seq(0, 3), seq(1, 1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a: 2 blocks, b: 1 block
    run_step(sched, out)
    out = sched.schedule()  # a has 4 tokens (fits in 2 blocks); b has 2 tokens (fits)
    run_step(sched, out)
    out = sched.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert out.num_preempted == 1 and b.status is Status.WAITING


def test_new_sequence_reuses_cached_prefix():
    bm, sched = make(block_size=4, budget=64)
    a = seq(0, 9)
    b = Sequence(1, "r1", 0, list(a.tokens[:8]) + [99, 98], SamplingParams())
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)
    out = sched.schedule()
    it = [x for x in out.items if x.seq is b][0]
    assert it.start == 8 and it.num_new == 2  # 2 cached blocks skipped
    assert bm.hit_tokens == 8
