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
