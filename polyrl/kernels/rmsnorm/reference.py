"""RMSNorm reference (the spec): statistics in fp32, output in the input dtype, as HF Llama/Qwen do."""

from __future__ import annotations

import torch


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        summed = x
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (y, summed) if residual is not None else y
