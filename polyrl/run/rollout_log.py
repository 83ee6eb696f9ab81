"""``rollouts.jsonl``: a bounded, seeded sample of each online RL step's rollouts, for ``polyrl view``.

One JSON object per saved sample (``ROLLOUT_FIELDS`` lists them), at most ``OnlineConfig.rollouts_to_save`` per
step (0 = no file), chosen by ``chosen(seed, step, n, k)``: a pure function of the run seed and the step, so a
resumed run picks the same samples. Rank 0 writes; other ranks hold no log.

Per-token arrays are aligned with ``tokens`` (the decoded completion ids, one string each): ``logprobs`` are the
rollout engine's, ``trainer_logprobs`` the trainer's no-grad pass before the update (``null`` when that pass did not
run: ``single_pass`` runs measure mismatch inside the training forward and keep no per-sample values, and a sample
left out of the update, e.g. a group with zero advantage, is never measured). In an agentic episode the
``tokens`` are every id after the opening prompt; ``mask`` marks the policy's own tokens and the log-prob arrays
hold ``null`` on the rest (observations, template).

Resume: opening the log at step ``s`` drops rows of steps after ``s`` (written by the interrupted run, which the
resumed run writes again), as ``MetricsLogger`` does with ``metrics.jsonl``. A torn last line is skipped. The viewer
also keeps only the last row per ``(step, sample)``.

Not here: choosing what to train on, rendering (``viewer``).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FILE = "rollouts.jsonl"

ROLLOUT_FIELDS = {
    "step": "RL step, 1-based (as in metrics.jsonl)",
    "sample": "index of the sample among the step's samples",
    "group": "prompt index within the step",
    "kind": '"completion" or "episode"',
    "prompt": "the prompt text as the model saw it (chat template included)",
    "completion": "the completion text (an episode: everything after the opening prompt)",
    "reward": "the sample's reward",
    "advantage": "its advantage (null when not trained on or not per-sample)",
    "finish_reason": '"stop" | "length" (an episode: its status)',
    "tokens": "decoded completion tokens, one string per id",
    "logprobs": "rollout log-prob per token (null on non-policy tokens)",
    "trainer_logprobs": "trainer log-prob per token before the update, or null when not measured",
    "mask": "episodes: 1 on policy tokens, 0 on observations/template",
    "messages": "episodes: the OpenAI messages (assistant turns, tool_calls, tool observations)",
    "status": "episodes: done | max_turns | max_tokens | env_error",
    "error": "episodes: the environment's error, if any",
    "metrics": "episodes: per-episode counters (turns, tool_calls, ...)",
}


def chosen(seed: int, step: int, n: int, k: int) -> list[int]:
    """The sample indices of RL step ``step`` (0-based) to save: ``min(k, n)`` of ``range(n)``, seeded, sorted."""
    if k <= 0 or n <= 0:
        return []
    return sorted(random.Random(f"polyrl-rollouts:{seed}:{step}").sample(range(n), min(k, n)))


def token_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """One display string per id (a multi-byte character split over ids shows as replacement characters)."""
    return list(tokenizer.batch_decode([[int(t)] for t in ids])) if ids else []


def _number(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return round(x, 5) if math.isfinite(x) else None


def numbers(xs: Sequence[Any] | None) -> list[float | None] | None:
    """A per-token list as JSON numbers (5 decimals; NaN/inf -> null); ``None`` stays ``None``."""
    if xs is None:
        return None
    if hasattr(xs, "tolist"):
        xs = xs.tolist()
    return [_number(x) for x in xs]


def spread(values: Sequence[Any] | None, mask: Sequence[int] | None, length: int) -> list[Any] | None:
    """Per-policy-token ``values`` placed on the ``mask`` positions of a ``length``-token row (``None`` elsewhere);
    without a mask, ``values`` as they are."""
    if values is None:
        return None
    vals = numbers(values)
    if mask is None:
        return vals
    out: list[Any] = [None] * length
    it = iter(vals)
    for i, m in enumerate(mask):
        if m:
            out[i] = next(it, None)
    return out


class RolloutLog:
    """Appends rows to ``run_dir/rollouts.jsonl``; resuming after ``start_step`` drops later rows first."""

    def __init__(self, run_dir: str | Path, start_step: int = 0) -> None:
        self.path = Path(run_dir) / FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [r for r in read_rows(self.path) if int(r.get("step", 0)) <= start_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _whole(value: Any) -> bool:
    """An int (or a float holding one): a row's step or sample index; anything else marks a damaged row."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``rollouts.jsonl`` (torn lines and rows without a whole-number step / sample skipped), the last
    per ``(step, sample)``, in step order."""
    path = Path(path)
    if not path.exists():
        return []
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and _whole(row.get("step")) and _whole(row.get("sample", 0)):
            last[(int(row["step"]), int(row.get("sample", 0)))] = row
    return [last[k] for k in sorted(last)]


__all__ = ["FILE", "ROLLOUT_FIELDS", "RolloutLog", "chosen", "numbers", "read_rows", "spread", "token_strings"]
