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


@dataclass
class PackedBatch:
    """Packed micro-batch. Shapes: T total tokens, B sequences.

    input_ids int64 [T]; labels int64 [T] (shifted next-token targets, -100 = no loss); position_ids int64 [T]
    (restart at 0 per sequence); cu_seqlens int32 [B+1]; max_seqlen int; num_target_tokens int.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_target_tokens: int

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
        )


def shifted_labels(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """Next-token targets of one sequence: ``input_ids[t+1]`` where token t+1 is a loss token, else -100."""
    n = len(input_ids)
    out = [IGNORE_INDEX] * n
    for t in range(n - 1):
        if loss_mask[t + 1]:
            out[t] = int(input_ids[t + 1])
    return out


def pack_sequences(seqs: Sequence[TokenizedSeq]) -> PackedBatch:
    """Concatenate ``seqs`` (in order, none split) into one PackedBatch."""
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
    labels_t = torch.tensor(labels, dtype=torch.int64)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        labels=labels_t,
        position_ids=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(len(s) for s in seqs),
        num_target_tokens=int((labels_t != IGNORE_INDEX).sum()),
    )
