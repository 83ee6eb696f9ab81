"""A tiny decoder LM and packed batches for the training-engine tests.

``TinyLM`` follows the ``DecoderLM`` forward contract (``forward(input_ids [T], position_ids [T], meta)
-> hidden [T, H]``, ``lm_head_weight``, ``flops_per_token``, ``gradient_checkpointing``) with real
polyrl kernels (rmsnorm, rope, varlen attention, swiglu), so packing and the loss path are exercised.
``Packed`` mirrors ``polyrl.data.PackedBatch``. Not a model anyone trains for real.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from polyrl import kernels


@dataclass
class Packed:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_target_tokens: int

    def to(self, device: torch.device) -> Packed:
        return Packed(
            self.input_ids.to(device),
            self.labels.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            self.max_seqlen,
            self.num_target_tokens,
        )


def pack(seqs: list[torch.Tensor]) -> Packed:
    """Pack token sequences; labels are the next token inside each sequence, -100 on the last one."""
    ids, labels, pos, cu = [], [], [], [0]
    for s in seqs:
        ids.append(s)
        labels.append(torch.cat([s[1:], torch.tensor([-100])]))
        pos.append(torch.arange(len(s)))
        cu.append(cu[-1] + len(s))
    lab = torch.cat(labels)
    return Packed(
        torch.cat(ids),
        lab,
        torch.cat(pos),
        torch.tensor(cu, dtype=torch.int32),
        max(len(s) for s in seqs),
        int((lab != -100).sum()),
    )


def random_seqs(n: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor, max_len: int):
        t = x.shape[0]
        q, k, v = self.qkv(kernels.rmsnorm(x, self.attn_norm)).view(t, 3, self.heads, self.head_dim).unbind(1)
        q, k = kernels.apply_rope(q, k, cos, sin)
        x = x + self.o(kernels.varlen_attention(q, k, v, cu, max_len).reshape(t, -1))
        gate, up = self.gate_up(kernels.rmsnorm(x, self.mlp_norm)).chunk(2, dim=-1)
        return x + self.down(kernels.swiglu(gate, up))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(Block(hidden, heads, 2 * hidden) for _ in range(layers))
        self.model.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.gradient_checkpointing = False
        self.head_dim = hidden // heads

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def flops_per_token(self, seq_len: int) -> float:
        n = sum(p.numel() for p in self.parameters())
        return 6.0 * n + 6.0 * seq_len * self.model.embed_tokens.embedding_dim * len(self.model.layers)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = kernels.rope_cos_sin(position_ids, self.head_dim, 10000.0, dtype=x.dtype)
        for layer in self.model.layers:
            args = (x, cos, sin, meta.cu_seqlens, meta.max_seqlen)
            x = checkpoint(layer, *args, use_reentrant=False) if self.gradient_checkpointing else layer(*args)
        return kernels.rmsnorm(x, self.model.norm)
