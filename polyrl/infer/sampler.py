"""Sampler: next tokens from fp32 logits of the last position of each sequence.

For each row: ``z = logits / T``; the reported log-prob of the chosen token is ``log_softmax(z)[token]``
(T = temperature, or 1 for greedy rows) - the distribution RL's importance ratios need: the model's
logits at the rollout temperature, WITHOUT top-k/top-p/min-p truncation and without the min_tokens
EOS mask. Top-k alternatives (``SamplingParams.logprobs``) come from the same distribution.

Sampling itself then masks ``z`` with top-k, top-p (nucleus, always keeping the top token) and min-p
(drop p < min_p * p_max), and draws by the exponential race ``argmax(p / E)`` with ``E ~ Exp(1)``,
which is an exact categorical draw. A seeded request draws its ``E`` from its own ``torch.Generator``,
so its tokens do not depend on what else is in the batch; unseeded rows share one batched draw.
Greedy rows (T == 0) take ``argmax(logits)``.

This module does not decide when a sequence stops; it only applies the min_tokens mask it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.infer.sampling_params import sample_seed
from polyrl.infer.sequence import Sequence


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


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


def _generator(seq: Sequence, device: torch.device) -> torch.Generator:
    if seq.generator is None:
        g = torch.Generator(device=device)
        g.manual_seed(sample_seed(seq.params.seed, seq.index))
        seq.generator = g
    return seq.generator


class Sampler:
    """Stateless apart from the per-sequence generators it stores on the sequences."""

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], suppress: list[list[int] | None] | None = None
    ) -> SamplerOutput:
        """``logits`` fp32 ``[B, V]`` for ``seqs``; ``suppress[b]`` are token ids to forbid in row b (min_tokens)."""
        B, V = logits.shape
        dev = logits.device
        logits = logits.float()
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
        z = logits / temps[:, None]
        report = torch.log_softmax(z, dim=-1)  # [B, V] the reported distribution

        greedy = [p.greedy for p in params]
        masked = logits
        if suppress is not None and any(suppress):
            rows, cols = [], []
            for b, ids in enumerate(suppress):
                for t in ids or ():
                    if 0 <= t < V:
                        rows.append(b)
                        cols.append(t)
            if rows:
                masked = logits.clone()
                masked[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
                z = masked / temps[:, None]

        if all(greedy):
            tokens = masked.argmax(dim=-1)
        else:
            tokens = self._sample(z, masked, seqs, greedy)
        chosen = report.gather(-1, tokens[:, None])[:, 0]
        top = self._top_logprobs(report, params)
        return SamplerOutput(tokens.tolist(), chosen.tolist(), top)

    def _sample(self, z: torch.Tensor, masked: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        dev = z.device
        params = [s.params for s in seqs]
        top_k = top_p = min_p = None
        if any(p.uses_top_k for p in params):
            top_k = torch.tensor([p.top_k if p.uses_top_k else 0 for p in params], device=dev, dtype=torch.int64)
        if any(p.uses_top_p for p in params):
            top_p = torch.tensor([p.top_p if p.uses_top_p else 1.0 for p in params], device=dev)
        if any(p.uses_min_p for p in params):
            min_p = torch.tensor([p.min_p if p.uses_min_p else 0.0 for p in params], device=dev)
        z = apply_top_k_top_p_min_p(z, top_k, top_p, min_p)
        probs = torch.softmax(z, dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for b, s in enumerate(seqs):
            if s.params.seed is not None and not greedy[b]:
                noise[b].exponential_(generator=_generator(s, dev))
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            g = torch.tensor(greedy, device=dev)
            sampled = torch.where(g, masked.argmax(dim=-1), sampled)
        return sampled

    def _top_logprobs(self, report: torch.Tensor, params) -> list[dict[int, float] | None]:
        ks = [p.logprobs or 0 for p in params]
        kmax = max(ks)
        if kmax == 0:
            return [None] * len(params)
        vals, ids = report.topk(kmax, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        return [
            dict(zip(ids[b][:k], vals[b][:k])) if k else ({} if params[b].logprobs is not None else None)
            for b, k in enumerate(ks)
        ]
