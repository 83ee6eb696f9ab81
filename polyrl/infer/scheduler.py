"""Continuous-batching scheduler: which sequences run in the next step and how many tokens each computes.

One step mixes decodes (1 new token) and prefill chunks under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. Running sequences first, oldest first: each asks for its remaining uncomputed tokens (1 for a
   decode, the rest of its prompt for a chunked prefill), cut to the budget left. When the cache has no
   block for it, the newest running sequence is preempted by recompute (its blocks are freed, it goes
   back to the front of the waiting queue keeping its generated tokens) until it fits.
2. Then waiting sequences in arrival order, while budget, sequence slots and free blocks last. A new
   sequence first takes its cached prefix blocks (``BlockManager.lookup_prefix``), so it only computes
   the rest. No new sequence is admitted in a step that preempted.

A sequence samples a token only in the step that computes its last known token. This module decides
nothing about stopping (``stopping.py``) and never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from polyrl.infer.block_manager import BlockManager
from polyrl.infer.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed in this step (= seq.num_computed before the step)
    num_new: int  # tokens computed in this step
    sample: bool  # this step computes the sequence's last known token: sample the next one


@dataclass
class SchedulerOutput:
    items: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new for it in self.items)

    @property
    def is_decode_only(self) -> bool:
        return bool(self.items) and all(it.num_new == 1 and it.sample for it in self.items)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.bm = block_manager
        self.max_model_len = max_model_len  # prompt + output tokens (stopping.check_stop ends a sequence there)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.total_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue = list(self.running)  # the order sequences are served in (oldest first)
        i = 0
        allocate, items = self.bm.allocate, out.items
        while i < len(queue) and budget > 0:
            seq = queue[i]
            if seq.pending and _stops_by_length(seq, self.max_model_len):  # finishes when its tokens in flight are read
                i += 1
                continue
            total, done = len(seq.tokens), seq.num_computed
            num_new = min(total - done, budget)
            while not allocate(seq, done + num_new):
                victim = queue.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                items.append(ScheduledSeq(seq, done, num_new, done + num_new == total))
                budget -= num_new
                i += 1
        self.running = [s for s in self.running if s.status is Status.RUNNING]
        if out.num_preempted == 0:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bs = self.bm.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.lookup_prefix(seq)
            computed = len(hits) * bs
            num_new = min(seq.num_tokens - computed, budget)
            total_blocks = -(-(computed + num_new) // bs)
            need = self.bm.free_blocks_to_take(hits) + total_blocks - len(hits)
            if need > self.bm.num_free_blocks:
                break
            self.waiting.popleft()
            self.bm.take_prefix(seq, hits)
            ok = self.bm.allocate(seq, computed + num_new)
            assert ok, "block accounting error: admission check passed but allocation failed"
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.items.append(ScheduledSeq(seq, computed, num_new, computed + num_new == seq.num_tokens))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.total_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark ``seq`` finished and free its blocks (they stay in the prefix cache)."""
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.bm.free_sequence(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of ``request_id`` with reason "abort"; returns them."""
        found = [s for s in list(self.running) + list(self.waiting) if s.request_id == request_id]
        for s in found:
            self.finish(s, "abort")
        return found


def _stops_by_length(seq: Sequence, max_model_len: int | None) -> bool:
    """Whether ``seq``'s tokens, those still in flight included, already reach its ``max_tokens`` or the model length
    ``max_model_len``: the read of the step in flight finishes it whatever those tokens are, so a decode row for it
    would be thrown away (and, past the model length, would compute positions beyond it)."""
    n = len(seq.tokens)
    if max_model_len is not None and n >= max_model_len:
        return True
    m = seq.params.max_tokens
    return m is not None and n - seq.num_prompt >= m
