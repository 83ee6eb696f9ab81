"""Step inputs: the flat tensors one forward needs, built from the scheduler's output on the host.

For a mixed batch (prefill chunks and decodes) it builds ``input_ids``/``positions``/``slot_mapping``
``[T]``, ``cu_seqlens`` ``[B+1]``, ``context_lens`` ``[B]``, ``block_tables`` ``[B, M]`` and the row of the last
token of each sequence that samples. Everything is packed into ONE pinned int64 host buffer and copied
to the device with one non-blocking transfer, then viewed (and cast to int32 where the contract says
so) on the device: per-step host work is a few list operations per sequence.

It neither runs the model nor decides what to schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from polyrl.infer.scheduler import ScheduledSeq


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [B+1]
    context_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, M]
    sample_rows: torch.Tensor  # int64 [S] rows of T whose hidden state gives logits
    max_seqlen: int
    num_tokens: int
    num_seqs: int


def host_arrays(items: list[ScheduledSeq], block_size: int) -> dict[str, np.ndarray]:
    """The step's index arrays as numpy int64 on the host (also used to fill CUDA-graph buffers)."""
    if items and all(it.num_new == 1 and it.sample for it in items):
        return _decode_arrays(items, block_size)
    return _general_arrays(items, block_size)


def _general_arrays(items: list[ScheduledSeq], block_size: int) -> dict[str, np.ndarray]:
    """``host_arrays`` of any step (prefill chunks and decodes mixed). Vectorised over the step's tokens: a whole
    batch's prefill (256 prompts of ~100 tokens) takes one pass per array, not one numpy call per sequence."""
    b = len(items)
    lens = np.fromiter((it.num_new for it in items), dtype=np.int64, count=b)
    starts = np.fromiter((it.start for it in items), dtype=np.int64, count=b)
    cu = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    t = int(cu[-1])
    input_ids = np.fromiter(
        chain.from_iterable(it.seq.tokens[it.start : it.start + it.num_new] for it in items), dtype=np.int64, count=t
    )
    row = np.repeat(np.arange(b, dtype=np.int64), lens)  # each token's sequence
    positions = np.arange(t, dtype=np.int64) + np.repeat(starts - cu[:-1], lens)
    width = max(len(it.seq.block_table) for it in items)
    tables = np.zeros((b, width), dtype=np.int64)
    for i, it in enumerate(items):
        bt = it.seq.block_table
        tables[i, : len(bt)] = bt
    slots = tables[row, positions // block_size] * block_size + positions % block_size
    context = starts + lens
    sample_rows = np.fromiter((int(cu[i + 1]) - 1 for i, it in enumerate(items) if it.sample), dtype=np.int64)
    return {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slots,
        "cu_seqlens": cu,
        "context_lens": context,
        "block_tables": tables,
        "sample_rows": sample_rows,
        "max_seqlen": np.array([int(lens.max()) if b else 0]),
    }


def _decode_arrays(items: list[ScheduledSeq], block_size: int) -> dict[str, np.ndarray]:
    """``host_arrays`` of a decode-only step (one new token per sequence, every one samples), built from flat
    Python lists in one pass: the common step of a long rollout, so its host time matters."""
    b = len(items)
    ids, pos, slots, rows = [], [], [], []
    width = 0
    for it in items:
        s, bt = it.start, it.seq.block_table
        ids.append(it.seq.tokens[s])
        pos.append(s)
        slots.append(bt[s // block_size] * block_size + s % block_size)
        rows.append(bt)
        width = max(width, len(bt))
    tables = np.array([bt + [0] * (width - len(bt)) for bt in rows], dtype=np.int64).reshape(b, width)
    positions = np.array(pos, dtype=np.int64)
    steps = np.arange(b, dtype=np.int64)
    return {
        "input_ids": np.array(ids, dtype=np.int64),
        "positions": positions,
        "slot_mapping": np.array(slots, dtype=np.int64),
        "cu_seqlens": np.arange(b + 1, dtype=np.int64),
        "context_lens": positions + 1,
        "block_tables": tables,
        "sample_rows": steps,
        "max_seqlen": np.array([1]),
    }


_ORDER = ("input_ids", "positions", "slot_mapping", "cu_seqlens", "context_lens", "sample_rows", "block_tables")
_INT32 = ("cu_seqlens", "context_lens", "block_tables")


def to_device(arrays: dict[str, np.ndarray], dev: torch.device) -> StepInputs:
    flat = np.concatenate([arrays[k].reshape(-1) for k in _ORDER])
    host = torch.from_numpy(flat)
    if dev.type != "cpu":
        host = host.pin_memory()
    buf = host.to(dev, non_blocking=True)
    out: dict[str, torch.Tensor] = {}
    off = 0
    for k in _ORDER:
        a = arrays[k]
        view = buf[off : off + a.size].view(a.shape)
        out[k] = view.to(torch.int32) if k in _INT32 else view
        off += a.size
    return StepInputs(
        **out,
        max_seqlen=int(arrays["max_seqlen"][0]),
        num_tokens=int(arrays["input_ids"].size),
        num_seqs=int(arrays["context_lens"].size),
    )
