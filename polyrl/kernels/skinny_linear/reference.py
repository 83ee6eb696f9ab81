"""skinny_linear reference: ``torch.nn.functional.linear`` (the spec is the plain product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, K] x [N, K]^T (+ [N]) -> [M, N]`` in ``x``'s dtype."""
    return F.linear(x, weight, bias)
