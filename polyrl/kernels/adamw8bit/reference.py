"""8-bit AdamW, the spec: blockwise dynamic-map quantisation of both moments and the fused update, in plain PyTorch.

State of one parameter of N elements (flat, row-major):

- ``qm [N] uint8`` + ``am [ceil(N / BLOCK)] fp32``: the first moment ``m``, each element an index into the signed
  code ``SIGNED`` times its block's absmax;
- ``qs [N] uint8`` + ``as_ [ceil(N / BLOCK)] fp32``: the *square root* of the second moment, ``s = sqrt(v)``, as an
  index into the unsigned code ``UNSIGNED`` times its block's absmax.

Why these choices (docs/optim8.md has the longer version):

- ``BLOCK = 256``: an outlier coarsens only the 255 elements of its own block, and the fp32 absmax costs
  4 / 256 = 0.016 byte per element (1.6% of the 8-bit state); 2048 would cut that to 0.2% but let one large
  gradient flatten 2047 neighbours. 256 is also what bitsandbytes' blockwise optimizers use.
- dynamic (decade) maps, not linear ones: the moments of one block span orders of magnitude; a linear 8-bit grid
  rounds everything below absmax / 255 to zero. Each code gives every decade below 1 a linear grid, the top
  decade the most points: signed, 7 decades of 64, 32, ..., 1 magnitudes each side of 0 (255 values; index 255
  repeats 1.0 and is never chosen); unsigned, 8 decades of 128, ..., 1 magnitudes plus 0 (256 values).
- ``sqrt(v)`` is stored instead of ``v``: the update divides by ``sqrt(v) + eps``, so an element whose ``v`` falls
  below the code's smallest step becomes ``m / eps``, a huge step. In the square root the same 8 decades cover 16
  decades of ``v``; the relative error of the denominator is that of the code either way, within a factor 2.

Rounding is to the nearest code value (ties to the lower index): ``searchsorted`` over the midpoints of the
sorted code. The update of one element, in fp32, in exactly this order (the Triton kernel repeats it op by op, so
both give the same bits; no fused multiply-add):

    m = code_m[qm] * am ; s = code_s[qs] * as ; v = s * s
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    s = sqrt(v)
    p = p * (1 - lr * wd)                       # decoupled weight decay
    p = p - (m / (s * rsqrt_bc2 + eps)) * step_size  # lr / (1 - beta1^t); rsqrt_bc2 = 1 / sqrt(1 - beta2^t)
    am = max|m| over the block, qm = nearest(m / am) ; the same for s (absmax 0: divide by 1)

The scalars are computed in float64 on the host and rounded once to fp32 (``StepScalars``). This module does not
choose an implementation or own parameters (``polyrl.train.optim`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 256


def _decade_grid(counts: list[int]) -> list[float]:
    """Magnitudes in (0, 1]: decade d (d = 0 is (0.1, 1]) holds ``counts[d]`` points at the upper ends of equal
    sub-intervals of (0.1, 1] * 10^-d, so 1.0 is a code value and each lower decade is coarser."""
    out = []
    for d, n in enumerate(counts):
        out += [10.0**-d * (0.1 + 0.9 * k / n) for k in range(1, n + 1)]
    return out


def _signed_code() -> torch.Tensor:
    mags = _decade_grid([64, 32, 16, 8, 4, 2, 1])  # 127 magnitudes
    values = sorted([0.0] + mags + [-x for x in mags])  # 255 values
    values.append(1.0)  # pad to 256: a second 1.0 at the top, never the nearest (ties go to the lower index)
    return torch.tensor(values, dtype=torch.float32)


def _unsigned_code() -> torch.Tensor:
    mags = _decade_grid([128, 64, 32, 16, 8, 4, 2, 1])  # 255 magnitudes
    return torch.tensor(sorted([0.0] + mags), dtype=torch.float32)


SIGNED = _signed_code()
UNSIGNED = _unsigned_code()
SIGNED_ZERO = int((SIGNED == 0).nonzero()[0, 0])  # 127: the index of m = 0


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """``[255]`` fp32 rounding thresholds between consecutive code values."""
    return (code[:-1] + code[1:]) * 0.5


_TABLES: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def tables(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(signed code, its midpoints, unsigned code, its midpoints)`` on ``device`` (cached)."""
    device = torch.device(device)
    if device not in _TABLES:
        _TABLES[device] = tuple(t.to(device) for t in (SIGNED, midpoints(SIGNED), UNSIGNED, midpoints(UNSIGNED)))
    return _TABLES[device]


def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


@dataclass(frozen=True)
class StepScalars:
    """The update's scalars for step ``t`` (1-based), from float64 on the host; both implementations take these."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    decay: float  # 1 - lr * weight_decay
    step_size: float  # lr / (1 - beta1^t)
    rsqrt_bc2: float  # 1 / sqrt(1 - beta2^t)

    @classmethod
    def at(cls, t: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> StepScalars:
        if t < 1:
            raise ValueError(f"AdamW step count starts at 1, got {t}")
        bc1 = 1.0 - beta1**t
        bc2 = 1.0 - beta2**t
        return cls(beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, 1.0 - lr * weight_decay, lr / bc1, 1.0 / math.sqrt(bc2))


def quantize(x: torch.Tensor, code: torch.Tensor, mid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 ``x [N]`` -> ``(q [N] uint8, absmax [ceil(N / BLOCK)] fp32)``: nearest code of ``x / absmax``."""
    n = x.numel()
    nb = num_blocks(n)
    blocks = torch.nn.functional.pad(x.reshape(-1).float(), (0, nb * BLOCK - n)).view(nb, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normed = blocks / scale[:, None]
    q = torch.searchsorted(mid, normed.reshape(-1).contiguous(), right=False)
    return q[:n].to(torch.uint8), absmax


def dequantize(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """``(q [N], absmax [nb])`` -> fp32 ``[N]``: ``code[q] * absmax[block]``."""
    n = q.numel()
    scale = absmax.repeat_interleave(BLOCK)[:n]
    return code[q.reshape(-1).long()] * scale


def init_state(n: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Zero moments of a parameter of ``n`` elements (code index of 0.0, absmax 0)."""
    return {
        "qm": torch.full((n,), SIGNED_ZERO, dtype=torch.uint8, device=device),
        "am": torch.zeros(num_blocks(n), dtype=torch.float32, device=device),
        "qs": torch.zeros((n,), dtype=torch.uint8, device=device),  # UNSIGNED[0] == 0.0
        "as": torch.zeros(num_blocks(n), dtype=torch.float32, device=device),
    }


@torch.no_grad()
def adamw8bit_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    sc: StepScalars,
    param_out: torch.Tensor | None = None,
) -> None:
    """One 8-bit AdamW update of ``param`` (fp32 or bf16/fp16, contiguous) in place, ``state`` (``init_state``)
    requantised in place; ``param_out`` (optional, any float dtype, same numel) also receives the new weights
    (the compute copy of an fp32 master)."""
    code_m, mid_m, code_s, mid_s = tables(param.device)
    f32 = torch.float32

    def c(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=f32, device=param.device)

    p = param.reshape(-1).to(f32)
    g = grad.reshape(-1).to(f32)
    m = dequantize(state["qm"], state["am"], code_m)
    s = dequantize(state["qs"], state["as"], code_s)
    v = s * s
    m = m * c(sc.beta1) + g * c(sc.one_minus_beta1)
    v = v * c(sc.beta2) + (g * g) * c(sc.one_minus_beta2)
    # correctly rounded fp32 sqrt: torch's vectorised CPU sqrt is not (AVX-512 builds differ from IEEE in ~18% of
    # fp32 inputs); a float64 sqrt rounded once to fp32 is (53 >= 2 * 24 + 2 bits), as are CUDA's and Triton's sqrt_rn
    s = torch.sqrt(v.double()).float()
    p = p * c(sc.decay)
    p = p - (m / (s * c(sc.rsqrt_bc2) + c(sc.eps))) * c(sc.step_size)
    qm, am = quantize(m, code_m, mid_m)
    qs, as_ = quantize(s, code_s, mid_s)
    state["qm"].copy_(qm)
    state["am"].copy_(am)
    state["qs"].copy_(qs)
    state["as"].copy_(as_)
    param.copy_(p.view_as(param))
    if param_out is not None:
        param_out.copy_(p.view_as(param_out))
