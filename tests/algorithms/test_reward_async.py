"""Issue 29 (5, part): ``async def`` reward functions run to completion in their worker (or in-process with
``workers=0``); an exception raised after an ``await`` is a counted ``error`` like any other."""

from __future__ import annotations

import pytest

from polyrl.algorithms import rewards as R

ASYNC_REWARDS = """
import asyncio

async def length(completion, example):
    await asyncio.sleep(0.01)
    return {"reward": len(completion) / 10, "awaited": 1.0}

async def broken(completion, example):
    await asyncio.sleep(0)
    raise RuntimeError("judge said no")
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_async_reward_functions(tmp_path, workers):
    f = tmp_path / "async_rewards.py"
    f.write_text(ASYNC_REWARDS)
    with R.RewardPool(f"{f}:length", workers=workers, timeout=30) as pool:
        res = pool.score(["abc", "abcdefghij"], [{}, {}])
    assert res.rewards == pytest.approx([0.3, 1.0]) and res.metrics()["reward/awaited"] == 1.0
    with R.RewardPool(f"{f}:broken", workers=workers, timeout=30, failure_reward=-1.0) as pool:
        res = pool.score(["x"], [{}])
    assert res.rewards == [-1.0] and res.failures["error"] == 1
    assert res.messages == ["error: RuntimeError: judge said no (async_rewards.py:10 in broken)"]
