"""SwiGLU reference: silu(gate) * up in the input dtype (HF computes act_fn(gate) * up the same way)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
