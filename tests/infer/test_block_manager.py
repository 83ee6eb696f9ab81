"""Block manager: reference counts, prefix-cache hits on full blocks only, LRU eviction, reset."""

from __future__ import annotations

from polyrl.infer.block_manager import BlockManager
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.sequence import Sequence

_ids = iter(range(10**6))


def seq(tokens: list[int]) -> Sequence:
    return Sequence(next(_ids), "r", 0, tokens, SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> int:
    hits = bm.lookup_prefix(s)
    bm.take_prefix(s, hits)
    assert bm.allocate(s, s.num_tokens)
    return len(hits)


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))  # 10 tokens -> 3 blocks
    assert admit(bm, a) == 0
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.num_cached_blocks == 2  # only the 2 full blocks are registered
    assert not bm.allocate(seq(list(range(100, 124))), 24)  # needs 6 > 5 free: refused, nothing taken
    assert bm.num_free_blocks == 5
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2 and a.block_table == []


def test_prefix_hits_share_blocks_and_keep_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(50, 58))  # 2 full blocks
    a, b = seq(system + [1, 2, 3]), seq(system + [7, 8])
    admit(bm, a)
    assert admit(bm, b) == 2
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed == 8
    assert [bm.ref_count[x] for x in a.block_table[:2]] == [2, 2]
    # An exactly block-aligned identical prompt must still compute its last token: the last block is not hit.
    c = seq(list(system))
    assert admit(bm, c) == 1 and c.num_computed == 4
    # A different first block breaks the chain even if the second block's tokens match.
    d = seq([0, 0, 0, 0] + system[4:] + [9])
    assert admit(bm, d) == 0
    bm.free_sequence(b)
    assert [bm.ref_count[x] for x in a.block_table[:2]] == [2, 1]  # c still holds block 0


def test_generated_tokens_are_cached_as_blocks_fill():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq([5, 6, 7])
    admit(bm, a)
    assert bm.num_cached_blocks == 0
    a.tokens.append(8)  # a decoded token fills block 0
    a.num_computed = 3
    assert bm.allocate(a, 4)
    assert bm.num_cached_blocks == 1
    b = seq([5, 6, 7, 8, 9])
    assert admit(bm, b) == 1


def test_lru_eviction_and_reuse_of_freed_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = seq([1, 2, 3]), seq([4, 5, 6])  # each: 1 full block + 1 partial
    admit(bm, old)
    bm.free_sequence(old)
    admit(bm, new)
    bm.free_sequence(new)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    # Reusing a freed cached block takes it out of the free list.
    again = seq([4, 5, 9])
    assert admit(bm, again) == 1 and bm.num_free_blocks == 2
    # Now 2 free blocks: the unregistered partial block goes first, then the LRU cached block ([1, 2]).
    big = seq([10, 11, 12])
    admit(bm, big)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 0  # [4,5] (in use) and [10,11]
    assert bm.lookup_prefix(seq([1, 2, 0])) == []  # [1,2] was the LRU cached block: evicted
    assert bm.lookup_prefix(seq([10, 11, 0])) == big.block_table[:1]
    bm.free_sequence(again)
    assert admit(bm, seq([4, 5, 7])) == 1


def test_reset_prefix_cache_forgets_prefixes():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free_sequence(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert admit(bm, seq([1, 2, 3, 4, 5])) == 0


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(bm, seq([1, 2, 3]))
    assert admit(bm, seq([1, 2, 3])) == 0 and bm.num_cached_blocks == 0
