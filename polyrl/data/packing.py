"""Packing: group sequence lengths into micro-batches whose token count fits a budget.

Two plans, both deterministic given the input order: ``greedy`` keeps the (shuffled) order and starts a new batch
when the next item does not fit; ``ffd`` (first-fit decreasing) sorts by length and puts each item in the first
batch with room, which wastes less of the budget. No item is ever split; an item longer than the budget is an
error here (the pipeline truncates or drops it first). This module plans indices; it does not build tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

# The micro-batch token budget when none is given. Its owner is ``StepConfig.micro_batch_tokens`` (``[engine]``):
# a run passes that value to the builders; this default only serves library calls without a run.
DEFAULT_MICRO_BATCH_TOKENS = 8192

PACKING_METHODS = ("ffd", "greedy")


def _check(lengths: Sequence[int], budget: int) -> None:
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    for i, n in enumerate(lengths):
        if n < 1 or n > budget:
            raise ValueError(f"item {i} has length {n}, outside [1, {budget}]; truncate or drop it before packing")


def pack_greedy(lengths: Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """Batches of indices in ``order``; a batch closes when the next item would exceed ``budget``."""
    _check(lengths, budget)
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + lengths[i] > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches


class _MaxTree:
    """Segment tree over bins' remaining capacity: leftmost bin with capacity >= n in O(log bins)."""

    def __init__(self, size: int, capacity: int):
        self.size = 1
        while self.size < max(size, 1):
            self.size *= 2
        self.tree = [0] * (2 * self.size)
        for i in range(size):
            self.tree[self.size + i] = capacity
        for i in range(self.size - 1, 0, -1):
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def first_fit(self, n: int) -> int:
        if self.tree[1] < n:
            return -1
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= n else 2 * i + 1
        return i - self.size

    def take(self, leaf: int, n: int) -> None:
        i = self.size + leaf
        self.tree[i] -= n
        i //= 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2


def pack_ffd(lengths: Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing; ties keep ``order``. Batches come out in creation order (longest first)."""
    _check(lengths, budget)
    rank = {idx: pos for pos, idx in enumerate(order)}
    items = sorted(order, key=lambda i: (-lengths[i], rank[i]))
    tree = _MaxTree(len(items), budget)  # at most one bin per item
    batches: list[list[int]] = []
    for i in items:
        b = tree.first_fit(lengths[i])
        if b == len(batches):
            batches.append([])
        batches[b].append(i)
        tree.take(b, lengths[i])
    return batches


def plan_batches(lengths: Sequence[int], order: Sequence[int], budget: int, method: str) -> list[list[int]]:
    if method == "ffd":
        return pack_ffd(lengths, order, budget)
    if method == "greedy":
        return pack_greedy(lengths, order, budget)
    raise ValueError(f"unknown packing method {method!r}; use one of {PACKING_METHODS}")
