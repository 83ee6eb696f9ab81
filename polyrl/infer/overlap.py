"""One-step-ahead decoding: the engine queues decode step N+1 on the device before it reads step N's tokens.

A decode step's inputs depend on the previous step's *lengths* (positions, slots, block tables), which the host
knows ahead, and on its *token values* only through the input ids, which stay on the device: step N+1 gathers
them from step N's sampled-token tensor (``feed_input_ids``). So ``LLM.generate`` launches N+1, then reads N's
tokens (long computed by then) and does N's host work - appending, stop checks, outputs, the next schedule -
while N+1 runs. The device no longer waits for the host between steps.

Several steps per launch (``RolloutConfig.decode_steps`` = K): when every row's results only need appending and
stop checks, the launch queues K decode steps back to back, each step's inputs advanced on the device
(``model_runner.execute_steps``), so the host's per-step work (scheduling, inputs, sampler rows) is paid once per
K tokens. Tokens a sequence draws after its stop within those K are computed and dropped.

Bookkeeping: launched-but-unread tokens are placeholders (``PENDING``) at the end of ``seq.tokens``, counted by
``seq.pending``, with ``seq.pending_row`` the sequence's row in the launch in flight; the block manager keeps
them out of prefix-cache keys. A sequence found to have stopped was already scheduled into the next launch:
that row's results are dropped. Tokens are those a synchronous engine draws: the sampler keys its noise by
(seed, tokens generated so far), which counts the placeholders.

Not here: scheduling, sampling math, CUDA graphs (``model_runner`` applies the feed on either path).
"""

from __future__ import annotations

import torch

from polyrl.infer.sequence import Sequence, Status
from polyrl.platform import device

PENDING = -1  # placeholder token id of a pending sequence (never fed to the model: its row is fed on the device)


class InflightStep:
    """Launched decode steps (``K`` in a row, ``model_runner.execute_steps``): their sequences in row order and
    their tokens, on the device and on their way to pinned host memory."""

    def __init__(
        self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, masses: torch.Tensor | None = None
    ) -> None:
        self.seqs = seqs
        self.steps = tokens.shape[0]
        self.tokens = tokens[-1]  # int64 [B] on the device: the last step's draws, the next launch's input ids
        # structured outputs (one step per launch): [1, B] log(mass the grammar allowed) per row, read with the tokens
        self.masses: list[list[float]] | None = None
        if tokens.device.type == "cpu":
            self._host, self._event = (tokens, logprobs), None
            self._masses = masses
            return
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
        self._masses = None
        if masses is not None:
            self._masses = torch.empty(masses.shape, dtype=masses.dtype, pin_memory=True)
            self._masses.copy_(masses, non_blocking=True)
        self._host = (host_tokens, host_logprobs)
        self._event = device.event(enable_timing=False)
        if self._event is not None:
            self._event.record()

    def mark_pending(self) -> None:
        """Give every still-running sequence of this launch its placeholder tokens (one per step)."""
        finished, k = Status.FINISHED, self.steps
        placeholders = [PENDING] * k
        for row, s in enumerate(self.seqs):
            if s.status is not finished:
                s.tokens.extend(placeholders)
                s.pending, s.pending_row = k, row

    def read(self) -> tuple[list[list[int]], list[list[float]]]:
        """(tokens, logprobs) as ``[K][B]`` lists on the host, waiting for this launch's copies only."""
        if self._event is not None:
            self._event.synchronize()
        else:
            device.synchronize()
        if self._masses is not None:
            self.masses = self._masses.tolist()
        return self._host[0].tolist(), self._host[1].tolist()


def feed_rows(seqs: list[Sequence]) -> list[int] | None:
    """Per row of the next step: the row of the step in flight whose token is this row's input (-1: the host's
    token), or None when no row is pending."""
    rows = [s.pending_row if s.pending else -1 for s in seqs]
    return rows if any(r >= 0 for r in rows) else None


def feed_input_ids(input_ids: torch.Tensor, rows: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """In place: ``input_ids[i] = prev_tokens[rows[i]]`` where ``rows[i] >= 0`` (all on the device, no sync)."""
    fed = prev_tokens.index_select(0, rows.clamp(min=0))
    input_ids.copy_(torch.where(rows >= 0, fed, input_ids))
