"""One-step-ahead decoding: the engine queues decode step N+1 on the device before it reads step N's tokens.

A decode step's inputs depend on the previous step's *lengths* (positions, slots, block tables), which the host
knows ahead, and on its *token values* only through the input ids, which stay on the device: step N+1 gathers
them from step N's sampled-token tensor (``feed_input_ids``). So ``LLM.generate`` launches N+1, then reads N's
tokens (long computed by then) and does N's host work - appending, stop checks, outputs, the next schedule -
while N+1 runs. The device no longer waits for the host between steps.

Several steps per launch (``RolloutConfig.decode_steps`` = K): when every row's results only need appending and
stop checks, the launch queues K decode steps back to back, each step's inputs advanced on the device
(``model_runner.execute_steps``), so the host's per-step work (scheduling, inputs, sampler rows) is paid once per
K tokens. Tokens a sequence draws after its stop within those K are computed and dropped. Batches with structured
outputs launch ``guided_launch_steps(K)`` steps (8 for K = 4: ``GUIDED_LAUNCH_STEPS``; ``GuidedDraws``): the host
reads each step's tokens inside the launch, feeds them to the grammar matchers and computes the next step's masks
while that step's forward runs, and reads the previous launch a step at a time beside those masks.

Prompt steps too (``LLM._launch_mixed``): a step with prompt chunks, decode rows beside them or not, is queued
without waiting for its draws when the host needs them only to append and check stops (no top-k alternatives, no
grammar; prompt log-probs ride along and are stored when the step is read, ``prompt_logprobs.PromptScores``). Its
draws feed the next step's rows on the device like a decode launch's, so the first decode launch after a whole batch's
prefill is scheduled and queued while that prefill runs. A row whose tokens in flight reach its ``max_tokens`` or the
model length is not scheduled again (``scheduler._stops_by_length``), and a launch queues no step whose draw would
fall past the model length (``LLM._steps_per_launch``).

Bookkeeping: launched-but-unread tokens are placeholders (``PENDING``) at the end of ``seq.tokens``, counted by
``seq.pending``, with ``seq.pending_row`` the sequence's row in the launch in flight; the block manager keeps
them out of prefix-cache keys. A sequence found to have stopped was already scheduled into the next launch:
that row's results are dropped. Tokens are those a synchronous engine draws: the sampler keys its noise by
(seed, tokens generated so far), which counts the placeholders.

Not here: scheduling, sampling math, CUDA graphs (``model_runner`` applies the feed on either path).
"""

from __future__ import annotations

import time

import torch

from polyrl.infer.sequence import Sequence, Status
from polyrl.platform import device

PENDING = -1  # placeholder token id of a pending sequence (never fed to the model: its row is fed on the device)


class InflightStep:
    """Launched decode steps (``K`` in a row, ``model_runner.execute_steps``): their sequences in row order and
    their tokens, on the device and on their way to pinned host memory."""

    def __init__(
        self,
        seqs: list[Sequence],
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        masses: torch.Tensor | None = None,
        prompt_scores: list | None = None,
    ) -> None:
        self.seqs = seqs
        # a mixed step's prompt log-probs (``prompt_logprobs.PromptScores``), stored when the step is read
        self.prompt_scores = prompt_scores or []
        self.steps = tokens.shape[0]
        self.tokens = tokens[-1]  # int64 [B] on the device: the last step's draws, the next launch's input ids
        # structured outputs: [K, B] log(mass the grammar allowed) per step and row, read with the tokens
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

    def last_tokens(self) -> list[int]:
        """The last step's tokens ``[B]`` on the host (a guided launch's first masks need them before ``read``)."""
        if self._event is not None:
            self._event.synchronize()
        else:
            device.synchronize()
        return self._host[0][-1].tolist()

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


# Guided rows from which a step's consumes and masks are pipelined (GuidedDraws, steps >= 1): the first half's masks
# are computed on a worker while this thread feeds the second half's matchers. Only across grammar lanes (the halves
# split where the lane changes): a consume takes its lexer's mutex, which the other half's masks then do not hold;
# with one lane (the default below 4 CPUs) every consume would wait for them.
# Off by default (``PIPELINE``): on the H200 (B256, 16 automatic lanes) a run with it on spent 3.02 ms per step in
# masks and 1.01 ms consuming, against 1.47 ms masks with 16 lanes and no pipeline the same morning (cost 21.8% vs
# 12.9%): each half's masks put the 16 executor threads on 8 lanes, two threads per lexer lock, and the masks of the
# halves run one after the other. ``polyrl bench rollout --grammar-pipeline-ab`` times it on.
PIPELINE = False
PIPELINE_ROWS = 32

# Decode steps per guided launch (``guided_launch_steps``): the host work between two launches (reading and reporting
# the previous one's outputs, the schedule, the inputs, the draw plan) runs while the device has nothing queued, since
# a guided launch's last draw waits for its masks; on the free path it hides behind the launch queued ahead. On the
# H200 (B256, 16 lanes, 2026-12-02) that gap was ~0.47 ms per step at 4 steps per launch, most of the guided step's
# 0.66 ms over the free one; 8 steps per launch halve it. The cost: tokens a sequence draws after its stop inside a
# launch are computed and dropped (up to 7 instead of 3), and a new request waits for the launch in flight.
GUIDED_LAUNCH_STEPS = 8
# ... and the previous launch's read (accepting its tokens: ~0.4 ms per step of B256 on the H200) is split a step at a
# time over the launch's steps, each beside one step's masks (off: all of it beside step 0's, which at 8 steps per
# launch outlasts step 0's masks and forward)
SPLIT_READ = True


def guided_launch_steps(decode_steps: int) -> int:
    """The decode steps a launch with grammar rows takes: ``GUIDED_LAUNCH_STEPS`` or ``decode_steps`` if larger;
    1 when ``decode_steps`` is 1 (multi-step launches off)."""
    return 1 if decode_steps <= 1 else max(decode_steps, GUIDED_LAUNCH_STEPS)


def pipeline_split(lanes: list[int]) -> int:
    """Where a step's rows (their grammar lanes, grouped) split into the pipeline's two parts: the lane change nearest
    the middle; 0 (no pipeline) when ``PIPELINE`` is off, below ``PIPELINE_ROWS`` rows or with one lane."""
    n = len(lanes)
    if not PIPELINE or n < PIPELINE_ROWS:
        return 0
    cuts = [i for i in range(1, n) if lanes[i] != lanes[i - 1]]
    return min(cuts, key=lambda i: abs(2 * i - n)) if cuts else 0


class GuidedDraws:
    """``model_runner.execute_steps``'s draw callback for a decode launch with grammar rows (``LLM._launch_guided``).

    When it is called for step j, step j's forward is queued already. It reads step j-1's tokens on the host (for
    j = 0: the previous launch's last step, or the sequence's last known token), feeds each guided row's matcher
    (``Guide.consume_at``: ahead of the engine accepting the token, which then only adds its mass), computes step
    j's masks (llguidance, while the device runs the forward), queues the masked draw and the copy of its tokens to
    pinned host memory (an event per step). So the matchers see exactly the tokens a synchronous engine feeds them,
    a launch of K steps pays the engine's per-launch host work (schedule, inputs, reads) once per K tokens, and
    each step's mask overlaps that step's forward. The draw plan, the executor's (matcher, row) pairs and the feed
    order are built once, at step 0 (after the forward is queued). From step 1 on, with ``PIPELINE_ROWS`` guided
    rows or more over several grammar lanes, the first half of the rows (in the executor's lane order, cut where the
    lane changes: ``pipeline_split``) is fed and its masks are started on the mask worker (``MaskBuffers.start``)
    before the second half is fed, so feeding overlaps computing masks.
    With several grammar lanes (``GrammarCache.par_consume``; the pipeline off) a step's consumes are one executor call
    (``GrammarCache.consume``, the GIL released) instead of a Python call per row; the guides' ``consumed`` counts
    are moved at step 0 and once for steps >= 1 (at the launch's last step), not per row and step.
    Tokens a row draws after its sequence stopped are consumed too (its matcher is never used again) and dropped.
    """

    def __init__(
        self,
        sampler,
        seqs: list[Sequence],
        prev: InflightStep | None,
        suppress: list[list[int] | None] | None,
        steps: int,
        times,
        beside=None,
    ) -> None:
        self.sampler, self.seqs, self.prev, self.suppress, self.steps, self.times = (
            sampler, seqs, prev, suppress, steps, times,
        )  # fmt: skip
        # host work to run a part of beside each step's masks (LLM._launch_guided: one step of the previous launch's
        # read per call, True while there is more); what is left after the launch: finish_beside
        self.beside = beside
        self.plan = None
        self.masses: list[torch.Tensor] = []
        self._rows: list[tuple[int, object, int]] = []  # (row, guide, output index of the row's step-0 input)
        # steps >= 1: (row, guide, its matcher's consume_token) in the executor's order, split where the pipeline
        # hands the first part's masks to the worker (no split: everything in _tail)
        self._head: list[tuple[int, object, object]] = []
        self._tail: list[tuple[int, object, object]] = []
        self._head_pairs: list = []
        # with several grammar lanes (GrammarCache.par_consume): the step's consumes in one executor call
        self._par = None
        self._pairs: list = []  # (matcher, batch row) in the executor's lane order
        self._host: torch.Tensor | None = None  # pinned [K, B]: each step's tokens on their way to the host
        self._events: list = []
        self._cpu: list[torch.Tensor] = []  # on the CPU: the steps' token tensors themselves

    def __call__(self, logits: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        times, clock = self.times, time.perf_counter
        t0 = clock()
        if j == 0:
            self.plan = self.sampler.plan(self.seqs, logits.device)
            self._setup()
            toks = self._first_tokens()
        else:
            toks = self._step_tokens(j - 1)
        plan = self.plan
        t1 = clock()
        if j == 0:
            self._consume_first(toks)
        elif self._par is not None:
            # one executor call, the GIL released (GrammarCache.consume); step j-1 left every row's matcher at output
            # token p + j, so no position checks, and the guides' counts are moved once, at the launch's last step
            self._par(self._pairs, toks)
            if j == self.steps - 1:
                for g in plan.guides:
                    g.consumed += j
        else:
            # step j-1 left every row's matcher at output token p + j (consumed == p + j): feed it without the
            # position check of consume_at (host time on every step of every row)
            if self._head:
                for b, g, consume in self._head:
                    consume(toks[b])
                    g.consumed += 1
                self.sampler.mask_buffers.start(plan.guides[0].cache, self._head_pairs, len(plan.guides), logits.device)
            for b, g, consume in self._tail:
                consume(toks[b])
                g.consumed += 1
        t2 = clock()
        if self.beside is not None and plan.guided and (j == 0 or not self._head):  # not beside a pipelined step
            plan.beside = self._beside_once if SPLIT_READ else self.finish_beside
        tokens, logprobs = self.sampler.draw_planned(logits, plan, self.suppress, j)
        if plan.masked_logmass is not None:
            self.masses.append(plan.masked_logmass)
        if j + 1 < self.steps:
            self._send(tokens, j)
        t3 = clock()
        times.wait += t1 - t0
        times.consume += t2 - t1
        # the draw's own host time: without the masks (and the previous launch's read run beside step 0's)
        times.draw += max(0.0, (t3 - t2) - (self.sampler.mask_buffers.last_s if plan.guided else 0.0))
        times.steps += 1
        return tokens, logprobs

    def _setup(self) -> None:
        """Step 0: each guided row's step-0 input index, the executor's pairs (on the plan, for every step's mask)
        and the feed order of steps >= 1 (the pairs' order, split for the pipeline)."""
        plan, seqs = self.plan, self.seqs
        if not plan.guided:
            return
        guided, guides = plan.guided, plan.guides
        cache = guides[0].cache
        self._rows = [(b, g, seqs[b].num_tokens - 1 - seqs[b].num_prompt) for b, g in zip(guided, guides)]
        pairs = plan.mask_pairs = cache.mask_pairs(guides)
        lanes = [guides[i].lane for _, i in pairs]
        h = pipeline_split(lanes) if self.steps > 1 else 0
        # (matcher, batch row) in the executor's lane order, for GrammarCache.consume: when the rows span several lanes
        # (rows of one lane would all wait for its lexer's mutex: the per-row calls then)
        if cache.par_consume and h == 0 and lanes[0] != lanes[-1]:
            self._par = cache.consume
            self._pairs = [(m, guided[i]) for m, i in pairs]
            return
        feed = [(guided[i], guides[i], m.consume_token) for m, i in pairs]
        self._head, self._tail, self._head_pairs = feed[:h], feed[h:], pairs[:h]

    def _consume_first(self, toks: list[int | None]) -> None:
        """Step 0: each guided row's matcher consumes its step-0 input unless it has it already (``toks[b]`` None;
        a matcher behind that position is an error, as in ``Guide.consume_at``). With ``GrammarCache.consume`` (several
        lanes) one executor call on this thread. Not on the mask worker beside the previous launch's read: the worker
        would need the GIL back between the consumes and the masks while this thread runs Python, and could wait a
        whole switch interval (5 ms) for it."""
        if self._par is None:
            for b, g, p in self._rows:
                g.consume_at(p, toks[b])  # a row's matcher may have its step-0 input already (toks[b] is None)
            return
        todo = []
        for b, g, p in self._rows:
            if toks[b] is not None:  # _first_tokens: only where g.consumed == p
                todo.append((g.matcher, b))
                g.consumed += 1
            elif p > g.consumed:
                raise RuntimeError(f"grammar matcher fed token {p} before token {g.consumed}")
        if todo:
            self._par(todo, toks)

    def _beside_once(self) -> None:
        """One call of ``beside`` (one step of the previous launch's read); dropped once it says it is done."""
        if self.beside is not None and not self.beside():
            self.beside = None

    def finish_beside(self) -> None:
        """Run what is left of ``beside`` (the previous launch's steps not read beside a step's masks)."""
        while self.beside is not None:
            self._beside_once()

    def stacked_masses(self) -> torch.Tensor | None:
        """``[K, B]`` log(mass the grammar allowed) per step and row (None without guided rows)."""
        return torch.stack(self.masses) if self.masses else None

    def _first_tokens(self) -> list[int | None]:
        """Per row, the step-0 input token where its matcher has not consumed it yet (None elsewhere)."""
        toks: list[int | None] = [None] * len(self.seqs)
        seqs, last = self.seqs, None
        for b, g, p in self._rows:
            if g.consumed != p:
                continue
            s = seqs[b]
            if s.pending:
                if last is None:
                    last = self.prev.last_tokens()
                toks[b] = last[s.pending_row]
            else:
                toks[b] = s.tokens[-1]
        return toks

    def _send(self, tokens: torch.Tensor, j: int) -> None:
        """Queue step j's tokens to the host (read at step j + 1)."""
        if tokens.device.type == "cpu":
            self._cpu.append(tokens)
            return
        if self._host is None:
            self._host = torch.empty((self.steps - 1, tokens.shape[0]), dtype=tokens.dtype, pin_memory=True)
        self._host[j].copy_(tokens, non_blocking=True)
        event = device.event(enable_timing=False)
        if event is not None:
            event.record()
        self._events.append(event)

    def _step_tokens(self, j: int) -> list[int]:
        if self._host is None:
            return self._cpu[j].tolist()
        event = self._events[j]
        if event is not None:
            event.synchronize()
        else:
            device.synchronize()
        return self._host[j].tolist()
