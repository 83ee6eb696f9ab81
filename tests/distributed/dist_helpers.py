"""Helpers for the gloo tests: a tiny real DecoderLM, packed batches, and launching N ranks with
``torch.multiprocessing.spawn`` (each rank gets the torchrun variables, so ``init_world()`` runs as under
torchrun). Results travel back as JSON files: nothing here mocks a part of the run."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch

from polyrl.data.batch import PackedBatch, pack_sequences
from polyrl.data.examples import TokenizedSeq
from polyrl.models import ModelConfig, build_model

VOCAB = 64


def tiny_lm(seed: int = 0) -> Any:
    """Qwen3-style, tied embeddings (exercises the shared embed/lm_head in the FSDP root), fp32, CPU."""
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    return build_model(cfg, dtype=torch.float32, seed=seed)


def global_batches(step: int) -> list[PackedBatch]:
    """The 4 micro-batches of optimizer step ``step`` (different lengths, so token counts differ by rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(4):
        seqs = [torch.randint(0, VOCAB, (5 + 3 * i + j,), generator=g) for j in range(2)]
        out.append(pack_sequences([TokenizedSeq(s.tolist(), [0] + [1] * (len(s) - 1)) for s in seqs]))
    return out


PROMPTS = [[3, 5, 7], [11, 2], [9, 9, 9, 9, 1], [4], [20, 21, 22, 23]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Any, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    fn(rank, world_size, *args)


def spawn(fn: Any, world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (raises if any rank fails)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def write_json(path: Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
