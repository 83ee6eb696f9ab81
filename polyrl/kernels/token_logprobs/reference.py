"""Token log-prob reference: log_softmax(hidden @ W^T / temperature) at given tokens (+ entropy), fp32,
chunked over tokens in the forward.

Logits are computed in the input dtype and then upcast to fp32 before the temperature (fp64 inputs stay
fp64, so validation can use an fp64 reference). Entropy is ``-sum(p * log p)`` of the tempered distribution.
Tokens must lie in [0, V) (``gather`` raises otherwise).
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 4096


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype == torch.float64 else logits.float()


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    lps, ents = [], []
    for start in range(0, hidden.shape[0], CHUNK_TOKENS):
        logits = _upcast(hidden[start : start + CHUNK_TOKENS] @ weight.t()) / temperature
        logp = torch.log_softmax(logits, dim=-1)
        lps.append(logp.gather(-1, tokens[start : start + CHUNK_TOKENS, None].long()).squeeze(-1))
        if return_entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
    empty = _upcast((hidden @ weight.t()).sum(-1))  # [0], still connected to hidden and weight
    logprobs = torch.cat(lps) if lps else empty
    if return_entropy:
        return logprobs, (torch.cat(ents) if ents else empty)
    return logprobs
