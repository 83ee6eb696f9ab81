"""Reward registry and worker pool: builtins, user files, and failures (raise, hang, non-number, crash) that are
counted and replaced without stopping the caller."""

from __future__ import annotations

import time

import pytest

from polyrl.algorithms import rewards as R
from polyrl.errors import ConfigError

USER_FILE = """
import math, os, time

def length(completion, example):
    return len(completion)

def scored(completion, example):
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "hang":
        time.sleep(60)
    if completion == "string":
        return "high"
    if completion == "nan":
        return math.nan
    if completion == "none":
        return None
    if completion == "exit":
        os._exit(3)
    if completion == "dict":
        return {"reward": 0.5, "bonus": 2}
    return 1.0 if completion == example["answer"] else 0.0
"""


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_builtins_hand_values():
    ex = {"prompt": "What is 2 + 3?", "answer": "5", "task": "arithmetic"}
    assert R.resolve("exact_match")("5", ex) == 1.0
    assert R.resolve("exact_match")("6", ex) == 0.0
    assert R.resolve("numeric")("so the answer is \\boxed{5}", ex) == 1.0
    assert R.resolve("boxed")("5", ex) == 0.0
    assert R.resolve("boxed")("x \\boxed{5.0}", ex) == 1.0
    assert R.resolve("think_format")("<think>hm</think> <answer>5</answer>", ex) == 1.0
    assert R.resolve("think_format")("<answer>5</answer>", ex) == 0.0
    assert R.resolve("length_penalty")("x" * 250, ex) == pytest.approx(-0.25)
    combo = R.resolve("exact_match+0.5*think_format+0.1*length_penalty")
    # the sum and each term's value before its weight (logged as reward/<name>)
    assert combo("<think>a</think><answer>5</answer>", ex) == pytest.approx(
        {"reward": 1.0 + 0.5 - 0.1 * 0.034, "exact_match": 1.0, "think_format": 1.0, "length_penalty": -0.034}
    )


def test_resolve_errors_name_the_fix(user_file, tmp_path):
    with pytest.raises(ConfigError, match="unknown reward"):
        R.resolve("no_such_reward")
    with pytest.raises(ConfigError, match="does not exist"):
        R.resolve(str(tmp_path / "missing.py") + ":fn")
    with pytest.raises(ConfigError, match="no function 'nope'"):
        R.resolve(f"{user_file}:nope")
    assert R.resolve(f"{user_file}:length")("abc", {}) == 3


def test_in_process_scoring_counts_failures(user_file):
    pool = R.RewardPool(f"{user_file}:scored", workers=0, failure_reward=-1.0)
    res = pool.score(["ok", "raise", "string", "nan", "dict", "none"], [{"answer": "ok"}] * 6)
    assert res.rewards == [1.0, -1.0, -1.0, -1.0, 0.5, -1.0]
    assert res.failures == {"error": 1, "timeout": 0, "non_number": 3, "crash": 0}
    assert res.metrics()["reward/bonus"] == 2.0


def test_worker_pool_survives_raise_hang_non_number_and_crash(user_file):
    completions = ["ok", "raise", "hang", "string", "nan", "exit", "dict", "no", "ok"]
    examples = [{"answer": "ok", "metadata": {}}] * len(completions)
    t0 = time.monotonic()
    with R.RewardPool(f"{user_file}:scored", workers=2, timeout=1.0, failure_reward=-0.5) as pool:
        res = pool.score(completions, examples)
        assert res.rewards == [1.0, -0.5, -0.5, -0.5, -0.5, -0.5, 0.5, 0.0, 1.0]
        assert res.failures == {"error": 1, "timeout": 1, "non_number": 2, "crash": 1}
        assert pool.replaced == 2  # the hung worker was killed, the exited one restarted
        # the pool keeps working afterwards, with replaced workers
        again = pool.score(["ok", "no"], [{"answer": "ok"}] * 2)
        assert again.rewards == [1.0, 0.0] and again.num_failures == 0
        assert pool.totals["timeout"] == 1 and pool.totals["crash"] == 1
    assert time.monotonic() - t0 < 45  # the 60 s hang was cut at the 1 s timeout


def test_example_view_of_prompt_example():
    from polyrl.data import PromptExample

    ex = PromptExample([{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}], "4", "arithmetic")
    view = R.example_view(ex)
    assert view["prompt"] == "q?" and view["answer"] == "4" and view["task"] == "arithmetic"
    assert R.exact_match("4", view) == 1.0
