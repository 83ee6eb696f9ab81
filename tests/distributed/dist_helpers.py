"""Helpers for the gloo tests: a tiny real DecoderLM, packed batches, and launching N ranks with
``torch.multiprocessing.spawn`` (each rank gets the torchrun variables, so ``init_world()`` runs as under
torchrun). Results travel back as JSON files: nothing here mocks a part of the run."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
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


@contextlib.contextmanager
def held_ports(n: int) -> Iterator[list[int]]:
    """``n`` ports, each with a ``TCPStore`` server that this (the test's) process holds until the block ends: a
    process group the spawned ranks start on one of them connects every rank to it as a client (``spawn`` sets
    ``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's agent does). A port probed free and bound later by rank 0 could
    be taken by another process in between (the other test workers' servers and groups bind ports all the time). One
    process group per port: a second one on the same port would find the first one's keys."""
    from torch.distributed import TCPStore

    stores = [TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False) for _ in range(n)]
    try:
        yield [int(s.port) for s in stores]
    finally:
        stores.clear()


def _entry(rank: int, fn: Any, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank a client of the store the test process holds
    )
    torch.set_num_threads(1)
    fn(rank, world_size, *args)


def spawn(fn: Any, world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (raises if any rank fails), their
    environment that of torchrun's ranks, ``MASTER_PORT`` a port of ``held_ports`` (a rank that starts more
    process groups takes further ports of ``held_ports`` in ``args``, held around this call)."""
    import torch.multiprocessing as mp

    with held_ports(1) as (port,):
        mp.spawn(_entry, args=(fn, world_size, port, args), nprocs=world_size, join=True)


def write_json(path: Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
