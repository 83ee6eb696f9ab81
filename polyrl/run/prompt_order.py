"""The order an RL run takes its prompts in and the seeds it samples them with: both pure functions of the run's seed
and its position, so a resumed run draws exactly what the uninterrupted one would have.

- ``PromptStream(n, seed)``: prompt indices in a seeded shuffled order, epoch after epoch; ``state_dict`` is the
  exact data position (saved in checkpoints).
- ``rollout_seed(seed, step, prompt)``: the sampling seed of one prompt of one step.

Not here: the run loop (``online``), sampling itself (``polyrl.infer``).
"""

from __future__ import annotations

import random


class PromptStream:
    """Prompt indices in a seeded shuffled order, epoch after epoch; ``state_dict`` is the exact data position."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(f"polyrl-prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position >= self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    @property
    def epochs(self) -> float:
        return self.epoch + self.position / self.n

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def rollout_seed(seed: int, step: int, prompt: int) -> int:
    """The sampling seed of prompt ``prompt`` of RL step ``step`` (0-based): a pure function, for exact resume."""
    return ((seed * 1_000_003 + step) * 65_537 + prompt) % (2**62)
