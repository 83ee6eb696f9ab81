"""Fused linear + cross-entropy in Triton: ``cross_entropy(hidden @ W^T, labels)`` without [T, V] logits.

For ``reduction`` "sum" and "mean" the gradient is computed during the forward, chunk by chunk over tokens:
the chunk's logits come from one cuBLAS matmul in the input dtype (the reference's ``h @ W^T`` before its
``.float()``); a row kernel takes an fp32 log-sum-exp over the row, writes the per-token loss, and overwrites
the logits in place with ``(softmax - onehot) * scale`` (scale = 1, or 1 / non-ignored count for "mean");
then ``grad_hidden = g @ W`` and ``grad_weight += g^T @ h`` (fp32 across chunks). Backward only multiplies
the two stored gradients by the scalar upstream gradient, so there are three matmuls in all, like the
materialised version, and the extra memory is one logits chunk plus the [V, H] gradient accumulator (a chunk is
~1 GiB of logits, or 256 MiB when the weight gets no gradient: nothing to accumulate per chunk then).

"none" needs a gradient per token that is only known in backward, so it runs through the token-logprob
path (per-token log-sum-exp saved, logits recomputed in backward): loss = -log_softmax(logits)[label].

Ignored labels give loss 0 and no gradient; "mean" divides by the non-ignored count (0 targets -> 0). A label
that is neither ``ignore_index`` nor in [0, V) gives a NaN loss (no out-of-bounds read, no host sync).
The gradient is always computed in a grad-enabled forward, even if backward is never called; there is no
double backward.
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

# By module path: polyrl.kernels.token_logprobs is shadowed by the op function of that name, and a test
# re-import must get the fresh module, not a stale attribute.
_tlp = importlib.import_module("polyrl.kernels.token_logprobs.triton")


@triton.jit
def _ce_fused_kernel(
    logits_ptr,
    stride,
    labels_ptr,
    loss_ptr,
    scale_ptr,
    V,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    d = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(d)
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < V)
    x_t = tl.load(base + label, mask=in_range & (~ignored), other=0.0).to(tl.float32)
    loss = tl.where(in_range, lse - x_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
    if WRITE_GRAD:
        scale = tl.where(in_range & (~ignored), tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * scale
            g = tl.where(cols == label, g - scale, g)
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _loss_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    scale: torch.Tensor,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, _tlp.GradWeightAccumulator | None]:
    """Per-token loss fp32 [T]; with ``need_*`` also grad_hidden and the grad_weight accumulator for unit
    upstream gradient times ``scale``."""
    T, V = hidden.shape[0], weight.shape[0]
    write_grad = need_hidden or need_weight
    loss = torch.empty(T, device=hidden.device, dtype=torch.float32)
    grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype) if need_hidden else None
    budget = _tlp.CHUNK_BYTES if need_weight else _tlp.CHUNK_BYTES_FROZEN_WEIGHT
    rows = _tlp.chunk_rows(T, V, hidden.element_size(), budget)
    acc = _tlp.GradWeightAccumulator(weight, single=rows >= T) if need_weight else None
    block, warps = _tlp.block_config(V)
    for start, stop, logits in _tlp.logits_chunks(hidden, weight, rows):  # [C, V]; d(loss)/d(logits) if write_grad
        h = hidden[start:stop]
        _ce_fused_kernel[(stop - start,)](
            logits,
            logits.stride(0),
            labels[start:stop],
            loss[start:stop],
            scale,
            V,
            ignore_index,
            WRITE_GRAD=write_grad,
            BLOCK_V=block,
            num_warps=warps,
        )
        if grad_h is not None:
            torch.mm(logits, weight, out=grad_h[start:stop])
        if acc is not None:
            acc.add(logits, h)
    return loss, grad_h, acc


class _LinearCrossEntropy(torch.autograd.Function):
    """Reductions "sum"/"mean": gradients computed in forward for unit upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, mean):
        scale = _scale(labels, ignore_index, mean)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, acc = _loss_rows(hidden, weight, labels, ignore_index, scale, need_h, need_w)
        ctx.grad_h, ctx.acc = grad_h, acc
        return loss.sum() * scale[0]

    @staticmethod
    def backward(ctx, grad_out):
        grad_h = ctx.grad_h * grad_out.to(ctx.grad_h.dtype) if ctx.grad_h is not None else None
        grad_w = ctx.acc.result(grad_out.float()) if ctx.acc is not None else None
        if not _keeps_graph():
            # state on ctx lives until the whole graph is freed, i.e. past the end of backward, where a full
            # fine-tuning step peaks: the fp32 [V, H] weight-gradient sum alone is 1.16 GiB at qwen3-30b-a3b's shape
            # (scripts/moe_memory_account.py). A retained graph (backward twice) keeps it.
            ctx.grad_h = ctx.acc = None
        return grad_h, grad_w, None, None, None


def _keeps_graph() -> bool:
    """Whether the running backward retains the graph (``retain_graph=True``); True where torch cannot say."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _scale(labels: torch.Tensor, ignore_index: int, mean: bool) -> torch.Tensor:
    """fp32 [1] on the labels' device: 1 for "sum", 1 / max(non-ignored count, 1) for "mean" (no host sync)."""
    if not mean:
        return torch.ones(1, device=labels.device, dtype=torch.float32)
    count = (labels != ignore_index).sum().clamp(min=1).to(torch.float32)
    return count.reciprocal().reshape(1)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "sum",
) -> torch.Tensor:
    """Cross-entropy of ``hidden [T, H] @ weight [V, H]^T`` against ``labels [T]``, fp32; chunked, fused."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if reduction == "none":
        logprob, _ = _tlp.logprobs_and_entropy(hidden, weight, labels, 1.0, False, ignore_index)
        return -logprob
    hidden, weight, ctx = _tlp.under_autocast(hidden, weight)
    with ctx:
        return _reduced(hidden, weight, labels, ignore_index, reduction == "mean")


def _reduced(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, mean: bool):
    _tlp.check_inputs(hidden, weight, labels)
    labels = labels.to(torch.int64).contiguous()
    if hidden.shape[0] == 0:
        return (hidden @ weight.t()).float().sum()  # 0, still connected to the graph
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, mean)
    scale = _scale(labels, ignore_index, mean)
    loss, _, _ = _loss_rows(hidden, weight, labels, ignore_index, scale, False, False)
    return loss.sum() * scale[0]
