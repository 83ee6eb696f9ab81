"""A Gymnasium text environment: `polyrl train ... --env gymnasium:examples/gym_envs.py:SayTheNumber` (README).

The data row's answer is the number to say; the policy gets `tries` replies, reward 1 for the right number and
-0.1 for each miss. `info["solved"]` is logged as `episode/solved`.
"""

import re
import string

import gymnasium as gym
from gymnasium import spaces


class SayTheNumber(gym.Env):
    metadata = {"render_modes": []}
    system_prompt = "Answer with a number."  # sent before the opening observation

    def __init__(self, tries: int = 2):
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=10_000, charset=string.printable)
        self.tries = tries

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        answer = (options or {}).get("answer")  # options is the data row
        self.target = int(float(answer)) if answer is not None else int(self.np_random.integers(0, 10))
        self.left = self.tries
        return f"Say the number {self.target}.", {}

    def step(self, action: str):
        numbers = re.findall(r"-?\d+", action)
        self.left -= 1
        if numbers and int(numbers[-1]) == self.target:
            return "Right.", 1.0, True, False, {"solved": 1.0}
        return f"No. The number is {self.target}.", -0.1, self.left == 0, False, {"solved": 0.0}
