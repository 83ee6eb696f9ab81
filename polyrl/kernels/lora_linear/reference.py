"""lora_linear reference: ``x W^T + b + s * (x A^T) B^T`` as three linears, a scale and an add (what PEFT runs);
an NF4 base goes through ``kernels.nf4_matmul``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.kernels import ops as kernels
from polyrl.kernels.nf4.reference import NF4Weight


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | NF4Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    if isinstance(weight, NF4Weight):
        y = kernels.nf4_matmul(x, weight.packed, weight.absmax, weight.shape)
        y = y if bias is None else y + bias
    else:
        y = F.linear(x, weight, bias)
    return y + F.linear(F.linear(x, lora_a), lora_b) * scaling
