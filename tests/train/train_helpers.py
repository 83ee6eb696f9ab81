"""Tiny real models and packed batches for the training-engine tests.

``tiny_lm`` builds a ``polyrl.models.DecoderLM`` (Qwen3-style: GQA, qk-norm, untied head) small enough
that a step takes milliseconds on the CPU; ``pack`` builds a real ``polyrl.data.PackedBatch`` with the
loss on every next token. Nothing here is a stand-in: the engine runs on the parts users run.
"""

from __future__ import annotations

import torch

from polyrl.data.batch import PackedBatch, pack_sequences
from polyrl.data.examples import TokenizedSeq
from polyrl.models import DecoderLM, ModelConfig, build_model

VOCAB = 64


def tiny_lm(seed: int = 0, hidden: int = 32, heads: int = 4, layers: int = 2, tied: bool = False) -> DecoderLM:
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        qk_norm=True,
        tie_word_embeddings=tied,
        max_position_embeddings=512,
    )
    return build_model(cfg, dtype=torch.float32, seed=seed)


def pack(seqs: list[torch.Tensor]) -> PackedBatch:
    """Pack token sequences; every token after the first is a target (labels shifted inside each sequence)."""
    return pack_sequences([TokenizedSeq(s.tolist(), [0] + [1] * (len(s) - 1)) for s in seqs])


def random_seqs(n: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]
