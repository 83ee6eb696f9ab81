"""``polyrl train --help`` says what the config accepts: --partial-rollouts takes the thread and the process producer,
for plain rollouts and for agentic runs of either kind (--env, --agent), and the help says so (it used to name only
--env with the thread producer, though environment episodes and agent programs in rollout worker processes take it
too)."""

from __future__ import annotations

import json

import pytest

import polyrl.agents  # noqa: F401 - registers the [agent] table into run, as the CLI does
from polyrl.cli import main as cli
from polyrl.cli import train
from polyrl.run import config as rc


def _help(flag: str) -> str:
    parser = cli.Parser(prog="polyrl train")
    train.add_arguments(parser)
    return " ".join(parser._option_string_actions[flag].help.split())


@pytest.mark.parametrize("producer", ["thread", "process"])
@pytest.mark.parametrize(
    "agentic", [{}, {"env": "guessing"}, {"agent": "my_agent.py:run"}], ids=["plain", "env", "agent"]
)
def test_partial_rollouts_help_names_what_the_config_accepts(producer, agentic, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    grpo = {"max_staleness": 1, "async_producer": producer, "partial_rollouts": True}
    raw = {"algo": "grpo", "model": str(tmp_path), "out": str(tmp_path / "out"), "data": {"path": "builtin:arithmetic"}}
    cfg = rc.build({**raw, "grpo": grpo, **({"agent": agentic} if agentic else {})})
    assert cfg.algo_config.partial_rollouts

    text = _help("--partial-rollouts")
    assert "--async-producer thread or process" in text
    for flag in agentic:  # the help names each agentic kind that takes it
        assert f"--{flag}" in text, text


def test_eval_data_help_says_what_rl_runs_do_with_it():
    """RL runs take --eval-data as their eval prompts (polyrl.run.online), not as data for an eval loss; without it
    the held-out part is data.holdout or a builtin set's test split, else the run is refused."""
    text = _help("--eval-data")
    assert "RL runs its prompts" in text and "eval loss" in text
    assert "data.holdout" in text and "test split" in text
