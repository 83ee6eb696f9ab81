"""Linear + cross-entropy reference: logits in fp32 over vocab chunks of tokens, never all [T, V] at once
in the forward. (Autograd still keeps each chunk's logits for backward; the Triton version does not.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 4096


def linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="sum"):
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    losses = []
    for start in range(0, hidden.shape[0], CHUNK_TOKENS):
        logits = (hidden[start : start + CHUNK_TOKENS] @ weight.t()).float()
        losses.append(
            F.cross_entropy(logits, labels[start : start + CHUNK_TOKENS], ignore_index=ignore_index, reduction="none")
        )
    per_token = torch.cat(losses) if losses else hidden.new_zeros(0, dtype=torch.float32)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (labels != ignore_index).sum().clamp(min=1)
