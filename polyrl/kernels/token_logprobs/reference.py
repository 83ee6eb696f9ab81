"""Token log-prob reference: log_softmax(hidden @ W^T / temperature) at given tokens (+ entropy), fp32,
chunked over tokens in the forward."""

from __future__ import annotations

import torch

CHUNK_TOKENS = 4096


def token_logprobs(hidden, weight, tokens, temperature=1.0, return_entropy=False):
    lps, ents = [], []
    for start in range(0, hidden.shape[0], CHUNK_TOKENS):
        logits = (hidden[start : start + CHUNK_TOKENS] @ weight.t()).float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        lps.append(logp.gather(-1, tokens[start : start + CHUNK_TOKENS, None].long()).squeeze(-1))
        if return_entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logprobs = torch.cat(lps) if lps else empty
    if return_entropy:
        return logprobs, (torch.cat(ents) if ents else empty)
    return logprobs
