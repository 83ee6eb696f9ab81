"""Prompt log-probs in the prefill: ``log p(prompt[i] | prompt[:i])`` and the top-k alternatives, per prompt token.

A sequence asking for them (``SamplingParams.prompt_logprobs``, sample 0 of its request) carries a
``PromptLogprobs`` whose lists grow as its prefill chunks run: the hidden state at position ``p`` scores token
``p + 1``, so a chunk covering positions ``[start, start + n)`` fills the entries ``start + 1 .. start + n`` that
are still missing (the last prompt position scores the first generated token: that is the sampler's job). Only the
selected rows of the step's ``[T, H]`` hidden states reach the LM head:

- without alternatives (k = 0) the chosen token's log-prob is ``kernels.token_logprobs`` (the op the training
  forward uses for its log-probs), called on row chunks of at most ``ROW_CHUNK_ELEMS`` logits (its CPU reference
  holds 4096 rows x V at once), so scores equal the trainer's;
- with top-k alternatives one pass over row chunks of logits (``[rows, V]`` fp32, at most ``ROW_CHUNK_ELEMS`` =
  256 MiB, within the cache sizing's reserve for sampled logits; never ``[T, V]`` at once) gives the alternatives,
  the token's rank and its log-prob (the op reference's arithmetic: logits in the model's dtype, upcast,
  log-softmax), so the LM head runs once per row; the chosen token's entry among the alternatives is that same
  number, so a greedy check (``logprob == max(top)``) is exact. Per chunk: one GEMM; where ``kernels.token_logprobs``
  runs Triton (CUDA), the log-sum-exp and the chosen token's log-prob come from that op's row kernel reading the
  logits once in the model's dtype (``logit_row_stats``: no fp32 copy; the chosen log-probs are that op's numbers) and
  the maximum (``max`` for k = 1, ``topk`` above), the gather and the rank compare run on the model-dtype logits
  (exact there); elsewhere (the CPU reference) one upcast, the row maximum reused by the log-sum-exp (no second max
  pass), one gather and one compare. The host turns the rows into Python lists once per step (k = 1: one small
  dict per row, no per-row loop over alternatives).

Cost (``docs/performance.md``, "Evaluation"): scoring every position puts every prompt row through the LM head. At
the qwen3-0.6b shape the head is 2 x 1024 x 151936 = 0.31 GFLOP a token against ~0.88 GFLOP for the body, so
scoring every position adds at least ~35% to a prefill (plus a log-softmax over 152k logits per row) whatever the
implementation; scoring only a continuation (lm-eval's log-likelihood requests) puts a few rows through the head.

Prefix cache: positions whose log-probs are still missing are always recomputed; ``BlockManager.lookup_prefix``
lets a sequence take cached blocks only below the first position it still needs (``prompt_logprobs_from`` lets a
scorer that wants only a continuation's log-probs keep the cache hit on its context). Preemption keeps what was
filled. Log-probs are of the raw distribution (temperature 1, no truncation), as vLLM reports prompt log-probs.

Off the host's critical path: ``plan_step`` counts the planned rows as ``PromptLogprobs.queued`` (so the next
chunk's plan and the prefix-cache lookup see them as filled), ``compute`` queues the GEMMs and row statistics and
starts the copies of the results into pinned host memory, and returns ``PromptScores``; the engine calls
``PromptScores.store`` when it reads the step's sampled tokens (``LLM._read_steps``; right after the sampler on the
synchronous path), so a scoring step can be queued ahead of the step in flight like any prefill step, and the
host's list building overlaps the next step's device work.

This module only computes and stores; scheduling and formatting (``server/logprobs.py``) live elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl import kernels
from polyrl.infer.sampler import host_to_device
from polyrl.infer.scheduler import ScheduledSeq
from polyrl.infer.sequence import Sequence
from polyrl.platform import device

ROW_CHUNK_ELEMS = 1 << 26  # logits elements per chunk: [rows, V] fp32 = 256 MiB (441 rows at V = 152k)


def first_needed(seq: Sequence) -> int | None:
    """The first prompt position whose hidden state ``seq`` still needs for its prompt log-probs, or None."""
    pl = seq.prompt_lps
    if pl is None:
        return None
    filled = pl.filled
    return None if filled >= seq.num_prompt else filled - 1


@dataclass
class PromptPlan:
    rows: list[int]  # rows of the step's [T, H] hidden states
    targets: list[int]  # the prompt token each row scores
    spans: list[tuple[Sequence, int]]  # (sequence, rows of it), in row order
    top_k: int  # the largest k asked for in this step


def plan_step(items: list[ScheduledSeq]) -> PromptPlan | None:
    """Which hidden rows of this step score which prompt tokens; None when no item needs any. The planned rows count
    as ``queued`` in each sequence's ``PromptLogprobs`` until ``PromptScores.store`` appends them."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[Sequence, int]] = []
    top_k, lo = 0, 0
    for it in items:
        s = it.seq
        need = first_needed(s)
        if need is not None and need < it.start + it.num_new:
            if need < it.start:
                raise RuntimeError(f"prompt log-probs of {s!r} skipped position {need} (a cached prefix was taken)")
            end = min(it.start + it.num_new, s.num_prompt - 1)  # positions [need, end) score tokens need+1 .. end
            if end > need:
                rows.extend(range(lo + need - it.start, lo + end - it.start))
                targets.extend(s.tokens[need + 1 : end + 1])
                spans.append((s, end - need))
                s.prompt_lps.queued += end - need
                top_k = max(top_k, s.params.prompt_logprobs or 0)
        lo += it.num_new
    return PromptPlan(rows, targets, spans, top_k) if rows else None


class PromptScores:
    """One step's prompt log-probs on their way to the host (``compute``): ``store`` appends them to each sequence's
    ``PromptLogprobs``, waiting for this step's copies only."""

    def __init__(self, plan: PromptPlan, chosen: torch.Tensor, top: tuple[torch.Tensor, ...] | None) -> None:
        self.plan = plan
        tensors = (chosen, *top) if top is not None else (chosen,)
        self._copied = chosen.device.type != "cpu"
        if not self._copied:
            self._host, self._event = tensors, None
            return
        self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
        for h, t in zip(self._host, tensors):
            h.copy_(t, non_blocking=True)
        self._event = device.event(enable_timing=False)
        if self._event is not None:
            self._event.record()

    def store(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        elif self._copied:  # a device without events: the copies into (CPU) pinned memory may still be running
            device.synchronize()
        plan = self.plan
        lps = self._host[0].tolist()
        tv = ti = ranks = None
        if len(self._host) > 1:
            top_v, top_i, rank = self._host[1:]
            ranks = rank.tolist()
            if plan.top_k == 1:  # flat lists: one dict per row below, no nested lists
                tv, ti = top_v[:, 0].tolist(), top_i[:, 0].tolist()
            else:
                tv, ti = top_v.tolist(), top_i.tolist()
        r = 0
        for seq, count in plan.spans:  # per row: list appends only (a 4,000-prompt echo request scores ~400k rows)
            pl = seq.prompt_lps
            k = seq.params.prompt_logprobs or 0
            end = r + count
            pl.logprobs.extend(lps[r:end])
            pl.queued -= count
            if not k:
                pl.top_logprobs.extend({} for _ in range(count))
                pl.ranks.extend([None] * count)
            elif plan.top_k == 1:  # the top-1 alternative; the chosen token's own number when it is that one
                pl.top_logprobs.extend(
                    [
                        {i: lp} if i == t else {i: v}
                        for i, v, t, lp in zip(ti[r:end], tv[r:end], plan.targets[r:end], lps[r:end])
                    ]
                )
                pl.ranks.extend(ranks[r:end])
            else:
                tops = []
                for ids, vals, target, lp in zip(ti[r:end], tv[r:end], plan.targets[r:end], lps[r:end]):
                    top = dict(zip(ids[:k], vals[:k]))
                    if target in top:  # the same number as the token's own log-prob (an exact greedy test)
                        top[target] = lp
                    tops.append(top)
                pl.top_logprobs.extend(tops)
                pl.ranks.extend(ranks[r:end])
            r = end


def compute(hidden: torch.Tensor, weight: torch.Tensor, plan: PromptPlan) -> PromptScores:
    """Queue the scoring of ``plan``'s rows of ``hidden`` ``[T, H]`` against the LM head ``weight`` ``[V, H]``; the
    returned ``PromptScores.store`` appends the results to each sequence's ``prompt_lps``."""
    dev = hidden.device
    rows = host_to_device(plan.rows, torch.long, dev)  # no stream sync: the host stays ahead of the device
    targets = host_to_device(plan.targets, torch.long, dev)
    h = hidden.index_select(0, rows)  # [R, H]
    if plan.top_k:  # one pass over the logits gives the alternatives, the ranks and the chosen tokens' log-probs
        top_v, top_i, rank, chosen = top_logprobs(h, weight, plan.top_k, targets)
        return PromptScores(plan, chosen, (top_v, top_i, rank))
    chunk = max(1, ROW_CHUNK_ELEMS // weight.shape[0])  # bounded logits whatever the op's own chunking
    parts = [
        kernels.token_logprobs(h[lo : lo + chunk], weight, targets[lo : lo + chunk])
        for lo in range(0, len(plan.rows), chunk)
    ]
    return PromptScores(plan, torch.cat(parts).float(), None)


def compute_and_store(hidden: torch.Tensor, weight: torch.Tensor, plan: PromptPlan) -> None:
    """``compute`` and ``store`` at once (waits for the device)."""
    compute(hidden, weight, plan).store()


def top_logprobs(
    h: torch.Tensor, weight: torch.Tensor, k: int, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log-probs fp32 ``[R, k]``, token ids int64 ``[R, k]``, rank int32 ``[R]`` and log-prob fp32 ``[R]`` of
    ``targets``, the last two None without targets) of the ``k`` likeliest tokens of each row of ``h`` ``[R, H]``,
    over row chunks (never more than ``ROW_CHUNK_ELEMS`` logits at once). Logits are computed in the model's dtype
    and upcast, as ``kernels.token_logprobs``' reference does. A rank counts the tokens strictly likelier, plus one."""
    # at most ROW_CHUNK_ELEMS logits a chunk, whatever their dtype (the rank's compare and the top-k take temporaries
    # of the chunk's size too: the GPU test bounds the peak)
    chunk = max(1, ROW_CHUNK_ELEMS // weight.shape[0])
    fused = targets is not None and uses_row_kernel(h)
    vals, ids, ranks, own_lp = [], [], [], []
    for lo in range(0, h.shape[0], chunk):
        logits = torch.nn.functional.linear(h[lo : lo + chunk], weight)  # [r, V], the model's dtype
        if fused:  # logits stay in the model's dtype: comparisons and the maximum are exact there
            t = targets[lo : lo + chunk]
            lse, lp = logit_row_stats(logits, t)
            v, i = logits.max(dim=-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1)
            own = logits.gather(-1, t[:, None])
            vals.append(v.float() - lse[:, None])
            ids.append(i)
            ranks.append((logits > own).sum(-1, dtype=torch.int32).add_(1))
            own_lp.append(lp)
            continue
        logits = logits.float()
        if k == 1:
            v, i = logits.max(dim=-1, keepdim=True)
        else:
            v, i = logits.topk(k, dim=-1)
        m = v[:, :1]  # the row maximum (topk is sorted), reused by the log-sum-exp
        lse = (logits - m).exp_().sum(-1, keepdim=True).log_().add_(m)
        vals.append(v - lse)
        ids.append(i)
        if targets is not None:
            own = logits.gather(-1, targets[lo : lo + chunk, None])  # [r, 1]
            ranks.append((logits > own).sum(-1, dtype=torch.int32).add_(1))
            own_lp.append((own - lse)[:, 0])
    if targets is None:
        return torch.cat(vals), torch.cat(ids), None, None
    return torch.cat(vals), torch.cat(ids), torch.cat(ranks), torch.cat(own_lp)


def uses_row_kernel(h: torch.Tensor) -> bool:
    """Whether ``kernels.token_logprobs`` runs its Triton row kernel for ``h``'s device and dtype (a CUDA device,
    unless ``POLYRL_KERNELS`` forces the reference): then ``logit_row_stats`` reads the logits with it."""
    name, _ = kernels.registry.select("token_logprobs", h.device.type, kernels.dtype_name(h.dtype))
    return name == "triton"


def logit_row_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp fp32 ``[r]``, log-prob of ``targets`` fp32 ``[r]``) of ``logits`` ``[r, V]`` in the model's dtype,
    read once by the row kernel ``kernels.token_logprobs`` runs on CUDA (fp32 online max / sum-exp: no fp32 copy of
    the logits, and the chosen tokens' log-probs are that op's numbers)."""
    # lazy: Triton is imported only where the token_logprobs op already runs it
    from polyrl.kernels.token_logprobs import triton as tk

    r, vocab = logits.shape
    lse = torch.empty(r, device=logits.device, dtype=torch.float32)
    lp = torch.empty_like(lse)
    block, warps = tk.block_config(vocab)
    tk._row_stats_kernel[(r,)](
        logits,
        logits.stride(0),
        targets.contiguous(),
        lse,
        lp,
        lse,  # no entropy
        vocab,
        1.0,
        tk.NO_IGNORE,
        HAS_ENT=False,
        BLOCK_V=block,
        num_warps=warps,
    )
    return lse, lp
