"""FP8 current-scaling quantisation in Triton, the same numbers as ``reference.quantize`` (contract in
``fp8/__init__.py``).

Tensor-wise: one persistent pass reduces ``max|x|`` per program and folds it into one fp32 word with
``atomic_max`` (|x| >= 0, so float max is order-independent: the result is exact and deterministic); a second
pass reads that word, forms ``inv = FP8_MAX / max(amax, eps)`` (``div_rn``: the correctly rounded division torch
does) and writes ``q = clamp(x * inv)`` in fp8; program 0 writes ``scale = 1 / inv``. Two reads of ``x`` are
the minimum for current scaling (the scale depends on every element). Row-wise: one program per row walks the row
twice in ``BLOCK`` chunks (amax, then the cast; the second read mostly hits L2). No host synchronisation anywhere,
so both can be captured in a CUDA graph.

Deliberately not here: writing the transposed copy in the same pass (the FP8 linear transposes with a copy),
delayed scaling (amax history), block-wise (1 x 128) scales.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from polyrl.kernels.fp8.reference import EPS, FP8_MAX
from polyrl.platform import device

if device.device_type() == "cuda" and not device.supports_fp8_gemm():
    # Triton has no fp8e4nv conversion below sm89: the registry reports this implementation "unavailable" here
    raise ImportError("Triton's FP8 casts need CUDA capability >= 8.9 (or ROCm gfx94x+)")

# (mantissa bits, smallest normal exponent) of each format
_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _pow2(k):
    """2^k as fp32 for an int32 exponent k in the normal range (built from the bits: exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_round(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """``v`` (fp32, already clamped to the fp8 range) rounded to nearest-even on the fp8 grid of ``MBITS`` mantissa
    bits and smallest normal exponent ``EMIN``, still fp32. The cast to fp8 is then exact, whatever rounding that
    conversion does (the Triton 3.9 interpreter's fp32 -> e4m3 cast drops the carry into the exponent: 125.9 -> 64)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    k = tl.maximum(e, EMIN) - MBITS  # the grid step is 2^k
    y = tl.abs(v) * _pow2(-k)  # |y| <= 2^(MBITS+1): exact
    magic = 12582912.0  # 1.5 * 2^23: (y + magic) - magic rounds y to an integer, ties to even
    r = ((y + magic) - magic) * _pow2(k)
    # the sign put back from v's sign bit: a tiny negative value rounds to -0 (as torch's cast gives), not +0
    return tl.where(bits < 0, -r, r)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, iters, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(iters):
        offs = (pid.to(tl.int64) * iters + i) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _cast_kernel(
    x_ptr, q_ptr, amax_ptr, scale_ptr, n,
    FMAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    fmax = tl.full([], FMAX, tl.float32)
    inv = tl.math.div_rn(fmax, tl.maximum(tl.load(amax_ptr), tl.full([], EPS, tl.float32)))
    if pid == 0:
        tl.store(scale_ptr, tl.math.div_rn(tl.full([], 1.0, tl.float32), inv))
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = _fp8_round(tl.minimum(tl.maximum(x * inv, -fmax), fmax), MBITS, EMIN)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rowwise_kernel(
    x_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q,
    FMAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
):  # fmt: skip
    fmax = tl.full([], FMAX, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    inv = tl.math.div_rn(fmax, tl.maximum(tl.max(acc, axis=0), tl.full([], EPS, tl.float32)))
    tl.store(scale_ptr + row, tl.math.div_rn(tl.full([], 1.0, tl.float32), inv))
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = _fp8_round(tl.minimum(tl.maximum(x * inv, -fmax), fmax), MBITS, EMIN)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=16)
def _programs(device: torch.device) -> int:
    """Programs of the amax pass: four per multiprocessor (4 on the CPU), asked once per device."""
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and backend is not None and hasattr(backend, "get_device_properties"):
        return 4 * int(getattr(backend.get_device_properties(device), "multi_processor_count", 1))
    return 4


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] fp8_dtype, scale fp32 [] or [M, 1])`` with ``x ~= q.float() * scale``."""
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"fp8_quantize: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    fmax = FP8_MAX[fp8_dtype]
    mbits, emin = _GRID[fp8_dtype]
    x = x.detach()
    if rowwise:
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m, k = x2.shape
        q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            block = min(4096, max(16, triton.next_power_of_2(k)))
            _rowwise_kernel[(m,)](
                x2, q, scale, k, x2.stride(0), q.stride(0), FMAX=fmax, EPS=EPS, BLOCK=block, MBITS=mbits, EMIN=emin
            )
        return q.view(x.shape), scale.view(*x.shape[:-1], 1)
    xc = x.contiguous()
    n = xc.numel()
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    block = 4096
    blocks = triton.cdiv(max(n, 1), block)
    iters = triton.cdiv(blocks, _programs(x.device))
    _amax_kernel[(triton.cdiv(blocks, iters),)](xc, amax, n, iters, BLOCK=block)
    _cast_kernel[(blocks,)](xc, q, amax, scale, n, FMAX=fmax, EPS=EPS, BLOCK=block, MBITS=mbits, EMIN=emin)
    return q, scale
