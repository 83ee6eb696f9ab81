"""The load balancing of rollout prompts over replicas (``polyrl.run.replica_balance``), as pure functions: the cost
model (prompts, and an agentic run's examples of episodes), the split by count (i mod W) and by work (each replica's
estimated work proportional to its speed; every prompt exactly once, each share in prompt order, no replica left
empty while there are prompts enough, the same inputs giving the same split) and the speed tracker (first reply
sets, later ones by EMA, unmeasured and restarted replicas at the mean of the others)."""

from __future__ import annotations

import random

import pytest

from polyrl.infer.sampling_params import SamplingParams
from polyrl.run.replica_balance import (
    DEFAULT_MAX_TOKENS,
    PREFILL_WEIGHT,
    ReplicaSpeeds,
    episode_cost,
    prompt_cost,
    split_by_count,
    split_by_work,
)


def _work(costs, shares):
    return [sum(costs[i] for i in s) for s in shares]


def _exactly_once_in_order(shares, n):
    assert sorted(i for s in shares for i in s) == list(range(n))
    assert all(s == sorted(s) for s in shares)


def test_prompt_cost_counts_samples_tokens_and_prefill():
    assert prompt_cost(10, SamplingParams(n=8, max_tokens=512)) == 8 * 512 + PREFILL_WEIGHT * 10
    assert prompt_cost(0, SamplingParams(n=1, max_tokens=5)) == 5.0
    assert prompt_cost(4, SamplingParams(n=2, max_tokens=None)) == 2 * DEFAULT_MAX_TOKENS + PREFILL_WEIGHT * 4
    # more samples, more tokens or a longer prompt: more work
    assert prompt_cost(3, SamplingParams(n=4, max_tokens=5)) > prompt_cost(3, SamplingParams(n=2, max_tokens=5))
    assert prompt_cost(300, SamplingParams(n=2, max_tokens=5)) > prompt_cost(3, SamplingParams(n=2, max_tokens=5))


def test_episode_cost_is_the_most_policy_tokens_of_an_examples_episodes():
    assert episode_cost(3, 4, 64, 1024) == 3 * 4 * 64  # every turn at max_new_tokens fits the episode budget
    assert episode_cost(3, 4, 64, 200) == 3 * 200  # the episode budget binds first
    # an agentic call's examples cost the same: the split follows the speeds (equal: example i to replica i mod W)
    assert split_by_work([episode_cost(2, 3, 6, 256)] * 5, [1.0, 1.0]) == [[0, 2, 4], [1, 3]]


def test_split_by_count_is_i_mod_w():
    assert split_by_count(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert split_by_count(2, 3) == [[0], [1], []]


def test_equal_costs_and_speeds_split_like_i_mod_w():
    for n, w in ((6, 2), (7, 3), (2, 3), (0, 2)):
        assert split_by_work([1.0] * n, [1.0] * w) == split_by_count(n, w)


def test_work_is_proportional_to_speed():
    assert [len(s) for s in split_by_work([1.0] * 8, [3.0, 1.0])] == [6, 2]
    assert [len(s) for s in split_by_work([1.0] * 12, [1.0, 2.0, 3.0])] == [2, 4, 6]
    rng = random.Random(0)
    costs = [rng.choice([10.0, 40.0, 160.0]) * rng.randint(1, 8) for _ in range(256)]
    speeds = [1.0, 2.5, 0.5, 4.0]
    shares = split_by_work(costs, speeds)
    _exactly_once_in_order(shares, len(costs))
    work, total = _work(costs, shares), sum(costs)
    for got, s in zip(work, speeds):
        assert abs(got / total - s / sum(speeds)) < 0.01, (work, speeds)
    # the finish times (work / speed) agree within the costliest prompt's time on the slowest replica
    finish = [wk / s for wk, s in zip(work, speeds)]
    assert max(finish) - min(finish) <= max(costs) / min(speeds)


def test_costly_prompts_are_spread_and_a_slow_replica_gets_the_short_ones():
    # two long prompts and four short ones: each replica gets one long one, the shorts go where the load is less
    costs = [100.0, 1.0, 1.0, 100.0, 1.0, 1.0]
    shares = split_by_work(costs, [1.0, 1.0])
    assert shares == [[0, 1, 4], [2, 3, 5]] and _work(costs, shares) == [102.0, 102.0]
    # a replica 10x slower: a long prompt on it would take 100 s, both on the fast one 20 s; the shorts fill the
    # slow one up to 4 s, less than the fast one's 20 s
    shares = split_by_work(costs, [10.0, 1.0])
    assert shares == [[0, 3], [1, 2, 4, 5]]


def test_no_replica_is_left_without_a_prompt_while_there_are_enough():
    # 1000x slower: the greedy split gives it nothing; it takes one prompt back, the cheapest (the last of equals),
    # from the replica that would finish last
    assert split_by_work([1.0] * 4, [1000.0, 1.0]) == [[0, 1, 2], [3]]
    assert split_by_work([5.0, 1.0, 1.0, 5.0], [1000.0, 1.0]) == [[0, 1, 3], [2]]
    assert split_by_work([1.0] * 5, [1000.0, 1000.0, 1.0]) == [[0, 2], [1, 3], [4]]
    # fewer prompts than replicas: some stay empty
    assert split_by_work([1.0, 1.0], [1.0, 1.0, 1.0]) == [[0], [1], []]
    assert split_by_work([1.0], [1.0, 1000.0]) == [[], [0]]


def test_the_split_is_deterministic_and_checks_its_speeds():
    rng = random.Random(1)
    costs = [float(rng.randint(1, 50)) for _ in range(40)]
    assert split_by_work(costs, [1.3, 0.7, 2.0]) == split_by_work(list(costs), [1.3, 0.7, 2.0])
    with pytest.raises(ValueError, match="speeds must be > 0"):
        split_by_work(costs, [1.0, 0.0])
    with pytest.raises(ValueError, match="at least one replica"):
        split_by_work(costs, [])


def test_replica_speeds_ema_and_reset():
    sp = ReplicaSpeeds(3)
    assert sp.effective([0, 1, 2]) == [1.0, 1.0, 1.0]  # none measured: equal
    sp.observe(0, 100.0, 2.0)  # 50 units/s: the first reply sets it
    assert sp.measured == [50.0, None, None]
    assert sp.effective([0, 1, 2]) == [50.0, 50.0, 50.0]  # the unmeasured at the mean of the measured
    sp.observe(0, 100.0, 1.0)  # 100 units/s: EMA with weight 0.5
    assert sp.measured[0] == 75.0
    sp.observe(1, 30.0, 1.0)
    assert sp.effective([0, 1, 2]) == [75.0, 30.0, 52.5]
    assert sp.effective([1, 2]) == [30.0, 30.0]  # the mean over the replicas asked for (the live ones)
    sp.observe(2, 0.0, 1.0)  # no work (an empty share): no measurement
    assert sp.measured[2] is None
    sp.reset(0)  # restarted: forgotten, the others' mean until it replies
    assert sp.effective([0, 1]) == [30.0, 30.0]
