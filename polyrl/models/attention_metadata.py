"""``AttnMetadata``: what attention needs to know about the tokens of one forward, beside the tokens.

Training and cache-free prefill use the packed form (``cu_seqlens``, ``max_seqlen``). The rollout
engine adds the paged fields (per-layer KV caches, slot mapping, block tables, context lengths); the
decoder then writes the new k/v into the cache and attends over it. This module only holds and builds
the fields; it does not allocate caches or schedule blocks (``polyrl.infer`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttnMetadata:
    """``cu_seqlens`` int32 ``[B+1]`` counts the query tokens of this forward per sequence.

    Paged fields (all None for training): ``kv_caches`` one ``(k_cache, v_cache)`` per layer, each
    ``[num_blocks, block_size, Hk, D]``; ``slot_mapping`` int64 ``[T]`` (flat cache slot of each new token,
    negative = padding, not written); ``block_tables`` int32 ``[B, max_blocks]``; ``context_lens`` int32 ``[B]``
    (tokens in the cache for each sequence, the new ones included).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None

    @property
    def is_paged(self) -> bool:
        return self.kv_caches is not None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @classmethod
    def paged(cls, x: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> AttnMetadata:
        """The engine's form for a step's device inputs ``x`` (``cu_seqlens``, ``max_seqlen``, ``slot_mapping``,
        ``block_tables``, ``context_lens``: ``infer.batch.StepInputs``) on ``kv_caches``."""
        return cls(
            cu_seqlens=x.cu_seqlens,
            max_seqlen=x.max_seqlen,
            kv_caches=kv_caches,
            slot_mapping=x.slot_mapping,
            block_tables=x.block_tables,
            context_lens=x.context_lens,
        )

    @classmethod
    def from_seqlens(
        cls, seqlens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
    ) -> AttnMetadata:
        """The training form for packed sequences of the given lengths."""
        lens = [int(x) for x in (seqlens.tolist() if isinstance(seqlens, torch.Tensor) else seqlens)]
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        if lens:
            cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        return cls(cu_seqlens=cu.to(device) if device is not None else cu, max_seqlen=max(lens, default=0))

    def to(self, device: torch.device | str) -> AttnMetadata:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        caches = self.kv_caches
        return AttnMetadata(
            cu_seqlens=move(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            kv_caches=caches,
            slot_mapping=move(self.slot_mapping),
            block_tables=move(self.block_tables),
            context_lens=move(self.context_lens),
        )
