"""FP8 current-scaling quantisation in Triton, the same numbers as ``reference.quantize`` / ``reference.quantize_t``
(contract in ``fp8/__init__.py``).

Tensor-wise (``quantize``): a persistent amax pass (a fixed grid of at most ``_MAX_PARTIALS`` programs, each
reducing one contiguous chunk of ``x`` and writing its ``max|x|`` to its own slot of a partials buffer: no memset,
no atomics, deterministic), then the cast pass, each of whose programs folds the partials (a few KB from L2) into
``inv = FP8_MAX / max(amax, eps)`` (``div_rn``: the correctly rounded division torch does) and writes
``q = clamp(x * inv)`` in fp8; program 0 writes ``scale = 1 / inv``. Two reads of ``x`` are the minimum for
current scaling (the scale depends on every element). Row-wise: ``R`` rows per program, the row's amax then its
cast (the second read hits L1/L2).

With the transposed copy (``quantize_t``, what the FP8 linear's backward needs: ``q_t = q.t().contiguous()``, the
column-major operand of ``torch._scaled_mm``): the same amax pass, then a tiled cast that loads a ``[BM, BK]`` tile
of ``x`` once and writes both the tile of ``q [M, K]`` and, at transposed addresses, the tile of ``q_t [K, M]`` (the
compiler turns that store into a shared-memory transpose with coalesced writes). Row-wise (``rowwise=True``): ``q`` is
scaled per row and ``q_t`` tensor-wise (the backward's GEMMs take tensor-wise operands); the amax pass then writes
the per-row amax and the partials of the global one in the same read.

The cast itself: on the GPU the hardware's fp32 -> fp8 conversion (``cvt.rn.satfinite``: round to nearest even,
what torch's cast does; the value is already clamped). Under the interpreter the value is first rounded on the
fp8 grid in fp32 (``_fp8_round``) because the interpreter's own conversion drops the carry into the exponent. On the
device that rounding costs ~20 integer ops per element: by arithmetic (not yet profiled) about as long as the
memory traffic, the likely part of the 2x gap to torch.compile's cast measured on the H200.

Delayed scaling (``quantize_t_delayed``, the FP8 linear's gradient cast): the same tiled cast, its scale read from
the state's previous amax instead of an amax pass, so one pass reads ``x`` once; each program also folds its
tile's amax into the state (an integer ``atomic_max`` on the fp32 bits, order-independent: deterministic) and a
one-thread launch after it moves that amax into place for the next call (kernel docstring).

No host synchronisation anywhere, so all of it can be captured in a CUDA graph.

Deliberately not here: an amax history longer than one call, block-wise (1 x 128) scales.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from triton import knobs

from polyrl.kernels.fp8 import reference
from polyrl.kernels.fp8.reference import AMAX_CAP, DELAYED_HEADROOM, EPS, FP8_MAX
from polyrl.platform import device

if device.device_type() == "cuda" and not device.supports_fp8_gemm():
    # Triton has no fp8e4nv conversion below sm89: the registry reports this implementation "unavailable" here
    raise ImportError("Triton's FP8 casts need CUDA capability >= 8.9 (or ROCm gfx94x+)")

# (mantissa bits, smallest normal exponent) of each format
_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
_MAX_PARTIALS = 1024  # programs of the tensor-wise amax pass (and the partials each cast program folds)
# Round on the fp8 grid in fp32 before the conversion on the device too (the interpreter always does). Off: the
# hardware conversion (sm89+: cvt.rn.satfinite, bit-equal to torch's cast, checked by the GPU tests at real shapes);
# on: exact on any backend whose conversion rounds otherwise, at ~20 integer ops per element.
GRID_ROUND_ON_DEVICE = False
# The tiled cast writing q and q^T in one pass. Off: ``quantize`` and a transposing copy (the same numbers, one more
# read and write of the fp8 tensor): the escape hatch if a Triton version miscompiles the transposed store
# (triton-lang/triton#11111 is such a bug for NaN-propagating min/max, which this kernel does not use).
FUSED_CAST_T = True


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return bool(knobs.runtime.interpret)


def _grid_round() -> bool:
    return GRID_ROUND_ON_DEVICE or interpreting()


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
def _scaled(x, inv, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, GRID_ROUND: tl.constexpr):
    """``clamp(x * inv, -FMAX, FMAX)`` in fp32, ready for the (round-to-nearest-even) conversion to fp8; on the fp8
    grid already with ``GRID_ROUND``."""
    fmax = tl.full([], FMAX, tl.float32)
    v = tl.minimum(tl.maximum(x * inv, -fmax), fmax)
    if GRID_ROUND:
        v = _fp8_round(v, MBITS, EMIN)
    return v


@triton.jit
def _inv_from_partials(part_ptr, n_part, FMAX: tl.constexpr, EPS: tl.constexpr, PBLOCK: tl.constexpr):
    """``FMAX / max(max(partials), EPS)`` (fp32, correctly rounded): the tensor-wise quantisation scale."""
    acc = tl.zeros([PBLOCK], dtype=tl.float32)
    for start in range(0, n_part, PBLOCK):
        offs = start + tl.arange(0, PBLOCK)
        acc = tl.maximum(acc, tl.load(part_ptr + offs, mask=offs < n_part, other=0.0))
    amax = tl.max(acc, axis=0)
    return tl.math.div_rn(tl.full([], FMAX, tl.float32), tl.maximum(amax, tl.full([], EPS, tl.float32)))


@triton.jit
def _amax_partials_kernel(x_ptr, part_ptr, n, iters, BLOCK: tl.constexpr):
    """Program ``p`` reduces the contiguous elements ``[p * iters * BLOCK, (p + 1) * iters * BLOCK)`` of flat ``x``
    to ``part[p] = max|x|`` (max is exact in any order: the result does not depend on the split)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * iters * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(iters):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = tl.maximum(acc, tl.abs(x).to(tl.float32))
    tl.store(part_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def _row_amax_kernel(x_ptr, rowamax_ptr, part_ptr, m, k, stride_x, R: tl.constexpr, BLOCK: tl.constexpr):
    """``R`` rows per program: ``rowamax[r] = max|x[r]|`` and ``part[p]`` = the max over the program's rows."""
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    rmask = rows < m
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([R, BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols[None, :], mask=rmask[:, None] & (cols[None, :] < k), other=0.0)
        acc = tl.maximum(acc, tl.abs(x).to(tl.float32))
    ra = tl.max(acc, axis=1)
    tl.store(rowamax_ptr + rows, ra, mask=rmask)
    tl.store(part_ptr + pid, tl.max(ra, axis=0))


@triton.jit
def _cast_kernel(
    x_ptr, q_ptr, part_ptr, scale_ptr, n, n_part,
    FMAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr, MBITS: tl.constexpr,
    EMIN: tl.constexpr, GRID_ROUND: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    inv = _inv_from_partials(part_ptr, n_part, FMAX, EPS, PBLOCK)
    if pid == 0:
        tl.store(scale_ptr, tl.math.div_rn(tl.full([], 1.0, tl.float32), inv))
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = _scaled(x, inv, FMAX, MBITS, EMIN, GRID_ROUND).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + offs, q, mask=mask)


@triton.jit
def _rowwise_kernel(
    x_ptr, q_ptr, scale_ptr, m, k, stride_x, stride_q,
    FMAX: tl.constexpr, EPS: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, MBITS: tl.constexpr,
    EMIN: tl.constexpr, GRID_ROUND: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    rmask = rows < m
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    q_base = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    acc = tl.zeros([R, BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_base + cols[None, :], mask=rmask[:, None] & (cols[None, :] < k), other=0.0)
        acc = tl.maximum(acc, tl.abs(x).to(tl.float32))
    fmax = tl.full([R], FMAX, tl.float32)
    inv = tl.math.div_rn(fmax, tl.maximum(tl.max(acc, axis=1), tl.full([R], EPS, tl.float32)))
    tl.store(scale_ptr + rows, tl.math.div_rn(tl.full([R], 1.0, tl.float32), inv), mask=rmask)
    for start in range(0, k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols[None, :] < k)
        x = tl.load(x_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _scaled(x, inv[:, None], FMAX, MBITS, EMIN, GRID_ROUND).to(q_ptr.dtype.element_ty)
        tl.store(q_base + cols[None, :], q, mask=mask)


@triton.jit
def _cast_t_kernel(
    x_ptr, q_ptr, qt_ptr, part_ptr, rowamax_ptr, scale_ptr, scale_t_ptr, state_ptr, m, m_pad, k, n_part, stride_x,
    FMAX: tl.constexpr, EPS: tl.constexpr, ROWWISE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    PBLOCK: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, GRID_ROUND: tl.constexpr, DELAYED: tl.constexpr,
    RECORD: tl.constexpr, HEADROOM: tl.constexpr, AMAX_CAP: tl.constexpr,
):  # fmt: skip
    """One ``[BM, BK]`` tile of ``x [m, k]`` read once: ``q`` (row-wise or tensor-wise scaled) written row-major and
    the tensor-wise ``q_t [k, m_pad]`` written as the tile's transpose; rows ``m <= r < m_pad`` of ``x`` read as
    zeros, so they write the zero padding columns of ``q_t``.

    Delayed scaling (tensor-wise only): ``DELAYED`` takes the scale from the previous call's amax (``state[0]``,
    fp32 bits) instead of the partials of an amax pass; ``RECORD`` (with or without ``DELAYED``) records this
    tensor's amax: each program ``atomic_max``-es its tile's amax into ``state[1]`` (non-negative fp32 bits order as
    int32; relaxed: nothing waits on it), and ``_roll_kernel``, launched next on the same stream, moves it to
    ``state[0]`` for the next call. No program of this launch can see this call's amax in ``state[0]``."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    rmask = rows < m
    mask = rmask[:, None] & (cols[None, :] < k)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
    if DELAYED:
        prev = tl.load(state_ptr).to(tl.float32, bitcast=True)
        amax_d = tl.maximum(prev, tl.full([], EPS, tl.float32)) * HEADROOM  # a power of two: exact
        inv_t = tl.math.div_rn(tl.full([], FMAX, tl.float32), amax_d)
    else:
        inv_t = _inv_from_partials(part_ptr, n_part, FMAX, EPS, PBLOCK)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(scale_t_ptr, tl.math.div_rn(tl.full([], 1.0, tl.float32), inv_t))
    qt = _scaled(x, inv_t, FMAX, MBITS, EMIN, GRID_ROUND).to(qt_ptr.dtype.element_ty)
    if ROWWISE:
        ra = tl.load(rowamax_ptr + rows, mask=rmask, other=1.0)
        inv_r = tl.math.div_rn(tl.full([BM], FMAX, tl.float32), tl.maximum(ra, tl.full([BM], EPS, tl.float32)))
        if pid_k == 0:
            tl.store(scale_ptr + rows, tl.math.div_rn(tl.full([BM], 1.0, tl.float32), inv_r), mask=rmask)
        q = _scaled(x, inv_r[:, None], FMAX, MBITS, EMIN, GRID_ROUND).to(q_ptr.dtype.element_ty)
    else:
        q = qt
    tl.store(q_ptr + rows64[:, None] * k + cols64[None, :], q, mask=mask)
    # the same tile stored at its transposed addresses (rows are contiguous in q_t): the compiler's coalescing pass
    # moves it through shared memory so that the stores are row-contiguous. Not ``tl.trans`` of the fp8 tile: that
    # corrupts fp8 tiles on some Triton versions (3.7.1 on H100, pith-train #74)
    mask_t = (rows[:, None] < m_pad) & (cols[None, :] < k)
    tl.store(qt_ptr + cols64[None, :] * m_pad + rows64[:, None], qt, mask=mask_t)
    if RECORD:
        tile_amax = tl.minimum(tl.max(tl.abs(x)), tl.full([], AMAX_CAP, tl.float32))
        tl.atomic_max(state_ptr + 1, tile_amax.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _roll_kernel(state_ptr):
    """``state[0] = state[1]; state[1] = 0``: the amax the cast just recorded becomes the next call's."""
    tl.store(state_ptr, tl.load(state_ptr + 1))
    tl.store(state_ptr + 1, 0)


def _programs(dev: torch.device) -> int:
    """Programs of the tensor-wise amax pass: four per multiprocessor (4 on the CPU)."""
    return min(_MAX_PARTIALS, 4 * device.multiprocessors(dev))


def _check(fp8_dtype: torch.dtype) -> tuple[float, int, int]:
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"fp8_quantize: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    return (FP8_MAX[fp8_dtype], *_GRID[fp8_dtype])


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() != 2 else x.detach()
    return x2 if x2.stride(-1) == 1 and (x2.shape[0] <= 1 or x2.stride(0) >= x2.shape[1]) else x2.contiguous()


def _tensor_amax_partials(xc: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The amax pass over contiguous ``xc``: (partials fp32 ``[P]``, P)."""
    n = xc.numel()
    block = 1024 if interpreting() else 8192  # 32 elements per thread per step at 8 warps: bytes in flight
    blocks = triton.cdiv(max(n, 1), block)
    iters = triton.cdiv(blocks, _programs(xc.device))
    n_part = triton.cdiv(blocks, iters)
    part = torch.empty(n_part, dtype=torch.float32, device=xc.device)
    _amax_partials_kernel[(n_part,)](xc, part, n, iters, BLOCK=block, num_warps=8)
    return part, n_part


def _row_block(k: int) -> tuple[int, int]:
    """(rows per program R, BLOCK columns) for row-wise passes over rows of ``k``: ~4096 elements per program step."""
    block = min(4096, max(16, triton.next_power_of_2(k)))
    return max(1, min(64, 4096 // block)), block


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] fp8_dtype, scale fp32 [] or [M, 1])`` with ``x ~= q.float() * scale``."""
    fmax, mbits, emin = _check(fp8_dtype)
    grid_round = _grid_round()
    if rowwise:
        x2 = _as_2d(x)
        m, k = x2.shape
        q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            r, block = _row_block(k)
            _rowwise_kernel[(triton.cdiv(m, r),)](
                x2, q, scale, m, k, x2.stride(0), q.stride(0), FMAX=fmax, EPS=EPS, R=r, BLOCK=block, MBITS=mbits,
                EMIN=emin, GRID_ROUND=grid_round, num_warps=4,
            )  # fmt: skip
        return q.view(x.shape), scale.view(*x.shape[:-1], 1)
    xc = x.detach().contiguous()
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    part, n_part = _tensor_amax_partials(xc)
    block = 1024 if interpreting() else 4096
    pblock = min(_MAX_PARTIALS, triton.next_power_of_2(n_part))
    _cast_kernel[(triton.cdiv(max(xc.numel(), 1), block),)](
        xc, q, part, scale, xc.numel(), n_part, FMAX=fmax, EPS=EPS, BLOCK=block, PBLOCK=pblock, MBITS=mbits,
        EMIN=emin, GRID_ROUND=grid_round, num_warps=8,
    )  # fmt: skip
    return q, scale


_FUSED_FAILED: list[str] = []  # why the tiled cast could not be built on this device (then: cast + copy)


def _try_fused(op: str, instead: str, fn, *args):
    """``fn(*args)`` (a tiled cast), or None once it failed to compile: the failure is recorded in ``_FUSED_FAILED``
    (every tiled cast is skipped from then on) and reported once, and the caller takes its plain path. Out of memory
    and any error under the Triton interpreter (the CPU tests) are raised."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a compile failure of this kernel only; reported, then worked around
        if interpreting():
            raise
        _FUSED_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        warnings.warn(f"{op}: the fused Triton cast failed ({_FUSED_FAILED[0]}); using {instead} instead (slower, "
                      "same numbers)", RuntimeWarning, 3)  # fmt: skip
        return None


def quantize_t(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False, pad_t: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q, scale, q_t, scale_t)``: ``(q, scale) = quantize(x, fp8_dtype, rowwise)`` and the
    tensor-wise ``q_t [K, M_pad]`` (contiguous: ``quantize(x, fp8_dtype)[0].t()``, zero columns up to ``M_pad``, a
    multiple of ``pad_t``) with ``scale_t []`` (tensor-wise: the same tensor as ``scale``), from one amax pass and
    one tiled cast (which writes the zero columns too). Where the tiled cast fails
    to compile (a Triton backend without the transposing layout conversion) it warns once and gives the same
    numbers from ``quantize`` and a transposing copy."""
    if FUSED_CAST_T and not _FUSED_FAILED:
        out = _try_fused(
            "fp8_quantize_t", "a cast and a transposing copy", _quantize_t_fused, x, fp8_dtype, rowwise, pad_t
        )
        if out is not None:
            return out
    q, scale = quantize(x, fp8_dtype, rowwise)
    q_t, scale_t = (q, scale) if not rowwise else quantize(x, fp8_dtype, False)
    q_t = q_t.reshape(-1, x.shape[-1]).t()
    m_pad = triton.cdiv(q_t.shape[1], pad_t) * pad_t
    out = torch.zeros((q_t.shape[0], m_pad), dtype=torch.uint8, device=x.device)
    out[:, : q_t.shape[1]] = q_t.view(torch.uint8)
    return q, scale, out.view(fp8_dtype), scale_t


def _quantize_t_fused(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, pad_t: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fmax, mbits, emin = _check(fp8_dtype)
    grid_round = _grid_round()
    x2 = _as_2d(x)
    m, k = x2.shape
    dev = x.device
    q = torch.empty((m, k), dtype=fp8_dtype, device=dev)
    m_pad = triton.cdiv(m, pad_t) * pad_t
    q_t = torch.empty((k, m_pad), dtype=fp8_dtype, device=dev)
    scale_t = torch.empty((), dtype=torch.float32, device=dev)
    scale = torch.empty((m, 1), dtype=torch.float32, device=dev) if rowwise else scale_t
    if rowwise:
        r, block = _row_block(k)
        n_part = max(1, triton.cdiv(m, r))
        part = torch.empty(n_part, dtype=torch.float32, device=dev)
        rowamax = torch.empty(max(m, 1), dtype=torch.float32, device=dev)
        if m:
            _row_amax_kernel[(n_part,)](x2, rowamax, part, m, k, x2.stride(0), R=r, BLOCK=block, num_warps=4)
        else:
            part.zero_()
    else:
        x2 = x2.contiguous()
        part, n_part = _tensor_amax_partials(x2)
        rowamax = part  # unused
    bm = bk = _tile()
    if m and k:
        _cast_t_kernel[(triton.cdiv(m_pad, bm), triton.cdiv(k, bk))](
            x2, q, q_t, part, rowamax, scale, scale_t, scale_t, m, m_pad, k, n_part, x2.stride(0), FMAX=fmax,
            EPS=EPS, ROWWISE=rowwise, BM=bm, BK=bk, PBLOCK=min(_MAX_PARTIALS, triton.next_power_of_2(n_part)),
            MBITS=mbits, EMIN=emin, GRID_ROUND=grid_round, DELAYED=False, RECORD=False, HEADROOM=DELAYED_HEADROOM,
            AMAX_CAP=AMAX_CAP, num_warps=8,
        )  # fmt: skip
    else:  # nothing to cast: the scale an all-zero tensor gets (amax floored at EPS)
        scale_t.copy_(torch.ones((), device=dev).div(torch.full((), fmax, device=dev).div(EPS)))
    return q.view(x.shape), scale.view(*x.shape[:-1], 1) if rowwise else scale, q_t, scale_t


def _tile() -> int:
    """The tiled cast's square tile: 128 on the device, 16 under the interpreter (its programs run one by one)."""
    return 16 if interpreting() else 128


def quantize_t_delayed(
    x: torch.Tensor, fp8_dtype: torch.dtype, state: torch.Tensor, ready: bool, pad_t: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.quantize_t_delayed`` in one pass of the tiled cast once ``ready`` (the scale from ``state[0]``,
    this call's amax recorded by the same read of ``x``); the site's first call (not ``ready``) runs the amax pass
    first (the current scale) and records its amax the same way. Same numbers as the reference. Where the tiled
    cast cannot be built (``quantize_t``'s fallback: ``FUSED_CAST_T`` off or its compile failed) the reference runs
    (same numbers, on the device, slower)."""
    _check(fp8_dtype)
    if state.dtype != torch.int32 or state.shape != (2,) or state.device != x.device:
        raise ValueError(
            f"fp8_quantize_t_delayed: state must be int32 [2] on {x.device}, got {state.dtype} {tuple(state.shape)} "
            f"on {state.device}"
        )
    if FUSED_CAST_T and not _FUSED_FAILED and x.numel():
        out = _try_fused(
            "fp8_quantize_t_delayed", "the reference", _quantize_t_delayed_fused, x, fp8_dtype, state, ready, pad_t
        )
        if out is not None:
            return out
    return reference.quantize_t_delayed(x, fp8_dtype, state, ready, pad_t)


def _quantize_t_delayed_fused(
    x: torch.Tensor, fp8_dtype: torch.dtype, state: torch.Tensor, ready: bool, pad_t: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fmax, mbits, emin = _check(fp8_dtype)
    x2 = _as_2d(x).contiguous()
    m, k = x2.shape
    dev = x.device
    q = torch.empty((m, k), dtype=fp8_dtype, device=dev)
    m_pad = triton.cdiv(m, pad_t) * pad_t
    q_t = torch.empty((k, m_pad), dtype=fp8_dtype, device=dev)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    if ready:
        part, n_part = scale, 1  # not read (DELAYED)
    else:
        part, n_part = _tensor_amax_partials(x2)
    bm = bk = _tile()
    _cast_t_kernel[(triton.cdiv(m_pad, bm), triton.cdiv(k, bk))](
        x2, q, q_t, part, scale, scale, scale, state, m, m_pad, k, n_part, x2.stride(0), FMAX=fmax, EPS=EPS,
        ROWWISE=False, BM=bm, BK=bk, PBLOCK=min(_MAX_PARTIALS, triton.next_power_of_2(n_part)), MBITS=mbits,
        EMIN=emin, GRID_ROUND=_grid_round(), DELAYED=ready, RECORD=True, HEADROOM=DELAYED_HEADROOM,
        AMAX_CAP=AMAX_CAP, num_warps=8,
    )  # fmt: skip
    _roll_kernel[(1,)](state, num_warps=1)
    return q.view(x.shape), scale, q_t, scale
