"""Fused lm-head log-probs (and entropy) in Triton: ``log_softmax(hidden @ W^T / temperature)[t, tokens[t]]``.

The [T, V] logits never exist at once. Tokens are processed in chunks of ``chunk_rows`` rows: the chunk's
logits come from one cuBLAS matmul in the input dtype (exactly the reference's ``(h @ W^T)`` before its
``.float()``), then a row kernel reads them once with an online max / sum-exp in fp32 and writes per-token
log-sum-exp, log-prob and entropy ([T] fp32 each). Backward keeps only those [T] statistics and recomputes
each chunk's logits, overwrites them in place with d(loss)/d(logits) and turns them into
``grad_hidden = g @ W`` and ``grad_weight += g^T @ h`` (accumulated in fp32 across chunks). Extra memory is
one logits chunk (``CHUNK_BYTES``, one buffer reused by every chunk: ``logits_chunks``) plus an fp32 [V, H]
accumulator, whatever T is.

Gradients, per row with s = x / tau, p = softmax(s), lse = logsumexp(s), Ent = lse - sum(p * s):
  d logprob / d s_j = [j == y] - p_j
  d Ent / d s_j     = -p_j * (s_j - lse + Ent)
and d/dx = d/ds / tau.

Tokens outside [0, V) give a NaN log-prob and no log-prob gradient (no out-of-bounds read); the entropy of
such a row is still computed. This module also serves ``linear_cross_entropy(reduction="none")``, which
passes its ``ignore_index`` (those rows give log-prob 0 and no gradient). It does not do double backward.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# Logits bytes per chunk: ~1 GiB keeps peak memory far below materialised logits at LLM vocab sizes
# (16k tokens x 151936 vocab in bf16 is 4.6 GiB per copy) while keeping the matmuls large.
CHUNK_BYTES = 1 << 30
# Without a weight gradient (a frozen LM head: LoRA) a chunk costs no [V, H] accumulation, so chunks are smaller:
# the same matmuls in more launches, a quarter of the memory (measured at the qwen3-1.7b shape, issue 17).
CHUNK_BYTES_FROZEN_WEIGHT = 1 << 28
# Rows are rounded to this multiple so the chunk matmuls stay tensor-core friendly.
CHUNK_ALIGN = 128
# Widest vocab block one program loads at a time.
MAX_BLOCK_V = 8192
# A token id that never matches: "no ignore index".
NO_IGNORE = -(2**62)


def chunk_rows(num_rows: int, vocab: int, elem_size: int, chunk_bytes: int | None = None) -> int:
    """Rows per chunk so that one chunk of logits ``[rows, vocab]`` stays near ``chunk_bytes`` (``CHUNK_BYTES``)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    budget = max(1, chunk_bytes // max(1, vocab * elem_size))
    if budget >= num_rows:
        return max(1, num_rows)
    num_chunks = -(-num_rows // budget)
    rows = -(-num_rows // num_chunks)
    aligned = -(-rows // CHUNK_ALIGN) * CHUNK_ALIGN
    return aligned if aligned <= budget else rows


def logits_chunks(hidden: torch.Tensor, weight: torch.Tensor, rows: int):
    """Yield ``(start, stop, logits)`` with ``logits = hidden[start:stop] @ weight^T`` ``[C, V]`` in the input dtype.

    Every chunk is written into ONE buffer: a fresh ``h @ W^T`` per chunk would be allocated while the previous
    chunk is still referenced, so the peak would be two chunks (measured on the H200: 1.9 GiB for a 1 GiB chunk).
    A chunk is valid until the next one is requested; callers finish with it (kernels, matmuls) before that.
    """
    T, V = hidden.shape[0], weight.shape[0]
    buf = torch.empty((min(rows, T), V), device=hidden.device, dtype=hidden.dtype)
    for start in range(0, T, rows):
        stop = min(T, start + rows)
        out = buf[: stop - start]
        with torch.no_grad():  # out= takes no autograd; callers compute their own gradients
            torch.mm(hidden[start:stop], weight.t(), out=out)
        yield start, stop, out


def block_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``vocab`` logits."""
    block = min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    stride,
    tokens_ptr,
    lse_ptr,
    logprob_ptr,
    ent_ptr,
    V,
    inv_temp,
    ignore_index,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    d = tl.zeros((), tl.float32)
    a = tl.zeros((), tl.float32)
    # One pass, online: m = running max, d = sum exp(s - m), a = sum exp(s - m) * s.
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        s = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new)
        d = d * alpha + tl.sum(e, 0)
        if HAS_ENT:
            a = a * alpha + tl.sum(e * tl.where(mask, s, 0.0), 0)  # masked lanes: e = 0, s -> 0 (no 0 * inf)
        m = m_new
    lse = m + tl.log(d)
    tok = tl.load(tokens_ptr + row)
    in_range = (tok >= 0) & (tok < V)
    x_t = tl.load(base + tok, mask=in_range, other=0.0).to(tl.float32) * inv_temp
    logprob = tl.where(in_range, x_t - lse, float("nan"))
    logprob = tl.where(tok == ignore_index, 0.0, logprob)
    tl.store(lse_ptr + row, lse)
    tl.store(logprob_ptr + row, logprob)
    if HAS_ENT:
        tl.store(ent_ptr + row, lse - a / d)


@triton.jit
def _row_grad_kernel(
    logits_ptr,
    stride,
    tokens_ptr,
    lse_ptr,
    ent_ptr,
    go_lp_ptr,
    go_ent_ptr,
    V,
    inv_temp,
    ignore_index,
    HAS_GO_LP: tl.constexpr,
    HAS_GO_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Overwrite one row of logits x with d(loss)/dx (see the module docstring), in the logits dtype."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    tok = tl.load(tokens_ptr + row)
    valid = (tok >= 0) & (tok < V) & (tok != ignore_index)
    g_lp = tl.zeros((), tl.float32)
    if HAS_GO_LP:
        g_lp = tl.where(valid, tl.load(go_lp_ptr + row), 0.0)
    g_ent = tl.zeros((), tl.float32)
    shift = lse
    if HAS_GO_ENT:
        g_ent = tl.load(go_ent_ptr + row)
        shift = lse - tl.load(ent_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        s = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(s - lse)
        g = -g_lp * p
        if HAS_GO_ENT:
            g = g - g_ent * p * (s - shift)
        g = tl.where(cols == tok, g + g_lp, g)
        tl.store(base + cols, (g * inv_temp).to(logits_ptr.dtype.element_ty), mask=mask)


def under_autocast(hidden: torch.Tensor, weight: torch.Tensor):
    """(hidden, weight, context): inside an autocast region the matmuls run in the autocast dtype, like
    ``hidden @ weight.t()`` would (differentiable casts, so fp32 weights get fp32 grads), with autocast then
    switched off so every chunk matmul keeps exactly that dtype."""
    dev = hidden.device.type
    if not torch.is_autocast_enabled(dev):
        return hidden, weight, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(dev)
    return hidden.to(dtype), weight.to(dtype), torch.autocast(dev, enabled=False)


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if tokens.shape != hidden.shape[:1]:
        raise ValueError(f"expected tokens [T] = [{hidden.shape[0]}], got {tuple(tokens.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")


def row_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    ignore_index: int = NO_IGNORE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse, logprob, entropy or None), each fp32 [T], chunk by chunk; no autograd."""
    T, V = hidden.shape[0], weight.shape[0]
    lse = torch.empty(T, device=hidden.device, dtype=torch.float32)
    logprob = torch.empty_like(lse)
    ent = torch.empty_like(lse) if with_entropy else None
    block, warps = block_config(V)
    rows = chunk_rows(T, V, hidden.element_size())
    for start, stop, logits in logits_chunks(hidden, weight, rows):  # [C, V] in the input dtype
        _row_stats_kernel[(stop - start,)](
            logits,
            logits.stride(0),
            tokens[start:stop],
            lse[start:stop],
            logprob[start:stop],
            ent[start:stop] if ent is not None else lse[start:stop],
            V,
            1.0 / temperature,
            ignore_index,
            HAS_ENT=with_entropy,
            BLOCK_V=block,
            num_warps=warps,
        )
    return lse, logprob, ent


def recompute_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    go_lp: torch.Tensor | None,
    go_ent: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_hidden, grad_weight) from upstream per-token grads, recomputing the logits chunk by chunk."""
    T, V = hidden.shape[0], weight.shape[0]
    grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype) if need_hidden else None
    rows = chunk_rows(T, V, hidden.element_size())
    acc = GradWeightAccumulator(weight, single=rows >= T) if need_weight else None
    block, warps = block_config(V)
    for start, stop, g in logits_chunks(hidden, weight, rows):  # logits [C, V], overwritten with d(loss)/d(logits)
        h = hidden[start:stop]
        _row_grad_kernel[(stop - start,)](
            g,
            g.stride(0),
            tokens[start:stop],
            lse[start:stop],
            ent[start:stop] if ent is not None else lse[start:stop],
            go_lp[start:stop] if go_lp is not None else lse[start:stop],
            go_ent[start:stop] if go_ent is not None else lse[start:stop],
            V,
            1.0 / temperature,
            ignore_index,
            HAS_GO_LP=go_lp is not None,
            HAS_GO_ENT=go_ent is not None,
            BLOCK_V=block,
            num_warps=warps,
        )
        if grad_h is not None:
            torch.mm(g, weight, out=grad_h[start:stop])
        if acc is not None:
            acc.add(g, h)
    return grad_h, (acc.result() if acc is not None else None)


_FP32_OUT_ADDMM: dict[tuple[str, torch.dtype], bool] = {}


def _fp32_out_addmm(g: torch.Tensor) -> bool:
    """Whether ``torch.addmm(c_fp32, a, b, out_dtype=float32, out=c_fp32)`` accumulates low-precision products into
    fp32 here (torch >= 2.8 on CUDA); probed once per (device type, dtype) on a small case checked against fp64."""
    if g.dtype == torch.float32:
        return False
    key = (g.device.type, g.dtype)
    ok = _FP32_OUT_ADDMM.get(key)
    if ok is None:
        ok = False
        try:
            gen = torch.Generator().manual_seed(0)
            a, b, c = (torch.randn(n, m, generator=gen) for n, m in ((64, 48), (64, 80), (48, 80)))
            a_, b_ = a.to(g.dtype), b.to(g.dtype)
            want = c.double() + a_.double().t() @ b_.double()
            total = c.to(g.device)
            torch.addmm(total, a_.to(g.device).t(), b_.to(g.device), out_dtype=torch.float32, out=total)
            ok = total.dtype == torch.float32 and bool((total.cpu().double() - want).abs().max() < 1e-3)
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _FP32_OUT_ADDMM[key] = ok
    return ok


class GradWeightAccumulator:
    """Sum of ``g_c^T @ h_c`` over chunks: fp32 accumulation across chunks, one matmul when there is one chunk."""

    def __init__(self, weight: torch.Tensor, single: bool):
        self.weight = weight
        self.single = single
        self.total: torch.Tensor | None = None

    def add(self, g: torch.Tensor, h: torch.Tensor) -> None:
        if self.total is not None and not self.single and _fp32_out_addmm(g):
            # the GEMM adds into the fp32 total itself: no rounded [V, H] product, no separate add pass
            torch.addmm(self.total, g.t(), h, out_dtype=torch.float32, out=self.total)
            return
        prod = g.t() @ h  # [V, H], fp32 accumulation inside the matmul
        if self.single:
            self.total = prod
        elif self.total is None:
            self.total = prod.float() if prod.dtype != torch.float32 else prod
        else:
            self.total.add_(prod)

    def result(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        if self.total is None:
            return torch.zeros_like(self.weight)
        if scale is None:
            return self.total.to(self.weight.dtype)
        # Scale and cast in one pass; out of place so a retained graph can run backward again.
        out = torch.empty(self.total.shape, device=self.total.device, dtype=self.weight.dtype)
        return torch.mul(self.total, scale, out=out)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, with_entropy, ignore_index):
        lse, logprob, ent = row_stats(hidden, weight, tokens, temperature, with_entropy, ignore_index)
        ctx.save_for_backward(hidden, weight, tokens, lse, ent if ent is not None else lse)
        ctx.temperature, ctx.with_entropy, ctx.ignore_index = temperature, with_entropy, ignore_index
        if ent is None:
            ent = lse.new_zeros(0)
            ctx.mark_non_differentiable(ent)
        return logprob, ent

    @staticmethod
    def backward(ctx, go_lp, go_ent):
        hidden, weight, tokens, lse, ent = ctx.saved_tensors
        if not ctx.with_entropy:
            go_ent = None
        grad_h, grad_w = recompute_backward(
            hidden,
            weight,
            tokens,
            lse,
            ent if ctx.with_entropy else None,
            go_lp.float().contiguous() if go_lp is not None else None,
            go_ent.float().contiguous() if go_ent is not None else None,
            ctx.temperature,
            ctx.ignore_index,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        return grad_h, grad_w, None, None, None, None


def logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ignore_index: int = NO_IGNORE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared entry for token_logprobs and linear_cross_entropy("none"): (logprob [T], entropy [T] or None)."""
    hidden, weight, ctx = under_autocast(hidden, weight)
    with ctx:
        return _logprobs_and_entropy(hidden, weight, tokens, temperature, with_entropy, ignore_index)


def _logprobs_and_entropy(hidden, weight, tokens, temperature, with_entropy, ignore_index):
    check_inputs(hidden, weight, tokens)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tokens = tokens.to(torch.int64).contiguous()
    if hidden.shape[0] == 0:
        # [0] results still connected to hidden and weight, so backward on an empty batch works.
        empty = (hidden @ weight.t()).float().sum(-1)
        return empty, (empty.clone() if with_entropy else None)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not needs_grad:
        _, logprob, ent = row_stats(hidden, weight, tokens, temperature, with_entropy, ignore_index)
        return logprob, ent
    logprob, ent = _TokenLogprobs.apply(hidden, weight, tokens, float(temperature), with_entropy, ignore_index)
    return logprob, (ent if with_entropy else None)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """``log_softmax(hidden @ weight^T / temperature)`` at ``tokens`` as fp32 [T] (and entropy [T]); chunked."""
    logprob, ent = logprobs_and_entropy(hidden, weight, tokens, temperature, return_entropy)
    return (logprob, ent) if return_entropy else logprob
