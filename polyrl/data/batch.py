"""``PackedBatch``: variable-length sequences concatenated into one row, and the function that builds it.

Labels are shifted inside each sequence here, once, so no model or loss has to know where sequences
end: ``labels[t] = input_ids[t+1]`` when t+1 is in the same sequence and token t+1 is a loss token,
else -100. This module does not choose which sequences go together (that is ``packing.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from polyrl.data.examples import TokenizedSeq

IGNORE_INDEX = -100
# A fixed-shape batch (``pack_sequences(..., pad_to=...)``) puts its padding into sequences of at most this many
# tokens: attention over the padding then costs (chunk x padding), not padding^2.
PAD_CHUNK = 128


@dataclass
class PackedBatch:
    """Packed micro-batch. Shapes: T total tokens, B sequences.

    input_ids int64 [T]; labels int64 [T] (shifted next-token targets, -100 = no loss); position_ids int64 [T]
    (restart at 0 per sequence); cu_seqlens int32 [B+1]; max_seqlen int; num_target_tokens int. A fixed-shape batch
    ends in ``padding_sequences`` sequences holding its ``padding_tokens`` (labels -100) or nothing (empty).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_target_tokens: int
    padding_tokens: int = 0
    padding_sequences: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def seqlens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=non_blocking),
            max_seqlen=self.max_seqlen,
            num_target_tokens=self.num_target_tokens,
            padding_tokens=self.padding_tokens,
            padding_sequences=self.padding_sequences,
        )


def shifted_labels(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """Next-token targets of one sequence: ``input_ids[t+1]`` where token t+1 is a loss token, else -100."""
    n = len(input_ids)
    out = [IGNORE_INDEX] * n
    for t in range(n - 1):
        if loss_mask[t + 1]:
            out[t] = int(input_ids[t + 1])
    return out


def pack_sequences(
    seqs: Sequence[TokenizedSeq],
    pad_to: int | None = None,
    num_sequences: int | None = None,
    max_seqlen: int | None = None,
) -> PackedBatch:
    """Concatenate ``seqs`` (in order, none split) into one PackedBatch.

    Fixed shapes (``pad_to``): the tokens are padded to ``pad_to`` with sequences of at most ``PAD_CHUNK`` padding
    tokens (id 0, no target), ``cu_seqlens`` to ``num_sequences + 1`` entries with empty sequences, and
    ``max_seqlen`` is the given bound, so batches of other sequences have the same shapes (a CUDA-graphed training
    step replays them). The loss and its gradient are those of the unpadded batch."""
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    cu = [0]
    for seq in seqs:
        if len(seq) == 0:
            raise ValueError("cannot pack an empty sequence")
        ids.extend(int(i) for i in seq.input_ids)
        labels.extend(shifted_labels(seq.input_ids, seq.loss_mask))
        positions.extend(range(len(seq)))
        cu.append(cu[-1] + len(seq))
    longest = max(len(s) for s in seqs)
    real_tokens, real_sequences = cu[-1], len(cu) - 1
    if pad_to is not None:
        if real_tokens > pad_to:
            raise ValueError(f"{real_tokens} tokens do not fit a fixed-shape batch of {pad_to}")
        while cu[-1] < pad_to:
            n = min(PAD_CHUNK, pad_to - cu[-1])
            ids.extend([0] * n)
            labels.extend([IGNORE_INDEX] * n)
            positions.extend(range(n))
            cu.append(cu[-1] + n)
        if num_sequences is not None:
            if len(cu) - 1 > num_sequences:
                raise ValueError(
                    f"{len(cu) - 1} sequences ({real_sequences} + padding) exceed the fixed capacity {num_sequences}"
                )
            cu.extend([cu[-1]] * (num_sequences + 1 - len(cu)))
        bound = max(longest, min(PAD_CHUNK, pad_to)) if max_seqlen is None else max_seqlen
        if bound < max(longest, min(PAD_CHUNK, pad_to - real_tokens)):
            raise ValueError(f"max_seqlen {bound} is shorter than a sequence of the batch")
        longest = bound
    labels_t = torch.tensor(labels, dtype=torch.int64)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        labels=labels_t,
        position_ids=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=longest,
        num_target_tokens=int((labels_t != IGNORE_INDEX).sum()),
        padding_tokens=cu[-1] - real_tokens,
        padding_sequences=len(cu) - 1 - real_sequences,
    )
