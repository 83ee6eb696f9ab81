"""The decode-only fast path of ``host_arrays`` builds exactly the arrays of the general path."""

from __future__ import annotations

import random

import numpy as np

from polyrl.infer.batch import _decode_arrays, _general_arrays, host_arrays
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.scheduler import ScheduledSeq
from polyrl.infer.sequence import Sequence


def _decode_items(count: int, block_size: int, seed: int = 0) -> list[ScheduledSeq]:
    rng = random.Random(seed)
    items = []
    for i in range(count):
        n = rng.randint(1, 90)
        seq = Sequence(i, f"r{i}", 0, [rng.randint(0, 100) for _ in range(n)], SamplingParams())
        seq.block_table = rng.sample(range(500), -(-n // block_size))
        items.append(ScheduledSeq(seq, n - 1, 1, True))
    return items


def test_decode_fast_path_equals_the_general_path():
    items = _decode_items(37, 16)
    fast, general = _decode_arrays(items, 16), _general_arrays(items, 16)
    assert fast.keys() == general.keys()
    for key in fast:
        np.testing.assert_array_equal(fast[key], general[key], err_msg=key)
        assert fast[key].dtype == general[key].dtype, key
    assert host_arrays(items, 16)["block_tables"].shape == general["block_tables"].shape


def test_a_prefill_chunk_takes_the_general_path():
    items = _decode_items(3, 4, seed=1)
    seq = items[0].seq
    items[0] = ScheduledSeq(seq, 0, seq.num_tokens, True)  # a whole prompt in this step
    out = host_arrays(items, 4)
    assert out["input_ids"].size == seq.num_tokens + 2
    np.testing.assert_array_equal(out["input_ids"][: seq.num_tokens], seq.tokens)


def _reference_arrays(items: list[ScheduledSeq], block_size: int) -> dict[str, list]:
    """The step's arrays token by token, straight from the definitions in ``batch.py``'s docstring."""
    ids, pos, slots, cu, ctx, rows = [], [], [], [0], [], []
    for it in items:
        for p in range(it.start, it.start + it.num_new):
            ids.append(it.seq.tokens[p])
            pos.append(p)
            slots.append(it.seq.block_table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + it.num_new)
        ctx.append(it.start + it.num_new)
        if it.sample:
            rows.append(cu[-1] - 1)
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "cu_seqlens": cu, "context_lens": ctx,
            "sample_rows": rows}  # fmt: skip


def test_the_general_path_equals_a_token_by_token_build_on_mixed_steps():
    """Prompt chunks starting mid-prompt, whole prompts, decode rows and chunks that do not sample, in one step."""
    rng = random.Random(5)
    for block_size in (4, 16):
        items = []
        for i in range(41):
            n = rng.randint(1, 120)
            seq = Sequence(i, f"r{i}", 0, [rng.randint(0, 1000) for _ in range(n)], SamplingParams())
            seq.block_table = rng.sample(range(2000), -(-n // block_size))
            start = rng.choice([0, n - 1, rng.randint(0, n - 1)])
            num_new = rng.randint(1, n - start)
            items.append(ScheduledSeq(seq, start, num_new, start + num_new == n))
        got, want = _general_arrays(items, block_size), _reference_arrays(items, block_size)
        for key, values in want.items():
            np.testing.assert_array_equal(got[key], np.array(values, dtype=np.int64), err_msg=key)
            assert got[key].dtype == np.int64, key
        assert got["max_seqlen"][0] == max(it.num_new for it in items)
        for i, it in enumerate(items):
            assert list(got["block_tables"][i, : len(it.seq.block_table)]) == it.seq.block_table
            assert not got["block_tables"][i, len(it.seq.block_table) :].any()
