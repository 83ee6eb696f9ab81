"""The scaled FP8 GEMM through ``torch._scaled_mm`` (cuBLASLt tensor-wise; CUTLASS row-wise on sm89/sm90+),
same contract as ``reference.scaled_mm`` (``fp8/__init__.py``).

``torch._scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False)``
has had this keyword signature and a single tensor result since torch 2.5 through 2.13 (2.4 returned
``(out, amax)``; both shapes are accepted below). Its constraints, met here rather than by every caller:

- ``a`` row-major and ``b`` column-major (``b.t()`` contiguous): ``b`` is copied into that layout when it is not;
- ``K`` (``a``'s trailing dim) and both dims of ``b`` divisible by 16: zero-padded when not (zeros add nothing to
  the products; the output is sliced back). The training linear pads only the token dim of its weight-gradient
  GEMM this way (model widths are multiples of 16);
- row-wise scales need a bf16 output (``out_dtype`` float32 computes in bf16 and converts) and e4m3 operands on
  older torch, tensor-wise scales take any of bf16/fp16/fp32.

Not here: choosing scales or formats (the caller quantised ``a`` and ``b``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.platform import device

if device.device_type() == "cuda" and not device.supports_fp8_gemm():
    # the registry reports this implementation "unavailable" here and picks the reference
    raise ImportError("torch._scaled_mm needs FP8 tensor cores (CUDA capability >= 8.9 or ROCm gfx94x+)")


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    # F.pad has no fp8 kernel on every torch: pad the bytes
    out = torch.zeros((rows, cols), dtype=torch.uint8, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return out.view(t.dtype)


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` with fp32 accumulation (``use_fast_accum``: Hopper's faster, less exact
    accumulation, as torchao uses for the forward output), ``a [M, K]``, ``b [K, N]`` fp8 -> ``[M, N] out_dtype``."""
    m, k = a.shape
    n = b.shape[1]
    rowwise = scale_a.numel() != 1 or scale_b.numel() != 1
    kp, np_ = _round16(k), _round16(n)
    if a.stride(-1) != 1:
        a = a.contiguous()
    if kp != k:
        a = _pad_to(a, m, kp)
    bt = b.t()  # [N, K]: row-major here means b is column-major
    if not bt.is_contiguous():
        bt = bt.contiguous()
    if rowwise:
        scale_a, scale_b = scale_a.reshape(m, 1).contiguous(), scale_b.reshape(1, n).contiguous()
    if (np_, kp) != (n, k):
        bt = _pad_to(bt, np_, kp)
        if rowwise and np_ != n:
            scale_b = F.pad(scale_b, (0, np_ - n), value=1.0)
    mm_dtype = torch.bfloat16 if rowwise and out_dtype == torch.float32 else out_dtype
    out = torch._scaled_mm(
        a,
        bt.t(),
        scale_a=scale_a.float(),
        scale_b=scale_b.float(),
        out_dtype=mm_dtype,
        use_fast_accum=use_fast_accum,
    )
    if isinstance(out, tuple):  # torch 2.4: (out, amax)
        out = out[0]
    if np_ != n:
        out = out[:, :n]
    return out if mm_dtype == out_dtype else out.to(out_dtype)
