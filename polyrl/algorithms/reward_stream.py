"""Rewards scored while the rollout still generates: ``RewardStream(scorer)`` over a reward pool (or any scorer).

- ``submit(i, completion, example)``: hand completion ``i`` to the scoring thread now (cheap: an enqueue, so the
  rollout engine's ``on_finish`` can call it between decode steps). One submitting thread at a time.
- ``finish(completions, examples) -> RewardResult``: after generation. Submits every completion not streamed (a
  rollout path that returns whole batches: rollout worker processes, other ranks' samples), waits for the rest and
  returns the result of ``scorer.score(completions, examples)``. ``close()`` abandons a stream (generation failed).
- Timings of the last ``finish``: ``scoring_s`` (wall time from the first completion handed over to the last reward
  in: it overlaps the generation), ``wait_s`` (from ``finish`` to the last reward: what the step waited for rewards
  after generation) and ``overlap_frac = 1 - wait_s / scoring_s`` (0: nothing overlapped).

How: a scorer with ``score_jobs`` / ``assemble`` (``RewardPool``) takes the jobs one by one in its dispatch loop, each
to the next free worker (or called in the thread, ``workers = 0``; async reward functions included), and assembles
the result in input order: the very ``RewardResult`` batch scoring gives. Any other scorer (``RewardSources`` with a
judge or a reward model, a user object with ``score``) is called on chunks, whatever finished since its last call;
rewards, failures and the failed set equal batch scoring's, while the first failure messages and the per-key extras
follow chunk order (a ``reward/<key>`` mean may differ in its last bits). A scorer whose ``streams`` is False
(``RewardSources`` with a reward model: its forwards would share the rollout's device) is called once, at ``finish``.

Not here: the reward functions and their workers (``rewards``), where the completions come from (``polyrl.run``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from polyrl.algorithms.rewards import RewardResult
from polyrl.algorithms.workers import JobInbox


class RewardStream:
    """Completions scored as they are submitted (see the module docstring)."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer
        self.inbox = JobInbox()
        self.scoring_s = self.wait_s = 0.0
        self._texts: dict[int, str] = {}
        self._t_first: float | None = None
        self._t_done = 0.0
        self._outcomes: dict[int, Any] = {}
        self._chunks: list[tuple[list[int], RewardResult]] = []
        self._error: BaseException | None = None
        # a scorer that must not run during generation (``streams`` False: a reward model on the rollout's device)
        # gets everything at ``finish``, in one chunk
        self.live = bool(getattr(scorer, "streams", True))
        self._thread = threading.Thread(target=self._run, name="polyrl-rewards", daemon=True)
        if self.live:
            self._thread.start()

    # ---- the submitting side ------------------------------------------------------------------------------
    def submit(self, i: int, completion: str, example: Mapping[str, Any]) -> None:
        """Score completion ``i`` (its ``example``) as soon as a worker is free."""
        if self._t_first is None and self.live:
            self._t_first = time.perf_counter()
        self._texts[i] = completion
        self.inbox.put((i, completion, example))

    def finish(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> RewardResult:
        """The rewards of all ``completions`` (``examples[i]`` belongs to ``completions[i]``), in input order."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        t0 = time.perf_counter()
        n = len(completions)
        bad = [i for i, text in self._texts.items() if i >= n or text != completions[i]]
        if bad:  # a caller's index mapping is wrong: scoring the wrong texts would train on wrong rewards
            self.close()
            raise RuntimeError(f"streamed completion(s) {bad[:5]} differ from the final batch's")
        for i in range(n):
            if i not in self._texts:
                self.submit(i, completions[i], examples[i])
        if not self.live:
            self._thread.start()
        self.close()
        if self._error is not None:
            raise self._error
        self.wait_s = max(0.0, self._t_done - t0)
        self.scoring_s = max(self.wait_s, self._t_done - (self._t_first if self._t_first is not None else t0))
        if hasattr(self.scorer, "assemble"):
            return self.scorer.assemble([self._outcomes.get(i) for i in range(n)])
        return _merge(n, self._chunks, float(getattr(self.scorer, "failure_reward", 0.0)))

    @property
    def overlap_frac(self) -> float:
        return 1.0 - self.wait_s / self.scoring_s if self.scoring_s > 0 else 0.0

    def close(self) -> None:
        """No more completions: let the thread end once what was submitted is scored, and wait for it."""
        if not self.inbox.closed:
            self.inbox.close()
        if self._thread.ident is not None:  # started (a stream that is not live starts at finish)
            self._thread.join()
        self.inbox.release()

    # ---- the scoring thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if hasattr(self.scorer, "score_jobs"):
                self._outcomes = self.scorer.score_jobs(self.inbox)
            else:
                self._score_chunks()
        except BaseException as exc:  # noqa: BLE001 - raised again by finish, in the caller's thread
            self._error = exc
        finally:
            self._t_done = time.perf_counter()

    def _score_chunks(self) -> None:
        while True:
            jobs, closed = self.inbox.take()
            if jobs:
                part = self.scorer.score([j[1] for j in jobs], [j[2] for j in jobs])
                self._chunks.append(([j[0] for j in jobs], part))
            if closed:
                return
            if not jobs:
                self.inbox.wait()


def _merge(n: int, chunks: list[tuple[list[int], RewardResult]], failure_reward: float) -> RewardResult:
    """One ``RewardResult`` of ``n`` completions from the chunks' results (each with its completions' indices)."""
    out = RewardResult([failure_reward] * n)
    for idx, part in chunks:
        for k, i in enumerate(idx):
            out.rewards[i] = part.rewards[k]
        for kind, count in part.failures.items():
            out.failures[kind] = out.failures.get(kind, 0) + count
        out.messages += part.messages[: 5 - len(out.messages)]
        for key, values in part.extras.items():
            out.extras.setdefault(key, []).extend(values)
        out.failed |= {idx[k] for k in part.failed}
    return out


__all__ = ["RewardStream"]
