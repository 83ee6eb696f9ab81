"""rmsnorm_linear reference: the unfused composition of the reference ops (rmsnorm, ``F.linear``, swiglu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.kernels.rmsnorm.reference import rmsnorm
from polyrl.kernels.swiglu.reference import swiglu

EPILOGUES = ("none", "swiglu")


def check_args(x, residual, norm_weight, weight, epilogue):
    """Shape and epilogue checks shared by the implementations (ValueError with the shapes)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"rmsnorm_linear: epilogue {epilogue!r} is not one of {EPILOGUES}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or norm_weight.shape != (x.shape[1],):
        raise ValueError(
            f"rmsnorm_linear: x {tuple(x.shape)}, norm_weight {tuple(norm_weight.shape)} and weight "
            f"{tuple(weight.shape)} must be [M, H], [H] and [N, H]"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rmsnorm_linear: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if epilogue == "swiglu" and weight.shape[0] % 2:
        raise ValueError(f"rmsnorm_linear: a swiglu weight is [2I, H] (gate rows, then up), got {tuple(weight.shape)}")


def rmsnorm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    epilogue: str = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, new_residual)``: ``y = rmsnorm(x + residual) @ weight^T`` (``"swiglu"``: ``silu(gate) * up`` of the
    fused gate/up output), ``new_residual = x + residual`` (None without a residual)."""
    check_args(x, residual, norm_weight, weight, epilogue)
    if residual is not None:
        h, new_residual = rmsnorm(x, norm_weight, eps, residual)
    else:
        h, new_residual = rmsnorm(x, norm_weight, eps), None
    y = F.linear(h, weight)
    if epilogue == "swiglu":
        inter = weight.shape[0] // 2
        y = swiglu(y[:, :inter], y[:, inter:])
    return y, new_residual
