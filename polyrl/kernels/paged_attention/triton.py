"""Paged attention and KV-cache writes in Triton (inference only, no backward).

``paged_attention``: two kernels, chosen per sequence by its own number of new tokens (never by the batch):

* sequences with exactly one new token (decode): ``decode.py``, one program per (sequence, chunk of KV heads,
  key-range split) with all query heads of those KV heads as its rows (see there);
* sequences with more (prefill of new tokens over a cached prefix, chunked prefill): the general kernel here. A
  program owns a block of BLOCK_Q new tokens of one sequence and *all* query heads of one KV head's GQA group,
  flattened into ROWS = BLOCK_Q * GROUP rows, so every cached K/V byte is read once per token block. Keys are
  gathered through the block table one tile of BLOCK_N positions at a time; the causal (and window) mask is per row.

A call with ``max_seqlen_q == 1`` launches the decode kernel only; a mixed step launches both, each of whose programs
returns at once for the other kernel's sequences. With few programs the key range is split over NUM_SPLITS programs
(flash-decoding), each writing a normalised partial output and its log-sum-exp, and a second kernel
(``decode._combine_splits_kernel``) combines them. ``POLYRL_PAGED_DECODE=rows`` (read at import) or
``tuning={"decode": "rows"}`` sends decode rows through the general kernel as before ``decode.py`` (for A/B runs).

Batch invariance: which kernel serves a sequence, and each kernel's tile sizes and warps, depend on that sequence's
q_len and on the head shapes and dtypes only; the split count depends on the batch (few programs -> more splits), so
a sequence's numbers are the same in any batch with the same split count (``decode.py`` says more).

With ``POLYRL_PDL=1`` on a Hopper or newer GPU the attention kernels here and in ``decode.py`` (and the split
combine) are launched with Programmatic Dependent Launch (``kernels/pdl.py``); ``write_kv_cache`` as before.

Nothing here reads a device value on the host: the grid comes from ``max_seqlen_q`` (a Python int),
the batch size and the block-table capacity, and each program derives its bounds from
``cu_seqlens_q`` / ``context_lens`` on the device, so both ops can be captured in a CUDA graph.

FP8 caches (``float8_e4m3fn``, static unit scale; ``reference.py`` is the spec, ``infer/kv_cache.py`` says why):
the write converts each new K/V row to fp32, saturates it to +-448 and rounds it to e4m3 on the store; the attention
loads the FP8 tiles (half the bytes of bf16) and upcasts them in registers right before the dots, so no dequantised
copy of the cache ever exists. Under bf16 queries the dots then run in fp16, not bf16 (``_f16_dots``: the cheaper
upcast); the softmax and the accumulation are fp32 as for a bf16 cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrl.errors import ConfigError
from polyrl.kernels import pdl
from polyrl.kernels.attention.triton import LOG2E, interpreting
from polyrl.kernels.paged_attention import decode
from polyrl.kernels.paged_attention.decode import _pow2_at_least
from polyrl.kernels.paged_attention.reference import FP8_E4M3_MAX, is_fp8
from polyrl.kernels.paged_attention.reference import paged_attention as _reference
from polyrl.kernels.pdl import launch_dependents as pdl_launch_dependents
from polyrl.kernels.pdl import wait as pdl_wait
from polyrl.platform import envvars

# Which kernel serves sequences with one new token: "heads" (decode.py, KV heads packed per program) or "rows" (the
# general kernel, one program per (sequence, KV head), as before decode.py); for A/B runs. Read once, at import.
_DECODE_PATH = envvars.get(envvars.POLYRL_PAGED_DECODE, "heads")

# Partial-output splits stop once a split would cover fewer keys than this.
_MIN_KEYS_PER_SPLIT = 256
# Enough programs to fill a large GPU several times over (132 SMs on an H100/H200).
_TARGET_PROGRAMS = 1024
# Decode pipeline depth from scripts/paged_attention_sweep.py on the H200 (raw compat/raw/h200-2026-12-01/
# run24-paged-sweep.log): with at most this many keys per program 2 stages beat 3 by 4-6% (B512 at 192 keys, B256 at
# 256), at 4k keys 3 win. Keys per tile stay 64 at every batch (128 was 13% faster at batch 1 only): the tile decides
# the order of the softmax accumulation, and a sequence must decode to the same numbers in any batch (a row launched
# ahead changes the batch for a step; tests/infer/test_gpu.py, one-step-ahead equals synchronous).
_SHORT_CHUNK = 1024


@triton.jit
def _paged_fwd_kernel(
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
    BLOCK_Q: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F16_DOTS: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before any load or store (kernels/pdl.py)
    pid_q = tl.program_id(0)
    b = tl.program_id(1) // num_kv_heads
    hk = tl.program_id(1) % num_kv_heads
    split = tl.program_id(2)
    q_start = tl.load(CUQ + b)
    q_len = tl.load(CUQ + b + 1) - q_start
    if SKIP_DECODE:  # sequences with one new token are decode.py's
        if q_len == 1:
            return
    tok0 = pid_q * BLOCK_Q
    if tok0 >= q_len:
        return
    ctx = tl.load(CTX + b)
    # Row r = (token tok0 + r // GROUP, query head hk * GROUP + r % GROUP).
    r = tl.arange(0, ROWS)
    tok = tok0 + r // GROUP
    head = hk * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx - q_len + tok  # position of each new token in its sequence
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    if F16_DOTS:  # bf16 queries over an FP8 cache: both dots in fp16 (q, K, P and V), see _f16_dots
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Keys this token block can see: [lo, hi), then this split's share of it.
    hi = tl.minimum(ctx, ctx - q_len + tok0 + BLOCK_Q)
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx - q_len + tok0 - window + 1, 0)
    if SPLIT:
        lo = tl.maximum(lo, split * chunk)
        hi = tl.minimum(hi, (split + 1) * chunk)

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        k_valid = k_pos < hi
        block = tl.load(bt_row + k_pos // PAGE, mask=k_valid, other=0).to(tl.int64)
        slot_k = block * stride_kb + (k_pos % PAGE) * stride_ks + hk * stride_kh
        slot_v = block * stride_vb + (k_pos % PAGE) * stride_vs + hk * stride_vh
        kt = tl.load(KC + slot_k[None, :] + offs_d[:, None], mask=k_valid[None, :], other=0.0)  # [D, BLOCK_N]
        v = tl.load(VC + slot_v[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0)  # [BLOCK_N, D]
        qk = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PREC) * qk_scale
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if WINDOW:
            allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)
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
        # Normalised partial output + its base-2 log-sum-exp (-inf when this split saw no key).
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
        part = split.to(tl.int64)
        tl.store(
            OP + part * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :],
            out,
            mask=row_valid[:, None],
        )
        tl.store(LP + part * stride_ls + q_rows * stride_lt + head, lse, mask=row_valid)
    else:
        tl.store(
            O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=row_valid[:, None],
        )


def _f16_dots(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the attention's dots run in fp16 instead of q's bf16: over an FP8 cache. e4m3 -> fp16 is one packed
    conversion per two values (``cvt.rn.f16x2.e4m3x2``), e4m3 -> bf16 at least three per two in Triton (through fp16),
    and conversions issue at 16 / clock / SM: for qwen3-8b at B256 (~4.8 G cached values a step) that is ~2 ms of
    conversions against ~1 ms of reading the bytes, so the bf16 upcast, not the bandwidth, could bound the kernel
    (estimate, not measured). fp16 keeps more mantissa than bf16 (10 bits vs 7); q is clamped to
    +-65504 (fp16's range) once per program, P is in [0, 1], K and V within +-448: nothing else can overflow."""
    return is_fp8(k_cache.dtype) and q.dtype == torch.bfloat16


def _num_splits(programs: int, capacity: int) -> int:
    """Splits of the key range so that about _TARGET_PROGRAMS programs run; 1 when the batch fills the GPU."""
    splits = 1
    while programs * splits < _TARGET_PROGRAMS and capacity // (2 * splits) >= _MIN_KEYS_PER_SPLIT:
        splits *= 2
    return splits


def _decode_path(tuning: dict) -> str:
    path = tuning.get("decode", _DECODE_PATH)
    if path not in ("heads", "rows"):
        raise ConfigError(
            f"paged attention decode path must be 'heads' (decode.py, the default) or 'rows' (the general kernel); "
            f"got {path!r} (tuning['decode'] or POLYRL_PAGED_DECODE)"
        )
    return path


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    tuning: dict | None = None,
) -> torch.Tensor:
    """``paged_attention`` with an explicit number of key-range splits (None: chosen from the shapes; given, it
    applies to both kernels) and, for ``scripts/paged_attention_sweep.py``, launch settings overriding the heuristics
    of the kernel that serves the one-new-token sequences: ``decode`` ("heads": ``decode.py``, the default, or "rows":
    the general kernel for every sequence, as before ``decode.py``; default from ``POLYRL_PAGED_DECODE``), then
    ``kv_heads``, ``block_n``, ``num_warps``, ``num_stages`` (``decode.decode_settings``; for "rows" ``block_n``,
    ``num_warps`` and ``num_stages`` of the general kernel). Under "heads" the general kernel of a mixed step keeps
    its own heuristics."""
    T, Hq, D = q.shape
    _, page, Hk, Dk = k_cache.shape
    if D != Dk or D not in (16, 32, 64, 128, 256) or Hq % Hk != 0:
        raise ConfigError(
            f"triton paged attention needs q [T, Hq, D] and caches [blocks, block_size, Hk, D] with Hq % Hk == 0 "
            f"and D a power of two in 16..256; got q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    if window is not None and window < 1:
        raise ConfigError(f"sliding window must be >= 1 (or None for full causal attention), got {window}")
    tuning = tuning or {}
    heads = _decode_path(tuning) == "heads"
    out = torch.empty_like(q)
    B = block_tables.shape[0]
    if T == 0 or B == 0 or max_seqlen_q == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    scale = D**-0.5 if scale is None else float(scale)
    if heads and not tuning and num_splits is None:
        # small batches keep the general kernel (with its key-range splits where the block tables are wide;
        # decode.decode_settings says why): decided on the batch size alone, at the program count where the general
        # kernel's own split count changes, so a sequence's numbers change only where they already could
        heads = B * Hk >= _TARGET_PROGRAMS
    if heads:
        # Per sequence, by its own q_len: one new token -> decode.py, more -> the general kernel (its programs for
        # one-token sequences return at once). Two launches in a mixed step.
        decode.paged_decode(
            q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out, scale * LOG2E, window,
            _f16_dots(q, k_cache), num_splits, tuning,
        )  # fmt: skip
        if max_seqlen_q > 1:
            _general(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale, window,
                     num_splits, {}, out, skip_decode=True)  # fmt: skip
        return out
    _general(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale, window, num_splits,
             tuning, out, skip_decode=False)  # fmt: skip
    return out


def _general(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale, window, num_splits,
             tuning, out, skip_decode: bool) -> None:  # fmt: skip
    """The general kernel (``_paged_fwd_kernel``) into ``out``: every sequence, or (``skip_decode``) only those with
    more than one new token."""
    T, Hq, D = q.shape
    _, page, Hk, _ = k_cache.shape
    B = block_tables.shape[0]
    group = Hq // Hk
    interp = interpreting()
    rows_target = 16 if interp else 64
    block_q = 1 if max_seqlen_q == 1 else _pow2_at_least(max(1, rows_target // group))
    block_q = min(block_q, _pow2_at_least(max_seqlen_q))
    rows = max(16, _pow2_at_least(block_q * group))
    n_qblocks = triton.cdiv(max_seqlen_q, block_q)
    block_n = tuning.get("block_n") or (16 if interp else (64 if D <= 128 else 32))
    capacity = block_tables.shape[1] * page
    splits = num_splits or (1 if interp else _num_splits(n_qblocks * B * Hk, capacity))
    chunk = triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n
    if interp:
        stages = 1
    elif q.dtype == torch.float32 or D > 128 or (max_seqlen_q == 1 and chunk <= _SHORT_CHUNK):
        stages = 2
    else:
        stages = 3
    if splits > 1:
        o_part = torch.empty((splits, T, Hq, D), device=q.device, dtype=torch.float32)
        l_part = torch.empty((splits, T, Hq), device=q.device, dtype=torch.float32)
    else:
        o_part = l_part = torch.empty((1, 1, 1), device=q.device, dtype=torch.float32)
    grid = (n_qblocks, B * Hk, splits)
    _paged_fwd_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out, o_part, l_part,
        scale * LOG2E, window or 0, chunk, Hk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        l_part.stride(0), l_part.stride(1),
        GROUP=group, HEAD_DIM=D, PAGE=page, BLOCK_Q=block_q, ROWS=rows, BLOCK_N=block_n, SPLIT=splits > 1,
        WINDOW=window is not None, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOTS=_f16_dots(q, k_cache), SKIP_DECODE=skip_decode,
        num_warps=tuning.get("num_warps", 4),
        num_stages=tuning.get("num_stages") or stages, **pdl.kernel_kwargs(q.device),
    )  # fmt: skip
    if splits > 1:  # skipping decode rows: combine per sequence, leaving decode.py's tokens alone
        decode.combine_splits(o_part, l_part, out, cu_seqlens_q, splits, max_seqlen_q if skip_decode else 0)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of new tokens over a paged KV cache (see ``polyrl.kernels.paged_attention``).

    Head dims that are not a power of two in 16..256 use the reference (correct, but it syncs the host).
    """
    if q.shape[-1] not in (16, 32, 64, 128, 256):  # = kernels.PAGED_ATTENTION_GRAPH_HEAD_DIMS
        return _reference(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale, window)
    return _paged_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale, window)


@triton.jit
def _write_kv_kernel(
    K,
    V,
    KC,
    VC,
    SLOTS,
    num_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kb,
    stride_ks,
    stride_kch,
    stride_vb,
    stride_vs,
    stride_vch,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8_MAX > 0:  # an FP8 cache: saturate (e4m3fn has no inf; an overflow would store NaN), round on the store
        k = tl.clamp(k.to(tl.float32), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32), -FP8_MAX, FP8_MAX)
    tl.store(
        KC + block * stride_kb + offset * stride_ks + h[:, None] * stride_kch + d[None, :],
        k.to(KC.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        VC + block * stride_vb + offset * stride_vs + h[:, None] * stride_vch + d[None, :],
        v.to(VC.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v ``[T, Hk, D]`` at flat slots ``slot_mapping`` ``[T]`` (negative: skipped); no host sync. An FP8
    cache (``float8_e4m3fn``) stores the values saturated to +-448 and rounded to nearest even (the reference's)."""
    T, Hk, D = k.shape
    if T == 0:
        return
    page = k_cache.shape[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ConfigError("write_kv_cache needs k, v and the caches contiguous in the head dim")
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, Hk, D, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        PAGE=page, BLOCK_H=_pow2_at_least(Hk), BLOCK_D=_pow2_at_least(D),
        FP8_MAX=FP8_E4M3_MAX if is_fp8(k_cache.dtype) else 0.0, num_warps=4,
    )  # fmt: skip
