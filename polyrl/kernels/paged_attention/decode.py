"""Paged attention for sequences with exactly one new token (decode), KV heads packed into one program; and the
combine of key-range splits (flash-decoding) that this kernel and ``triton.py``'s general kernel share.

Why a second kernel: the general kernel (``triton.py``) runs one program per (sequence, KV head). At decode that is
GROUP real query rows in a 16-row MMA and, at ~100-token contexts, two key tiles a program, so each program pays the
dependent-load chain (cu_seqlens -> context_lens -> block table -> K/V addresses -> data) for very little data, and
reads its K/V as 256-byte pieces at a ``Hk * D``-element stride (the cache is ``[blocks, page, Hk, D]``). Here a
program owns one sequence, HC consecutive KV heads and one key-range split:

* rows: all ``GROUP * HC`` query heads of those KV heads (query heads ``c*HC*GROUP + r`` for row ``r``, the natural
  order of q), padded to ``ROWS = max(16, pow2(GROUP * HC))``;
* key tile: BLOCK_N token positions x HC KV heads flattened token-major into ``TILE = BLOCK_N * HC`` rows of D, so
  with HC == Hk and BLOCK_N == page a tile is one page of the cache, one contiguous piece of memory;
* scores ``q [ROWS, D] @ K^T [D, TILE]`` masked block-diagonally (a row sees only the key rows of its own KV head)
  and by position (``k_pos < ctx``; sliding window ``ctx - 1 - k_pos < window``); the usual online softmax per row;
  ``P @ V [TILE, D]`` then gives each row exactly its own head's output (masked probabilities are exact zeros).

The block-diagonal mask wastes (HC - 1) / HC of the MMA FLOPs and of the softmax's elementwise work; decode attention
is far from compute bound, so that is free. Per key tile the two dots do ``4 * ROWS * TILE * D`` FLOPs for
``2 * TILE * D * elem`` bytes: ``2 * ROWS / elem`` FLOP/byte, 16 at ROWS 16 in bf16 and 64 at the ROWS cap 64 (128
over an FP8 cache), against an H200 ridge of ~200 (~990 TFLOP/s dense 16-bit MMA / 4.8 TB/s). The softmax touches
``ROWS / (2 * D * elem)`` scores a byte: at 4.8 TB/s and D 128 that is 0.15 G scores/us at ROWS 16 in bf16 (~4% of the
exp2 unit's ~4.2 G/us, ~5% of fp32 issue at ~10 ops a score), 1.2 G/us (~30%) at ROWS 64 over FP8. Hence the cap.

Everything the general kernel's decode path supports is kept: bf16/fp16/fp32 queries (fp32: ``ieee`` dots), FP8
e4m3 caches (``F16_DOTS``: see ``triton._f16_dots``), sliding windows, key-range splits (normalised partials + base-2
log-sum-exp, combined by ``_combine_splits_kernel``), no host reads (the grid comes from Python ints, each program
reads its sequence's bounds on the device and returns at once unless it has exactly one new token), so it is safe to
capture in a CUDA graph and to launch over a mixed batch next to the general kernel.

Batch invariance: a sequence's numbers depend on HC, BLOCK_N and num_warps (the order of the reductions and of the
MMA accumulation) and on the number of splits; ``decode_settings`` derives the first three from the head shapes and
dtypes only, never from the batch, and a split's key range ``[s * chunk, (s + 1) * chunk)`` from the block-table
width and the split count. The split count (``decode_splits``) does depend on the batch: it rises when sequences x
head chunks are too few to fill the GPU, exactly as the general kernel's rule does. So a sequence decodes to the same
numbers in any batch that gets the same split count (in particular in a mixed batch whose split count equals the
decode-only batch's), and not necessarily across that threshold. Without tuning, ``triton._paged_attention`` uses this
kernel only for batches with B * Hk >= 1024 (below that the general kernel serves decode rows, as before this module:
faster at small batches), a rule on the batch size alone, at the point where the general kernel's split count changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from polyrl.errors import ConfigError
from polyrl.kernels import pdl
from polyrl.kernels.pdl import launch_dependents as pdl_launch_dependents
from polyrl.kernels.pdl import wait as pdl_wait
from polyrl.platform import device as platform_device

# Query rows a program may hold (GROUP * HC, padded); see the arithmetic in the module docstring.
_MAX_ROWS = 64
# Shared memory one key tile of K + V may take (2 * TILE * D * elem bytes; one buffer at the default stages).
_STAGE_BYTES = 64 * 1024
# Splits stop once a split would cover fewer keys than this (a split reads keys x HC heads) ...
_MIN_KEYS_PER_SPLIT = 64
# ... or once sequences x head chunks x splits reach this (each program streams HC heads: ~2 per SM on an H200).
_TARGET_PROGRAMS = 256


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# Registers a thread may take over an FP8 cache: four 4-warp programs an SM (65,536 / (4 * 128)) instead of the three
# the uncapped kernel fits; applied only where that saves a wave of programs (see decode_settings).
_FP8_MAX_REGISTERS = 128
_FP8_PROGRAMS_PER_SM = (3, 4)  # (uncapped, capped), at the default 4 warps


def _register_cap_supported() -> bool:
    """Whether launches may pass ``maxnreg``: Triton's CUDA backend has the option (Triton >= 3.0) and the device is
    not a HIP one (Triton refuses launch options its backend does not know)."""
    if torch.version.hip is not None:
        return False
    try:
        # lazy: Triton's NVIDIA backend module, which a Triton build without it (or a future layout) may lack
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "maxnreg" in getattr(CUDAOptions, "__dataclass_fields__", {})


_REGISTER_CAP = _register_cap_supported()


@dataclass(frozen=True)
class DecodeSettings:
    kv_heads: int  # HC: KV heads per program (a power of two)
    block_n: int  # token positions per key tile (a power of two; TILE = block_n * kv_heads rows)
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # per thread (Triton's ``maxnreg``); None: the compiler's choice

    def launch_options(self) -> dict:
        """Triton launch options: warps, stages and, where the backend takes it, the register cap."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers and _REGISTER_CAP:
            options["maxnreg"] = self.max_registers
        return options


def decode_settings(
    group: int, num_kv_heads: int, head_dim: int, kv_elem: int, tuning: dict | None = None
) -> DecodeSettings:
    """Launch settings from the head shapes and the cache's element size only (so a sequence's numbers do not depend
    on its batch), each overridable through ``tuning`` (``kv_heads``, ``block_n``, ``num_warps``, ``num_stages``,
    ``max_registers``, 0 for no cap; ``scripts/paged_attention_sweep.py``). Set from that sweep on the H200 (Triton
    3.6; raw log compat/raw/h200-2026-12-03d/call3-tenth-kernels.log), against the general kernel's decode path
    ("rows"):

    * HC = min(Hk, 4, 16 // GROUP): 16 query rows at most (one MMA tile, no padding at GROUP 4) and at most 4 KV
      heads. HC 4 / 16-token tiles / 4 warps was within 2% of the best setting at every large-batch shape: B256 at 116
      cached tokens (qwen3-0.6b heads) 44.9 us vs rows 50.4 (x1.12), B256 ctx 256 76.0 vs 83.6 (x1.10), B512 ctx 192
      109.5 vs 112.0, qwen3-8b heads (Hq 32) B256 ctx 256 76.8 vs 83.9 (x1.09) over bf16 and 70.3 vs 80.5 (x1.15)
      over FP8; every KV head in one program (HC 8, 8 warps, the first guess) was 0.75x rows at the 8b shape;
    * block_n: one 16-token page, halved while a tile of K + V would pass _STAGE_BYTES (but at least 16 key rows a
      tile, the MMA's minimum);
    * 4 warps (8 were slower at every shape but the 4k contexts, by <= 1%);
    * stages 2 over a 16-bit cache (2 and 3 within 1%), 5 over FP8 (Triton 3.9 reads it as a double-buffered K/V;
      the best FP8 setting at the 8b shape);
    * over FP8, at most 128 registers a thread (``max_registers``, Triton's ``maxnreg``) where that saves a wave
      on a Hopper part (``register_cap``). Uncapped, the FP8 kernel compiles to 158 (its V tile reaches the PV dot
      through byte-wise shared-memory reads and e4m3 -> fp16 upcasts; the 16-bit kernel takes 122), so only three
      programs fit an SM: at qwen3-8b B256 the 512 programs ran in 1.29 waves, and the SMs idled through the partial
      one (Nsight Compute, raw logs compat/raw/h200-2026-12-04c). Capped at 128 four fit, one wave: 59.7 us against
      70.2 us (x1.18; 54% of the copy bandwidth instead of 46%), qwen3-0.6b heads 55.4 against 70.6. Where the
      uncapped programs fit one wave anyway the cap only costs (qwen3-8b B128 at 384 tokens: 58.3 against 49.4 us),
      hence the rule. The cap changes the register allocation, not the arithmetic: outputs are bitwise equal with and
      without it.

    Small batches (B * Hk below the general kernel's 1024-program target, where that kernel starts splitting the key
    range of wide block tables) keep the general kernel: at batch 1 it took 11.6 us at 192 tokens against 12.7-25 us
    here. ``triton._paged_attention`` decides on the batch size only."""
    tuning = tuning or {}
    hc = 1
    while hc * 2 <= min(num_kv_heads, 4) and group * hc * 2 <= 16:
        hc *= 2
    hc = int(tuning.get("kv_heads") or hc)
    block_n = 16
    while block_n * hc > 16 and 2 * block_n * hc * head_dim * kv_elem > _STAGE_BYTES:
        block_n //= 2
    block_n = int(tuning.get("block_n") or block_n)
    for name, value in (("kv_heads", hc), ("block_n", block_n)):
        if value < 1 or value & (value - 1):
            raise ConfigError(f"paged decode tuning: {name} must be a power of two, got {value}")
    if block_n * hc < 16:
        raise ConfigError(f"paged decode tuning: block_n * kv_heads must be >= 16 (the MMA's K); got {block_n} * {hc}")
    stages = 5 if kv_elem == 1 else 2
    cap = tuning.get("max_registers", _FP8_MAX_REGISTERS if kv_elem == 1 else None)
    warps, stages = int(tuning.get("num_warps") or 4), int(tuning.get("num_stages") or stages)
    return DecodeSettings(hc, block_n, warps, stages, int(cap) if cap else None)


def register_cap(
    settings: DecodeSettings,
    programs: int,
    multiprocessors: int,
    tuning: dict | None = None,
    capability: tuple[int, int] | None = (9, 0),
) -> DecodeSettings:
    """``settings`` with the FP8 register cap dropped unless it lets ``programs`` run in fewer waves over
    ``multiprocessors`` (a cap set through ``tuning`` is kept as given). Outputs do not depend on it. The program
    counts an SM are the 4-warp kernel's on a Hopper part (compute capability 9.x, 228 KB of shared memory an SM,
    where they were measured); elsewhere (Ada's 100 KB an SM fits fewer programs whatever their registers) the
    default cap is dropped."""
    if not settings.max_registers or "max_registers" in (tuning or {}):
        return settings
    if settings.num_warps != 4 or capability is None or capability[0] != 9:
        return replace(settings, max_registers=None)
    uncapped, capped = (-(-programs // (n * max(1, multiprocessors))) for n in _FP8_PROGRAMS_PER_SM)
    return settings if capped < uncapped else replace(settings, max_registers=None)


@functools.lru_cache(maxsize=16)
def _capability(dev: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``dev`` (None elsewhere: the CPU, HIP devices)."""
    if dev.type != "cuda" or torch.version.hip is not None:
        return None
    return platform_device.capability(dev.index or 0)


def decode_splits(programs: int, capacity: int) -> int:
    """Key-range splits for ``programs`` = sequences x head chunks over block tables of ``capacity`` tokens: doubled
    while the programs are fewer than _TARGET_PROGRAMS and each split keeps >= _MIN_KEYS_PER_SPLIT keys."""
    splits = 1
    while programs * splits < _TARGET_PROGRAMS and capacity // (2 * splits) >= _MIN_KEYS_PER_SPLIT:
        splits *= 2
    return splits


@triton.jit
def _paged_decode_kernel(
    Q,
    KC,
    VC,
    BT,
    CTX,
    CUQ,
    O,
    OP,
    LP,
    qk_scale,
    window,
    chunk,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    HC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F16_DOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before any load or store (kernels/pdl.py)
    b = tl.program_id(0)
    c = tl.program_id(1)  # chunk of HC KV heads
    split = tl.program_id(2)
    t = tl.load(CUQ + b)
    if tl.load(CUQ + b + 1) - t != 1:  # not a decode row (the general kernel serves it) or no new token
        return
    ctx = tl.load(CTX + b)  # keys 0..ctx-1 include the new token's, at position ctx - 1
    TILE: tl.constexpr = BLOCK_N * HC
    # Row r = query head c * HC * GROUP + r, of KV head c * HC + r // GROUP.
    r = tl.arange(0, ROWS)
    head = c * HC * GROUP + r
    row_valid = (r < HC * GROUP) & (c * HC + r // GROUP < num_kv_heads)
    offs_d = tl.arange(0, HEAD_DIM)
    t64 = t.to(tl.int64)
    q = tl.load(Q + t64 * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    if F16_DOTS:  # bf16 queries over an FP8 cache: both dots in fp16 (see triton._f16_dots)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Key row j = (token start + j // HC, KV head c * HC + j % HC); a row sees the key rows of its own KV head only.
    j = tl.arange(0, TILE)
    j_head = c * HC + j % HC
    own = (r // GROUP)[:, None] == (j % HC)[None, :]  # [ROWS, TILE], block-diagonal
    head_ok = j_head < num_kv_heads
    hi = ctx
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx - window, 0)
    if SPLIT:
        lo = tl.maximum(lo, split * chunk)
        hi = tl.minimum(hi, (split + 1) * chunk)
    lo = lo - lo % BLOCK_N  # tiles start at multiples of BLOCK_N (split bounds are multiples already)

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + j // HC
        k_valid = (k_pos < hi) & head_ok
        if PAGE % BLOCK_N == 0:  # the tile lies in one page: one block-table entry
            block = tl.load(bt_row + start // PAGE).to(tl.int64)
        else:
            block = tl.load(bt_row + k_pos // PAGE, mask=k_pos < hi, other=0).to(tl.int64)
        in_page = (k_pos % PAGE).to(tl.int64)
        slot_k = block * stride_kb + in_page * stride_ks + j_head * stride_kh
        slot_v = block * stride_vb + in_page * stride_vs + j_head * stride_vh
        kt = tl.load(KC + slot_k[None, :] + offs_d[:, None], mask=k_valid[None, :], other=0.0)  # [D, TILE]
        v = tl.load(VC + slot_v[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0)  # [TILE, D]
        qk = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PREC) * qk_scale
        allowed = own & k_valid[None, :]  # k_pos < hi <= ctx: causal for the one new token
        if WINDOW:
            allowed = allowed & ((ctx - 1 - k_pos) < window)[None, :]
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PREC)
        m_i = m_new

    pdl_launch_dependents(PDL)  # every load is done
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))  # -inf: this split saw no key
        part = split.to(tl.int64)
        tl.store(
            OP + part * stride_ps + t64 * stride_pt + head[:, None] * stride_ph + offs_d[None, :],
            out,
            mask=row_valid[:, None],
        )
        tl.store(LP + part * stride_ls + t64 * stride_lt + head, lse, mask=row_valid)
    else:
        tl.store(
            O + t64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit
def _combine_splits_kernel(
    OP,
    LP,
    O,
    CUQ,
    num_splits,
    num_heads,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BY_SEQ: tl.constexpr,
    DECODE_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before any load or store (kernels/pdl.py)
    # One program: one token, BLOCK_H heads; parts [SPLITS, BLOCK_H, D] weighted by exp2(lse - max lse).
    # BY_SEQ: program (b, head block, i) is token i of sequence b, combined only if the sequence has exactly one new
    # token (DECODE_ROWS) or only if it has more (not DECODE_ROWS): the tokens the other kernel owns are left alone.
    if BY_SEQ:
        b = tl.program_id(0)
        start = tl.load(CUQ + b)
        q_len = tl.load(CUQ + b + 1) - start
        i = tl.program_id(2)
        if DECODE_ROWS:
            if q_len != 1:
                return
        else:
            if q_len == 1:
                return
        if i >= q_len:
            return
        t = (start + i).to(tl.int64)
    else:
        t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = (s[:, None] < num_splits) & (h[None, :] < num_heads)  # [SPLITS, BLOCK_H]
    lse = tl.load(LP + s[:, None] * stride_ls + t * stride_lt + h[None, :], mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m[None, :])  # 0 for empty splits
    part_ptrs = OP + s[:, None, None] * stride_ps + t * stride_pt + h[None, :, None] * stride_ph + offs_d[None, None, :]
    parts = tl.load(part_ptrs, mask=(valid & (w > 0))[:, :, None], other=0.0)
    pdl_launch_dependents(PDL)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, :, None], 0) / tl.where(total > 0, total, 1.0)[:, None]  # [BLOCK_H, D]
    tl.store(
        O + t * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=h[:, None] < num_heads,
    )


def combine_splits(
    o_part: torch.Tensor,
    l_part: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    splits: int,
    by_seq: int = 0,
    decode_rows: bool = False,
) -> None:
    """Combine ``splits`` partial outputs ``o_part [splits, T, Hq, D]`` (fp32, normalised) with their base-2 LSEs
    ``l_part [splits, T, Hq]`` into ``out``: every token (``by_seq`` 0), or the tokens of the sequences with exactly
    one new token (``decode_rows``) / with more (not ``decode_rows``), ``by_seq`` = the most new tokens a sequence
    has (``max_seqlen_q``)."""
    T, Hq, D = out.shape
    block_h = min(_pow2_at_least(Hq), 16)
    grid = (cu_seqlens_q.shape[0] - 1, triton.cdiv(Hq, block_h), by_seq) if by_seq else (T, triton.cdiv(Hq, block_h))
    _combine_splits_kernel[grid](
        o_part, l_part, out, cu_seqlens_q, splits, Hq, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        l_part.stride(0), l_part.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=D, SPLITS=_pow2_at_least(splits), BLOCK_H=block_h, BY_SEQ=bool(by_seq), DECODE_ROWS=decode_rows,
        num_warps=4, **pdl.kernel_kwargs(out.device),
    )  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    out: torch.Tensor,
    qk_scale: float,
    window: int | None,
    f16_dots: bool,
    num_splits: int | None = None,
    tuning: dict | None = None,
) -> None:
    """Attention of the sequences with exactly one new token, written into ``out`` (other tokens untouched).
    ``qk_scale`` includes log2(e); ``q`` contiguous in the head dim; checks are the caller's (``triton.py``)."""
    _, Hq, D = q.shape
    _, page, Hk, _ = k_cache.shape
    B = block_tables.shape[0]
    group = Hq // Hk
    s = decode_settings(group, Hk, D, k_cache.element_size(), tuning)
    chunks = triton.cdiv(Hk, s.kv_heads)
    capacity = block_tables.shape[1] * page
    splits = num_splits or decode_splits(B * chunks, capacity)
    chunk = triton.cdiv(triton.cdiv(capacity, splits), s.block_n) * s.block_n
    rows = max(16, _pow2_at_least(group * s.kv_heads))
    s = register_cap(s, B * chunks * splits, platform_device.multiprocessors(q.device), tuning, _capability(q.device))
    if splits > 1:
        o_part = torch.empty((splits, *q.shape), device=q.device, dtype=torch.float32)
        l_part = torch.empty((splits, *q.shape[:2]), device=q.device, dtype=torch.float32)
    else:
        o_part = l_part = torch.empty((1, 1, 1), device=q.device, dtype=torch.float32)
    _paged_decode_kernel[(B, chunks, splits)](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out, o_part, l_part,
        qk_scale, window or 0, chunk, Hk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        l_part.stride(0), l_part.stride(1),
        GROUP=group, HEAD_DIM=D, PAGE=page, HC=s.kv_heads, ROWS=rows, BLOCK_N=s.block_n, SPLIT=splits > 1,
        WINDOW=window is not None, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", F16_DOTS=f16_dots,
        **s.launch_options(), **pdl.kernel_kwargs(q.device),
    )  # fmt: skip
    if splits > 1:
        combine_splits(o_part, l_part, out, cu_seqlens_q, splits, by_seq=1, decode_rows=True)
