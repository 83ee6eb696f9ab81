"""Issue 29 (rewards never stall the rollout): ``RewardStream`` scores completions as they are submitted, with the
very ``RewardResult`` batch scoring gives; the step then waits only for the last few rewards."""

from __future__ import annotations

import random
import time

import pytest

from polyrl.algorithms import rewards as R
from polyrl.algorithms.reward_stream import RewardStream

MIXED = """
import asyncio, time

def mixed(completion, example):
    k = int(completion.split()[-1])
    if k % 7 == 3:
        raise ValueError(f"bad sample {k}")
    if k % 7 == 5:
        return "not a number"
    return {"reward": k / 10 + example["answer"], "len": float(len(completion))}

async def slow_async(completion, example):
    await asyncio.sleep(0.05)
    return float(len(completion))

def slow(completion, example):
    time.sleep(0.05)
    return float(len(completion))
"""


def _texts(n: int) -> tuple[list[str], list[dict]]:
    return [f"sample {'x' * (k % 5)} {k}" for k in range(n)], [{"answer": k % 3} for k in range(n)]


def _same(a: R.RewardResult, b: R.RewardResult) -> None:
    assert a.rewards == b.rewards
    assert a.failures == b.failures and a.failed == b.failed and a.messages == b.messages
    assert a.extras == b.extras


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_result_equals_batch_scoring(tmp_path, workers):
    f = tmp_path / "r.py"
    f.write_text(MIXED)
    texts, views = _texts(23)
    with R.RewardPool(f"{f}:mixed", workers=workers, timeout=30, failure_reward=-1.0) as pool:
        batch = pool.score(texts, views)
        totals = dict(pool.totals)
        order = list(range(23))
        random.Random(0).shuffle(order)
        stream = RewardStream(pool)
        for i in order[:17]:  # finished out of order; the other 6 come with the batch (a path that cannot stream)
            stream.submit(i, texts[i], views[i])
        streamed = stream.finish(texts, views)
    _same(streamed, batch)
    assert batch.failures["error"] == 3 and batch.failures["non_number"] == 3 and len(batch.failed) == 6
    assert {k: 2 * v for k, v in totals.items()} == pool.totals  # failures counted once per scoring
    assert 0.0 < stream.wait_s <= stream.scoring_s


class _Chunked:
    """A scorer with ``score`` only (as ``RewardSources``): scored in chunks."""

    failure_reward = -2.0

    def __init__(self, pool: R.RewardPool) -> None:
        self.pool, self.calls = pool, []

    def score(self, texts, views):
        self.calls.append(len(texts))
        return self.pool.score(texts, views)


def test_chunked_scorer_same_rewards_and_failures(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(MIXED)
    texts, views = _texts(15)
    with R.RewardPool(f"{f}:mixed", workers=0, failure_reward=-2.0) as pool:
        batch = pool.score(texts, views)
        scorer = _Chunked(pool)
        stream = RewardStream(scorer)
        for i in range(10):
            stream.submit(i, texts[i], views[i])
            if i % 4 == 3:  # the thread takes a chunk while completions still come (60 s: bounds a hang only)
                deadline = time.monotonic() + 60
                while len(scorer.calls) < 1 + i // 4 and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert len(scorer.calls) >= 1 + i // 4, scorer.calls
        streamed = stream.finish(texts, views)
    assert streamed.rewards == batch.rewards and streamed.failed == batch.failed
    assert streamed.failures == batch.failures
    assert sorted(streamed.extras["len"]) == sorted(batch.extras["len"])
    assert sum(scorer.calls) == 15 and len(scorer.calls) >= 2


def test_wrong_index_mapping_is_refused(tmp_path):
    with R.RewardPool("exact_match", workers=0) as pool:
        stream = RewardStream(pool)
        stream.submit(0, "a text that is not the final one", {"answer": "1"})
        with pytest.raises(RuntimeError, match="differ from the final batch"):
            stream.finish(["1"], [{"answer": "1"}])


def test_scorer_error_is_raised_by_finish():
    class Broken:
        def score(self, texts, views):
            raise OSError("judge endpoint down")

    stream = RewardStream(Broken())
    stream.submit(0, "x", {})
    with pytest.raises(OSError, match="judge endpoint down"):
        stream.finish(["x"], [{}])


@pytest.mark.parametrize("fn", ["slow", "slow_async"])
def test_slow_rewards_overlap_generation(tmp_path, fn):
    """50 ms per completion, two workers, a completion finishing every 60 ms ("generation"): scoring keeps up, so
    after the last one the step waits for about one call, not for the 12 x 50 ms of scoring the batch."""
    f = tmp_path / "r.py"
    f.write_text(MIXED)
    texts, views = _texts(12)
    with R.RewardPool(f"{f}:{fn}", workers=2, timeout=30) as pool:
        pool.score(texts[:2], views[:2])  # the workers are up (their start is not what this measures)
        stream = RewardStream(pool)
        for i in range(12):
            time.sleep(0.06)
            stream.submit(i, texts[i], views[i])
        res = stream.finish(texts, views)
    assert res.rewards == [float(len(t)) for t in texts]
    assert stream.scoring_s >= 0.6  # the span of the generation at least
    assert stream.wait_s < 0.4 * stream.scoring_s, (stream.wait_s, stream.scoring_s)
    assert stream.overlap_frac > 0.6


def test_a_scorer_that_does_not_stream_is_called_once_at_finish(tmp_path):
    """``streams = False`` (a reward model on the rollout's device): nothing runs before ``finish``."""
    f = tmp_path / "r.py"
    f.write_text(MIXED)
    texts, views = _texts(6)
    with R.RewardPool(f"{f}:mixed", workers=0) as pool:
        scorer = _Chunked(pool)
        scorer.streams = False
        stream = RewardStream(scorer)
        for i in range(4):
            stream.submit(i, texts[i], views[i])
        time.sleep(0.05)
        assert scorer.calls == []
        res = stream.finish(texts, views)
        assert scorer.calls == [6] and res.rewards == pool.score(texts, views).rewards
    assert stream.overlap_frac == 0.0 and stream.wait_s == stream.scoring_s > 0


def test_reward_sources_with_a_reward_model_do_not_stream():
    from polyrl.algorithms.reward_sources import RewardSources, Term

    sources = RewardSources.__new__(RewardSources)  # the terms only: no model to load for this property
    sources.terms = [(Term("functions"), None), (Term("judge"), None)]
    assert sources.streams
    sources.terms.append((Term("model"), None))
    assert not sources.streams
