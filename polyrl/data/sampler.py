"""Resumable, deterministic iterator of PackedBatch micro-batches over epochs.

Each epoch's plan is a pure function of (seed, epoch, unit lengths): the units are shuffled by a generator
seeded with ``seed`` and ``epoch``, packed (``packing.py``) and, for ``ffd``, the batch order is shuffled again
so lengths are not sorted. The state is just ``(epoch, position)``, so a checkpoint restores the exact remaining
stream. A unit is a tuple of sequences kept in one batch (one sequence for SFT; chosen + rejected for DPO).
With ``world_size > 1`` rank r takes batches r, r + world_size, ...; every rank gets the same number per epoch.
With ``fixed_shapes`` every batch is padded to the budget, a sequence capacity (the epoch's fullest batch plus room
for the padding sequences, rounded up to 16) and the dataset's longest sequence as ``max_seqlen``
(``pack_sequences(pad_to=...)``): the shapes repeat, so a CUDA-graphed training step replays them.
This iterator does not tokenise or truncate; units must already fit the budget.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from polyrl.data.batch import PAD_CHUNK, PackedBatch, pack_sequences
from polyrl.data.examples import TokenizedSeq
from polyrl.data.packing import plan_batches
from polyrl.errors import CheckpointError, DataError

Unit = Sequence[TokenizedSeq]


class PackedBatchIterator:
    """Infinite (or ``max_epochs``-long) stream of packed micro-batches; ``state_dict`` / ``load_state_dict``."""

    def __init__(
        self,
        units: Sequence[Unit],
        tokens_per_batch: int,
        packing: str = "ffd",
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        max_epochs: int | None = None,
        fixed_shapes: bool = False,
    ):
        if not units:
            raise DataError("the dataset has no usable rows after parsing, truncation and filtering")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.units = list(units)
        self.lengths = [sum(len(s) for s in u) for u in self.units]
        self.tokens_per_batch = int(tokens_per_batch)
        self.packing = packing
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank, self.world_size = rank, world_size
        self.max_epochs = max_epochs
        self.fixed_shapes = fixed_shapes
        longest = max(len(s) for u in self.units for s in u)
        self.max_seqlen = max(longest, min(PAD_CHUNK, self.tokens_per_batch))  # fixed shapes: every batch's bound
        self.epoch = 0
        self.position = 0
        self._plan_epoch: int | None = None
        self._plan: list[list[int]] = []
        self._capacity: tuple[int, int] | None = None  # (epoch, sequences per fixed-shape batch)
        self.fingerprint = hashlib.sha256(
            repr((self.lengths, self.tokens_per_batch, packing, shuffle, world_size)).encode()
        ).hexdigest()[:16]
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the dataset packs into {len(self._epoch_plan(0))} batches, fewer than the {world_size} ranks; "
                "use more data or a smaller tokens_per_batch"
            )

    def _epoch_plan(self, epoch: int) -> list[list[int]]:
        if self._plan_epoch != epoch:
            order = list(range(len(self.units)))
            rng = random.Random(f"polyrl-data:{self.seed}:{epoch}")
            if self.shuffle:
                rng.shuffle(order)
            plan = plan_batches(self.lengths, order, self.tokens_per_batch, self.packing)
            if self.shuffle and self.packing == "ffd":
                rng.shuffle(plan)
            self._plan, self._plan_epoch = plan, epoch
        return self._plan

    @property
    def batches_per_epoch(self) -> int:
        return len(self._epoch_plan(self.epoch)) // self.world_size

    def __iter__(self) -> PackedBatchIterator:
        return self

    def __next__(self) -> PackedBatch:
        if self.position >= self.batches_per_epoch:
            if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                raise StopIteration
            self.epoch += 1
            self.position = 0
        plan = self._epoch_plan(self.epoch)
        batch = plan[self.position * self.world_size + self.rank]
        self.position += 1
        seqs = [seq for i in batch for seq in self.units[i]]
        if not self.fixed_shapes:
            return pack_sequences(seqs)
        return pack_sequences(seqs, self.tokens_per_batch, self.sequence_capacity(self.epoch), self.max_seqlen)

    def sequence_capacity(self, epoch: int) -> int:
        """Fixed shapes: the sequences every batch of ``epoch`` is padded to (its fullest batch, the padding
        sequences a batch can need, rounded up to 16 so that most epochs share one shape). Computed once per epoch."""
        if self._capacity is None or self._capacity[0] != epoch:
            fullest = max(sum(len(self.units[i]) for i in b) for b in self._epoch_plan(epoch))
            need = fullest + -(-self.tokens_per_batch // PAD_CHUNK)
            self._capacity = (epoch, -(-need // 16) * 16)
        return self._capacity[1]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint or state.get("seed") != self.seed:
            raise CheckpointError(
                "the data position in the checkpoint belongs to a different dataset or packing setup "
                f"(fingerprint {state.get('fingerprint')} seed {state.get('seed')}, now {self.fingerprint} seed "
                f"{self.seed}); resume with the same data, seed, max_seq_len and tokens_per_batch"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
