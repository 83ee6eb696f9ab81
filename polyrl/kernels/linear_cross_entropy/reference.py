"""Linear + cross-entropy reference: logits in fp32 over chunks of tokens, never all [T, V] at once in the
forward. (Autograd still keeps each chunk's logits for backward; the Triton version does not.)

The spec: ``F.cross_entropy((hidden @ weight^T).float(), labels, ignore_index)`` per token; ignored tokens
contribute 0; "mean" divides by the non-ignored count (0 targets -> 0, not NaN). Logits are computed in the
input dtype and then upcast to fp32 (fp64 inputs stay fp64, so validation can use an fp64 reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 4096


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype == torch.float64 else logits.float()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "sum",
) -> torch.Tensor:
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    losses = []
    for start in range(0, hidden.shape[0], CHUNK_TOKENS):
        logits = _upcast(hidden[start : start + CHUNK_TOKENS] @ weight.t())
        losses.append(
            F.cross_entropy(logits, labels[start : start + CHUNK_TOKENS], ignore_index=ignore_index, reduction="none")
        )
    per_token = torch.cat(losses) if losses else _upcast((hidden @ weight.t()).sum(-1))
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (labels != ignore_index).sum().clamp(min=1)
