"""Issue 29 (4): Gymnasium text environments load into ``--env gymnasium:...`` (``polyrl.agents.adapters``): the
mapping of reset/step/observations/rewards/termination, a registered id (``module:Id-v0``, with gymnasium's
``TimeLimit``), clear errors, and GRPO training steps from the CLI on an environment written for Gymnasium only."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

gym = pytest.importorskip("gymnasium", reason='the envs extra: pip install -e ".[envs]"')

from polyrl.agents.env import resolve_env  # noqa: E402
from polyrl.agents.pool import normalise_step  # noqa: E402
from polyrl.cli.main import main  # noqa: E402
from polyrl.errors import ConfigError  # noqa: E402

# A Gymnasium environment that knows nothing of polyrl: say the number; two tries; hint after a miss.
ENV_SOURCE = textwrap.dedent("""
    import re
    import string

    import gymnasium as gym
    from gymnasium import spaces


    class SayTheNumber(gym.Env):
        metadata = {"render_modes": []}
        system_prompt = "Answer with a number."

        def __init__(self, tries=2):
            self.observation_space = spaces.Text(max_length=200, charset=string.printable)
            self.action_space = spaces.Text(max_length=10_000, charset=string.printable)
            self.tries = tries

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            answer = (options or {}).get("answer")
            self.target = int(float(answer)) if answer is not None else int(self.np_random.integers(0, 10))
            self.left = self.tries
            return f"Say the number {self.target}.", {}

        def step(self, action):
            found = re.findall(r"-?\\d+", action)
            self.left -= 1
            if found and int(found[-1]) == self.target:
                return "Right.", 1.0, True, False, {"solved": 1.0, "note": "text is dropped"}
            return f"No. The number is {self.target}.", -0.1, self.left == 0, False, {"solved": 0.0}


    if "PolyrlSayTheNumber-v0" not in gym.registry:
        gym.register("PolyrlSayTheNumber-v0", entry_point=SayTheNumber, max_episode_steps=1)
""")


@pytest.fixture()
def env_file(tmp_path, monkeypatch):
    path = tmp_path / "say_number_env.py"
    path.write_text(ENV_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("say_number_env", None)


def test_an_episode_maps_onto_gymnasium(env_file):
    cls = resolve_env(f"gymnasium:{env_file}:SayTheNumber")
    env = cls()
    example = {"prompt": "What is 3 + 4?", "answer": "7", "metadata": {}}
    assert env.reset(example) == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Say the number 7."},
    ]
    miss = normalise_step(env.step({"role": "assistant", "content": "It is 6"}))
    assert (miss.messages, miss.reward, miss.done) == (
        [{"role": "user", "content": "No. The number is 7."}],
        -0.1,
        False,
    )
    assert miss.metrics == {"solved": 0.0}
    hit = normalise_step(env.step({"role": "assistant", "content": "7"}))
    assert (hit.messages, hit.reward, hit.done, hit.metrics) == ([], 1.0, True, {"solved": 1.0})


def test_registered_id_goes_through_gymnasium_make(env_file):
    cls = resolve_env("gymnasium:say_number_env:PolyrlSayTheNumber-v0")
    env = cls()
    # no answer in the row: the environment draws the number from the seed, a hash of the prompt
    first = env.reset({"prompt": "same prompt", "answer": None})
    again = cls().reset({"prompt": "same prompt", "answer": None})
    assert first == again and first[-1]["content"].startswith("Say the number ")
    step = normalise_step(env.step({"role": "assistant", "content": "none"}))
    assert step.done and step.reward == -0.1  # gymnasium's TimeLimit (max_episode_steps=1) truncated it


def test_bad_gymnasium_targets_are_config_errors(env_file, tmp_path):
    with pytest.raises(ConfigError, match="gymnasium:NoSuchEnv-v0: .*NoSuchEnv"):
        resolve_env("gymnasium:NoSuchEnv-v0")
    plain = tmp_path / "plain.py"
    plain.write_text("class NotAnEnv:\n    pass\n")
    with pytest.raises(ConfigError, match="'NotAnEnv' is not a gymnasium.Env subclass"):
        resolve_env(f"gymnasium:{plain}:NotAnEnv")


def test_grpo_trains_on_a_gymnasium_environment(env_file, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", "builtin:arithmetic?max=9&n=16"]
    argv += ["--out", str(out), "--env", f"gymnasium:{env_file}:SayTheNumber", "--env-workers", "1"]
    argv += ["--max-turns", "2", "--max-new-tokens", "4", "--max-episode-tokens", "200", "--n", "3"]
    argv += ["--prompts-per-step", "2", "--max-steps", "2", "--report-to", "none", "--log-every", "100"]
    assert main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["env_failures"] == 0 and 1.0 <= r["episode/turns"] <= 2.0
        # each episode's reward is Gymnasium's sum: -0.1 per miss, 1.0 for a hit
        assert -0.2 - 1e-6 <= r["reward"] <= 1.0 and "episode/solved" in r


def test_the_readme_example_environment_plays_an_episode():
    """``examples/gym_envs.py``, the file the README's ``--env gymnasium:examples/gym_envs.py:SayTheNumber`` names."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "gym_envs.py"
    env = resolve_env(f"gymnasium:{path}:SayTheNumber")()
    assert env.reset({"prompt": "What is 2 + 3?", "answer": "5", "metadata": {}}) == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Say the number 5."},
    ]
    miss = normalise_step(env.step({"role": "assistant", "content": "4"}))
    assert (miss.reward, miss.done, miss.metrics) == (-0.1, False, {"solved": 0.0})
    hit = normalise_step(env.step({"role": "assistant", "content": "It is 5"}))
    assert (hit.reward, hit.done, hit.metrics) == (1.0, True, {"solved": 1.0})
