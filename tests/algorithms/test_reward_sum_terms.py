"""Reward sums: the spec parser (``reward_sources.parse_spec`` / ``check_spec``) and the scoring of sums that mix
builtins, functions of the user's files and the reward model (``open_rewards``)."""

from __future__ import annotations

import pytest

from polyrl.algorithms.reward_sources import RewardConfig, open_rewards
from polyrl.algorithms.reward_sources.model import load_reward_model, save_reward_model
from polyrl.models.checkpoint import load_tokenizer

EX = {"prompt": "2+2?", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "metadata": {}}


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sum_rm") / "rm"
    save_reward_model(load_reward_model(tiny_model_dir, seed=3), folder, load_tokenizer(tiny_model_dir))
    return folder


def test_a_function_summed_with_the_reward_model(reward_model_dir):
    # the function term's pool was once checked alone against [reward], whose model it does not name: refused
    cfg = RewardConfig(model=str(reward_model_dir))
    with open_rewards("model", cfg, workers=0, device="cpu") as alone:
        model_only = alone.score(["4", "5"], [EX, EX]).rewards
    with open_rewards("exact_match+0.5*model", cfg, workers=0, device="cpu") as scorer:
        res = scorer.score(["4", "5"], [EX, EX])
    assert res.num_failures == 0
    assert res.rewards == pytest.approx([1.0 + 0.5 * model_only[0], 0.5 * model_only[1]])
