"""Block manager: which KV-cache blocks each sequence owns, with reference counts and prefix caching.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence's ``block_table`` lists
its blocks in order; token ``i`` lives in slot ``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching: once a block is full of known tokens it is registered under the key
``hash((parent_key, tokens_of_block))``, so a key names the whole prefix up to that block. A new sequence
whose leading full blocks match registered keys takes those blocks (reference count + 1) and skips
computing them: the ``n`` samples of a GRPO prompt and repeated system prompts share their KV. A sequence
that still needs prompt log-probs takes only the cached blocks below the first position it must score. Only full
blocks are ever shared and a shared block is never written again, so no copy-on-write is needed. A block
is registered when it is allocated for tokens that this step computes; other sequences scheduled later
in the same step may already hit it, which is safe because every layer writes the step's keys/values
before it attends.

Freed blocks (reference count 0) keep their key and stay findable until they are reused: the free list
is LRU-ordered, unregistered blocks first, so the least recently used cached prefix is evicted first.

This module does bookkeeping on Python ints only; the tensors live in ``kv_cache.py``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable

from polyrl.infer.sequence import Sequence

# ``Sequence.num_hashed_blocks`` of a sequence whose blocks must never be registered (KV of replaced weights)
NEVER_REGISTER = sys.maxsize


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reset(num_blocks)

    def reset(self, num_blocks: int | None = None) -> None:
        """Forget every block (all sequences must have been freed or preempted first)."""
        if num_blocks is not None:
            self.num_blocks = num_blocks
        n = self.num_blocks
        self.ref_count = [0] * n
        self.block_key: list[int | None] = [None] * n
        self.block_id: list[tuple[int | None, tuple[int, ...]] | None] = [None] * n  # (parent key, tokens)
        self.cached: dict[int, int] = {}  # key -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n))
        self.query_tokens = 0  # prefix-cache statistics (tokens looked up / tokens hit)
        self.hit_tokens = 0

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate (including cached blocks nobody uses, which would be evicted)."""
        return len(self.free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _key(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Registered blocks matching ``seq``'s leading full blocks, leaving at least its last token to
        compute (it must produce logits). Changes nothing."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        bs = self.block_size
        limit = (seq.num_tokens - seq.pending - 1) // bs
        pl = seq.prompt_lps
        if pl is not None and pl.filled < seq.num_prompt:
            # prompt log-probs still missing from position filled - 1 on: those hidden states must be computed
            limit = min(limit, (pl.filled - 1) // bs)
        hits: list[int] = []
        parent: int | None = None
        for i in range(limit):
            tokens = tuple(seq.tokens[i * bs : (i + 1) * bs])
            key = self._key(parent, tokens)
            block = self.cached.get(key)
            if block is None or self.block_id[block] != (parent, tokens):
                break
            hits.append(block)
            parent = key
        return hits

    def free_blocks_to_take(self, hits: list[int]) -> int:
        """How many of ``hits`` currently sit in the free list (taking them uses up free capacity)."""
        return sum(1 for b in hits if self.ref_count[b] == 0)

    # ---- changes ---------------------------------------------------------------------------------
    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Give ``seq`` the cached blocks ``hits`` (from ``lookup_prefix``) and mark them computed."""
        for b in hits:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.last_hash = self.block_key[hits[-1]] if hits else None
        self.query_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s table to hold ``num_tokens`` tokens and register the full blocks among them.

        ``seq.tokens[:num_tokens]`` must be known (they are computed in the step being scheduled).
        Returns False, changing nothing, when there are not enough free blocks.
        """
        bs = self.block_size
        table = seq.block_table
        need = -(-num_tokens // bs) - len(table)  # blocks_needed, inlined: this runs per sequence per step
        if need > 0:
            if need > len(self.free):
                return False
            for _ in range(need):
                table.append(self._take_free_block())
        # A pending (not yet read) last token is no part of a block's key: that block registers once it is read.
        if self.enable_prefix_caching and min(num_tokens, len(seq.tokens) - seq.pending) // bs > seq.num_hashed_blocks:
            self._register_full_blocks(seq, num_tokens)
        return True

    def free_sequence(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Its registered blocks stay cached (evictable) until reused; full blocks of
        computed, known tokens not registered yet (a sequence that stops while nothing more was allocated for it,
        ``scheduler._stops_by_length``) are registered first."""
        known = min(seq.num_computed, len(seq.tokens) - seq.pending)
        if self.enable_prefix_caching and seq.block_table and known // self.block_size > seq.num_hashed_blocks:
            self._register_full_blocks(seq, known)
        # Tail blocks first, so that under LRU eviction a prefix's tail goes before its head.
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.block_key[b] is None:
                    self.free.move_to_end(b, last=False)  # nothing to keep: reuse it first
        seq.block_table = []
        seq.num_computed = 0
        seq.num_hashed_blocks = 0
        seq.last_hash = None

    def reset_prefix_cache(self, live: Iterable[Sequence] = ()) -> None:
        """Forget every registered prefix (call after the model's weights change: cached KV is stale). The ``live``
        sequences keep their blocks, whose KV is the old weights', and every block they fill later attends to that
        KV: none of their blocks is registered from now on (not when allocated, not when freed), until a preemption
        frees them and the sequence recomputes its tokens."""
        for b in range(self.num_blocks):
            self.block_key[b] = None
            self.block_id[b] = None
        self.cached.clear()
        for seq in live:
            if seq.block_table:
                seq.num_hashed_blocks = NEVER_REGISTER

    def _take_free_block(self) -> int:
        b, _ = self.free.popitem(last=False)  # least recently used first
        key = self.block_key[b]
        if key is not None:  # evict the cached prefix this block held
            if self.cached.get(key) == b:
                del self.cached[key]
            self.block_key[b] = None
            self.block_id[b] = None
        self.ref_count[b] = 1
        return b

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        full = min(num_tokens, seq.num_tokens - seq.pending) // bs
        parent = seq.last_hash
        for i in range(seq.num_hashed_blocks, full):
            tokens = tuple(seq.tokens[i * bs : (i + 1) * bs])
            key = self._key(parent, tokens)
            b = seq.block_table[i]
            if key not in self.cached and self.block_key[b] is None:
                self.cached[key] = b
                self.block_key[b] = key
                self.block_id[b] = (parent, tokens)
            parent = key
        if full > seq.num_hashed_blocks:
            seq.num_hashed_blocks = full
            seq.last_hash = parent
