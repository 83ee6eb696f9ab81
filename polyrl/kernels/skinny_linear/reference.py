"""skinny_linear reference: ``torch.nn.functional.linear`` (the spec is the plain product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # the most rows the op takes (the Triton kernel's limit; the reference holds the spec)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor | tuple[torch.Tensor, ...],
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``[M, K] x [N, K]^T (+ [N]) -> [M, N]`` in ``x``'s dtype; several weights (and biases): their outputs side by
    side, ``[M, sum N_i]``."""
    if not isinstance(weight, (tuple, list)):
        return F.linear(x, weight, bias)
    biases = bias if bias is not None else [None] * len(weight)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weight, biases)], dim=-1)
