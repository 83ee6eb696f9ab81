"""Sampler: next tokens from fp32 logits of the last position of each sequence.

For each row: ``z = logits / T``; the reported log-prob of the chosen token is ``log_softmax(z)[token]``
(T = temperature, or 1 for greedy rows) - the distribution RL's importance ratios need: the model's
logits at the rollout temperature, WITHOUT top-k/top-p/min-p truncation and without the min_tokens
EOS mask. Top-k alternatives (``SamplingParams.logprobs``) come from the same distribution.

Drawing is one batched call of ``polyrl.kernels.sample_tokens`` for the whole batch: a Gumbel-max
``argmax(z + G)`` (an exact categorical draw) whose noise ``G`` is a hash of (seed, offset, vocab index).
A seeded request's row uses ``seed = sample_seed(params.seed, index)`` and ``offset`` = the tokens that
sequence has generated so far, so its tokens depend neither on the rest of the batch nor on its position
in it, and a preempted-and-recomputed sequence draws the same tokens again. Unseeded rows share one seed
drawn per step from torch's global RNG (plus the row index). Rows with top-k / top-p / min-p are masked
first in torch (``apply_top_k_top_p_min_p`` on ``z``) and then drawn by the same kernel at T = 1, so the
noise comes from the same hash. Greedy rows (T == 0) take ``argmax(logits)``.

Structured outputs: rows whose sequence has a ``guide`` (a grammar matcher, ``infer/structured.py``) get the
grammar's token bitmask applied to their logits before top-k/top-p and the draw (greedy rows take the argmax of the
masked logits): computed on the host into persistent buffers (``structured.MaskBuffers``), applied on the device by
``kernels.apply_token_bitmask``, one pass per guided row that also gives the logsumexps of the unmasked and masked
rows (so the unmasked log-prob of the drawn token is the kernel's masked one plus log(allowed mass): one add, and
logits stay in their dtype); the engine feeds
the drawn token to the matcher before the next draw (``overlap.GuidedDraws``, or ``LLM._accept``). Their reported
log-prob is, as for truncated rows, the one of the unmasked distribution (what the trainer recomputes); what the
mask removed is measured per token as ``log(allowed probability mass)`` (``DrawPlan.masked_logmass``) and summed
on the guide (``Guide.masked_logmass``), the rollout's mismatch. Guided rows run in multi-step launches (step j's
masks are computed once the host has step j-1's tokens, while step j's forward runs) but never in a launch graph
(the next mask needs this token on the host).

This module does not decide when a sequence stops; it only applies the min_tokens mask it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from polyrl import kernels
from polyrl.infer.sampling_params import sample_seed
from polyrl.infer.sequence import Sequence

SEED_RANGE = 2**62  # unseeded rows: base seed in [0, 2^62) plus the row index stays a valid int64


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    masses: list[float] | None = None  # structured outputs: per row, log(mass the grammar allowed) (0 unguided)


def apply_top_k_top_p_min_p(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask scaled logits ``z [B, V]`` to -inf outside each row's top-k / top-p / min-p set.

    ``top_k`` int64 ``[B]`` (>= V or <= 0 disables), ``top_p`` fp32 ``[B]`` (1 disables), ``min_p`` fp32 ``[B]``
    (0 disables). The top token always survives.
    """
    if min_p is not None:
        probs = torch.softmax(z, dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        z = z.masked_fill(probs < thresh, float("-inf"))
    if top_k is None and top_p is None:
        return z
    sorted_z, order = z.sort(dim=-1, descending=True)
    vocab = z.shape[-1]
    remove = torch.zeros_like(sorted_z, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        ranks = torch.arange(vocab, device=z.device)[None, :]
        remove |= ranks >= k[:, None]
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_z.masked_fill(remove, float("-inf")), dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        remove |= before > top_p[:, None]
    remove[:, 0] = False
    sorted_z = sorted_z.masked_fill(remove, float("-inf"))
    return torch.empty_like(z).scatter_(-1, order, sorted_z)


@dataclass
class SamplingRows:
    """A launch's per-row draw parameters on the host (``Sampler.rows``): what a launch graph's sampling reads."""

    temps: np.ndarray  # float32 [bs], 1 on greedy rows
    seeds: np.ndarray  # int64 [bs]
    offsets: np.ndarray  # int64 [bs]: tokens each row generated before the launch
    greedy: np.ndarray  # int64 [bs], 0/1


@dataclass
class _Rows:
    """The per-row parameters of one step as [B] tensors on the logits' device."""

    temps: torch.Tensor  # fp32, 1 on greedy rows
    inv_temps: torch.Tensor  # fp32 1 / temps, as the kernel computes it
    seeds: torch.Tensor  # int64
    offsets: torch.Tensor  # int64
    greedy: torch.Tensor  # bool


def host_to_device(values: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``dev`` without waiting for the device: a blocking copy from pageable memory
    synchronises the stream (torch copies and then syncs), which would stall the host behind every kernel
    already queued, and one-step-ahead decoding needs the host to run ahead of the device."""
    t = torch.tensor(values, dtype=dtype)
    return t if dev.type == "cpu" else t.pin_memory().to(dev, non_blocking=True)


def _row_values(seqs: list[Sequence]) -> tuple[list[float], list[int], list[int], list[bool]]:
    """(temperatures, seeds, offsets, greedy) per row as host lists (temperature 1 on greedy rows)."""
    # One pass over the rows: this is host time the device waits for at every decode step.
    temps, seeds, offsets, greedy = [], [], [], []
    unseeded = False
    for s in seqs:
        d = s.draw
        if d is None:  # a sequence's constants, computed on its first draw (seed hashing is not free per step)
            p = s.params
            t = p.temperature
            d = s.draw = (t if t > 0 else 1.0, t == 0.0, sample_seed(p.seed, s.index) if p.seed is not None else -1)
        temps.append(d[0])
        greedy.append(d[1])
        seeds.append(d[2])
        unseeded = unseeded or (d[2] < 0 and not d[1])
        offsets.append(len(s.tokens) - s.num_prompt)
    if unseeded:
        base = int(torch.randint(0, SEED_RANGE, (1,)).item())
        seeds = [sd if sd >= 0 else base + b for b, sd in enumerate(seeds)]
    return temps, seeds, offsets, greedy


def _row_tensors(seqs: list[Sequence], dev: torch.device) -> _Rows:
    temps, seeds, offsets, greedy = _row_values(seqs)
    ints = host_to_device([seeds, offsets, greedy], torch.int64, dev)  # [3, B]
    t = host_to_device(temps, torch.float32, dev)
    return _Rows(t, 1.0 / t, ints[0], ints[1], ints[2].bool())


def _suppress_mask(logits: torch.Tensor, suppress: list[list[int] | None] | None) -> tuple[torch.Tensor, list[int]]:
    """(logits with each row's suppressed ids at -inf, the rows that had any)."""
    if not suppress or not any(suppress):
        return logits, []
    V = logits.shape[1]
    rows, cols, hit = [], [], []
    for b, ids in enumerate(suppress):
        ids = [t for t in ids or () if 0 <= t < V]
        if ids:
            hit.append(b)
            rows += [b] * len(ids)
            cols += ids
    if not hit:
        return logits, []
    masked = logits.clone()
    dev = logits.device
    masked[host_to_device(rows, torch.int64, dev), host_to_device(cols, torch.int64, dev)] = float("-inf")
    return masked, hit


def _truncation(seqs: list[Sequence], idx: list[int], dev: torch.device):
    """(top_k, top_p, min_p) [len(idx)] tensors or None for the truncated rows ``idx``."""
    ps = [seqs[b].params for b in idx]
    top_k = top_p = min_p = None
    if any(p.uses_top_k for p in ps):
        top_k = host_to_device([p.top_k if p.uses_top_k else 0 for p in ps], torch.int64, dev)
    if any(p.uses_top_p for p in ps):
        top_p = host_to_device([p.top_p if p.uses_top_p else 1.0 for p in ps], torch.float32, dev)
    if any(p.uses_min_p for p in ps):
        min_p = host_to_device([p.min_p if p.uses_min_p else 0.0 for p in ps], torch.float32, dev)
    return top_k, top_p, min_p


@dataclass
class DrawPlan:
    """What a batch's draws need on the device, built once from its sequences: reused by every decode step
    launched together (``step`` then advances each row's noise offset)."""

    rows: _Rows
    temps: torch.Tensor  # fp32 [B]: the rows' temperatures, 1 on truncated rows (they enter as masked z)
    trunc_rows: list[int]  # rows with top-k / top-p / min-p
    trunc_idx: torch.Tensor | None
    trunc: tuple | None  # (top_k, top_p, min_p) of the truncated rows
    guided: list[int] | None = None  # rows with a grammar (structured outputs)
    guides: list | None = None  # their ``Guide`` s, in that order
    masked_logmass: torch.Tensor | None = None  # after a draw: [B] log(allowed mass) per row (0 on unguided rows)
    guided_idx: torch.Tensor | None = None  # after a draw: the guided rows on the device (None: every row or none)
    # host work to run on this thread while the next draw's masks are computed on another (structured.MaskBuffers;
    # overlap.GuidedDraws hands the previous launch's read here); used once, then cleared
    beside: Callable[[], None] | None = None
    mask_pairs: list | None = None  # the guides' (matcher, row) pairs in executor order (GrammarCache.mask_pairs)


class Sampler:
    """Stateless: everything a row's draw depends on is in its sequence (seed, index, tokens generated). It keeps
    only buffers: the structured-output masks' (``MaskBuffers``, made on the first guided draw)."""

    def __init__(self) -> None:
        self._mask_buffers = None

    @property
    def mask_buffers(self):
        """The structured-output masks' buffers (``structured.MaskBuffers``), made on first use."""
        if self._mask_buffers is None:
            # lazy: structured.py is imported only once a guided row is drawn (llguidance itself is optional)
            from polyrl.infer.structured import MaskBuffers

            self._mask_buffers = MaskBuffers()
        return self._mask_buffers

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], suppress: list[list[int] | None] | None = None
    ) -> SamplerOutput:
        """``logits`` fp32 ``[B, V]`` for ``seqs``; ``suppress[b]`` are token ids to forbid in row b (min_tokens)."""
        logits = logits.float()
        plan = self.plan(seqs, logits.device)
        tokens, logprobs = self.draw_planned(logits, plan, suppress)
        top = self._top_logprobs(logits, plan.rows.inv_temps, seqs)
        masses = plan.masked_logmass.tolist() if plan.guided else None
        return SamplerOutput(tokens.tolist(), logprobs.tolist(), top, masses)

    def draw(
        self, logits: torch.Tensor, seqs: list[Sequence], suppress: list[list[int] | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [B], logprobs fp32 [B]) left on the device, queued without waiting for it (no top-k
        alternatives: those are read on the host)."""
        return self.draw_planned(logits, self.plan(seqs, logits.device), suppress)

    def rows(self, seqs: list[Sequence]):
        """The rows' draw parameters on the host (``cuda_graphs.SamplingRows``, what a decode launch graph samples
        with), or None when a row truncates (top-k / top-p / min-p: drawn by ``draw_planned`` instead)."""
        if any(s.params.truncates or s.guide is not None for s in seqs):
            return None
        temps, seeds, offsets, greedy = _row_values(seqs)
        return SamplingRows(
            np.asarray(temps, np.float32), np.asarray(seeds, np.int64), np.asarray(offsets, np.int64),
            np.asarray(greedy, np.int64),
        )  # fmt: skip

    def plan(self, seqs: list[Sequence], dev: torch.device) -> DrawPlan:
        rows = _row_tensors(seqs, dev)
        trunc = [b for b, s in enumerate(seqs) if s.params.truncates]
        guided = [b for b, s in enumerate(seqs) if s.guide is not None] or None
        guides = [seqs[b].guide for b in guided] if guided else None
        if not trunc:
            return DrawPlan(rows, rows.temps, [], None, None, guided, guides)
        idx = host_to_device(trunc, torch.int64, dev)
        temps = rows.temps.index_fill(0, idx, 1.0)
        return DrawPlan(rows, temps, trunc, idx, _truncation(seqs, trunc, dev), guided, guides)

    def draw_planned(
        self,
        logits: torch.Tensor,
        plan: DrawPlan,
        suppress: list[list[int] | None] | None = None,
        step: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; ``step`` = how many tokens each row has drawn since ``plan`` was made. ``logits``
        in any float dtype: ``sample_tokens`` reads bf16 as fp32 (no fp32 copy); masked or truncated rows upcast."""
        masks = bool(suppress and any(suppress)) or plan.trunc_idx is not None or bool(plan.trunc_rows)
        if masks:
            logits = logits.float()
        rows = plan.rows
        inp, suppressed = _suppress_mask(logits, suppress)
        lse = None
        if plan.guided:  # the guides have consumed every token before this step's (overlap.GuidedDraws)
            inp, lse = self._apply_grammar(inp, logits, plan)
        if plan.trunc_idx is not None:
            # Truncated rows enter the kernel as their masked z at T = 1 (z * 1 == z, same noise, same draw).
            idx = plan.trunc_idx
            z = apply_top_k_top_p_min_p(inp[idx] * rows.inv_temps[idx, None], *plan.trunc)
            inp = inp.clone() if inp is logits else inp
            inp[idx] = z
        offsets = rows.offsets + step if step else rows.offsets
        tokens, logprobs = kernels.sample_tokens(inp, plan.temps, rows.seeds, offsets, rows.greedy)
        if lse is not None and not masks:
            # Guided rows (nothing else masked): the kernel's log-prob is the masked row's, z[token] - lse_masked;
            # adding log(allowed mass) = lse_masked - lse gives the unmasked one (+0 on unguided rows): one add per
            # step, no gather over the logits
            return tokens, logprobs + plan.masked_logmass
        fix = sorted(set(plan.trunc_rows) | set(suppressed) | set(plan.guided or ()))
        if fix:
            # The kernel's log-prob is of what it was handed; these rows report the unmasked distribution.
            idx = host_to_device(fix, torch.int64, logits.device)
            z = logits[idx] * rows.inv_temps[idx, None]
            lp = z.gather(-1, tokens[idx, None])[:, 0] - torch.logsumexp(z, dim=-1)
            logprobs = logprobs.index_copy(0, idx, lp)
        return tokens, logprobs

    def _apply_grammar(
        self, inp: torch.Tensor, logits: torch.Tensor, plan: DrawPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``inp`` with each guided row's disallowed tokens at -inf, logsumexp ``[G]`` of each guided row's unmasked
        z = ``logits / T``); sets ``plan.masked_logmass`` ([B]). The masks are computed on the host (llguidance, in
        parallel) into persistent buffers and applied on the device in one pass (``kernels.apply_token_bitmask``)."""
        guides = plan.guides
        dev = logits.device
        beside, plan.beside = plan.beside, None
        if plan.mask_pairs is None:  # the (matcher, row) list the executor takes: built once per plan
            plan.mask_pairs = guides[0].cache.mask_pairs(guides)
        bitmask = self.mask_buffers.fill(guides[0].cache, plan.mask_pairs, dev, beside)
        inv = plan.rows.inv_temps
        if len(guides) == logits.shape[0]:  # every row guided (a constrained rollout): no gathers
            plan.guided_idx = None
            out, lse, lse_masked = kernels.apply_token_bitmask(inp, bitmask, None, inv)
        else:
            if plan.guided_idx is None:  # once per plan (a launch's steps reuse it)
                plan.guided_idx = host_to_device(plan.guided, torch.int64, dev)
            out, lse, lse_masked = kernels.apply_token_bitmask(inp, bitmask, plan.guided_idx, inv)
        self.mask_buffers.applied()  # the next step's mask upload need not wait for more than this apply
        if inp is not logits:  # min_tokens suppressed ids in inp: the unmasked distribution is logits'
            idx = plan.guided_idx
            z = (logits if idx is None else logits[idx]) * (inv if idx is None else inv[idx])[:, None]
            lse = torch.logsumexp(z, dim=-1)
        mass = lse_masked - lse
        if plan.guided_idx is None:
            plan.masked_logmass = mass
        else:
            plan.masked_logmass = torch.zeros(logits.shape[0], device=dev).index_copy_(0, plan.guided_idx, mass)
        return out, lse

    def _top_logprobs(
        self, logits: torch.Tensor, inv_temps: torch.Tensor, seqs: list[Sequence]
    ) -> list[dict[int, float] | None]:
        ks = [s.params.logprobs or 0 for s in seqs]
        kmax = max(ks, default=0)
        if kmax == 0:
            return [None] * len(seqs)
        want = [b for b, k in enumerate(ks) if k]
        idx = host_to_device(want, torch.int64, logits.device)
        report = torch.log_softmax(logits[idx] * inv_temps[idx, None], dim=-1)
        vals, ids = report.topk(kmax, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        out: list[dict[int, float] | None] = [{} if s.params.logprobs is not None else None for s in seqs]
        for j, b in enumerate(want):
            out[b] = dict(zip(ids[j][: ks[b]], vals[j][: ks[b]]))
        return out
