"""FP8 training linear: ``y = x W^T (+ b)`` with its three GEMMs in FP8, and the module swap that turns a decoder's
projections into it (``convert_to_fp8`` / ``convert_from_fp8``).

The GEMMs (``_Fp8Matmul``), x ``[T, K]``, W ``[N, K]``, dY ``[T, N]``:

- forward ``Y = X W^T``: X and W in e4m3 (3 mantissa bits: the precision activations and weights need), scaled
  tensor-wise (one scale each) or row-wise (a scale per token of X and per output channel of W: an outlier token or
  channel no longer squeezes everyone else's range; Hopper's CUTLASS row-wise kernel, bf16 output);
- backward ``dX = dY W``: dY in e5m2 (2 mantissa bits, 5 exponent bits: gradients span a wider range and need
  it more than precision), W in e4m3; ``dW = dY^T X``: e5m2 x e4m3. Both tensor-wise in either recipe (scales along
  the reduction dim cannot be factored out of a GEMM; row-wise X/W would need re-quantising along the other axis
  anyway, and torch's row-wise kernel takes e4m3 only on older versions).

Every product accumulates in fp32 and is rounded once to the compute dtype (bf16). The forward output uses the fast
(Hopper two-level) accumulation, the gradients the exact one: torchao's default ``Float8LinearConfig`` choices
(``GRAD_FAST_ACCUM`` switches the gradients to the fast one too; the kernels bench has a row for it).

Scaling of X and W is *current* (just-in-time): each tensor's scale comes from its own ``amax`` right before the
cast, not from a history of earlier steps (*delayed* scaling). Why: it is stateless, so activation checkpointing
recomputes the very same FP8 values, FSDP2 ranks need no amax all-reduce, and a sudden outlier saturates nothing
(delayed scaling clips it for up to ``history`` steps). Its cost is one more read of each tensor (the amax pass). It
is torchao's default (its delayed scaling was deprecated and removed) and Transformer Engine's
``Float8CurrentScaling`` recipe, which TE added next to its original ``DelayedScaling`` default for these reasons.

The gradient dY can be scaled *delayed* (``GRAD_SCALING = "delayed"``; the default is ``"current"``): on the H200
(2026-12-02) it moved 1.7b FP8 SFT by nothing measurable (50.5k vs 51.0k tok/s, both 1.24x HF + Liger) and a
5-step GPU test drifted 1.15% from bf16 against current scaling's < 1%, so it stays opt-in. Delayed: its scale
comes from the amax the same layer's dY had at its previous backward, with 256x headroom
(``kernels.fp8.fp8_quantize_t_delayed``; the layer's first backward uses the current scale). Then the cast is one
read of dY instead of two, and dY is the largest of the three casts (a 1.7b step casts ~1.6x more gradient than
activation elements). What argues for current scaling does not apply to dY: it is never recomputed (checkpointing
recomputes forwards only), each rank casts only its own dY (no all-reduce; N ranks then match one process within
FP8 rounding rather than bit for bit), and its state is a device buffer read and written in the graph (a CUDA-graph
replay updates it). The outlier risk is small for e5m2: its range is ~2^31,
so 256x (2^8) of headroom still leaves values down to ~2^-24 of the amax representable; only a gradient whose amax
grew over 256x since the layer's previous backward saturates (for that one backward). What it gives up: a resumed run
casts its first backward's dY with the current scale (the state is not checkpointed), so a resume is exact up to
that one cast's rounding.

Where the bytes go (the GEMMs are fast; the casts and transposes around them decided the speed):

- every cast that has a transposed consumer writes both layouts in one pass (``kernels.fp8.fp8_quantize_t``): X
  (row-major for the forward, ``X^T`` for dW), W (``W`` for the forward, ``W^T`` for dX), dY (``dY`` for dX,
  ``dY^T`` for dW); ``torch._scaled_mm`` then gets every operand in the layout it wants and nothing is copied;
- what is saved for the backward: ``X^T`` in FP8 (1 byte per element, tensor-wise in both recipes: the row-wise
  recipe no longer keeps X in bf16) and ``W^T`` in FP8 (1 byte per parameter from the forward to the layer's
  backward, instead of quantising W a second time there);
- an input read by several projections (q/k/v, gate/up) is quantised once (``_InputSlot``; they also share the
  saved ``X^T``: one copy instead of three);
- with ``WEIGHT_CACHE`` each trainable weight's FP8 copies (row-major and transposed) stay from its forward until
  its gradient is accumulated (``_WeightCache``), so an activation-checkpointing recomputation reuses them: one
  weight cast per micro-batch. Memory: 2 bytes per FP8 parameter at most (1 without the cache), from the forward
  to the weight's backward: ~2.8 GB at qwen3-1.7b, ~14 GB at qwen3-8b (under checkpointing the backward would
  otherwise hold none: ``WEIGHT_CACHE = False`` trades those bytes for one more weight cast per step). A step of
  several micro-batches casts each weight once per micro-batch (the entry is dropped after each backward, before
  any optimizer step can change the weight);
- where the weight gradient runs on ``torch._scaled_mm``, X^T and dY^T come out of the cast with their token dim
  already padded with zeros to a multiple of 16 (the GEMM's reduction dim must be): no padding copy.

``fp8_linear_unfused`` keeps the earlier composition (no fused casts, no caches) as the baseline the bench and the
tests compare with: both give the same numbers.

``Fp8Linear`` is an ``nn.Linear`` whose class was swapped in place: the same ``weight`` / ``bias`` parameters and
names, so checkpoints, FSDP2 sharding, the optimizer's masters and the rollout engine's references are untouched.
It runs FP8 only in training mode (``module.train()``); in eval mode (evaluation, rollout in the same process) it is
the plain bf16 ``nn.Linear`` (FP8 inference is the rollout engine's own switch).

A LoRA layer (``models/lora/layer.py``) on a dense frozen base gets ``fp8_rowwise`` set instead: its base GEMMs run
in FP8 (forward and input gradient; no weight gradient) and the adapter in the compute dtype. A QLoRA (NF4) base is
left alone (``fp8_candidates`` reports it).

Not here: the quantisation and GEMM kernels (``polyrl.kernels.fp8``), deciding whether the device can run FP8
(``polyrl.train.precision``).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from polyrl import kernels
from polyrl.kernels.fp8 import AmaxState, fp8_quantize_t, fp8_quantize_t_delayed
from polyrl.platform import device

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# The decoder's projections that run in FP8 (HF names). Not the lm_head, embeddings, norms, routers or experts.
FP8_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALINGS = ("tensorwise", "rowwise")


# Switches (module state, read at each call; the bench flips them to compare paths in one run).
# Keep each weight's FP8 copies from its forward until its gradient is accumulated (``_WeightCache``): a recomputed
# forward (activation checkpointing) reuses them instead of quantising the weight again. Costs 1 byte per parameter
# of the row-major copy from the forward to the weight's backward (the transposed copy is saved for the backward
# either way).
WEIGHT_CACHE = True
# Quantise a projection input once for all projections that read it (q/k/v, gate/up: ``_InputSlot``).
INPUT_CACHE = True
# The gradient GEMMs with Hopper's fast (two-level) accumulation too; torchao's default (False) keeps them exact.
GRAD_FAST_ACCUM = False
# How ``Fp8Linear`` scales its gradient dY: "delayed" (the previous backward's amax, one read of dY: the module
# docstring says why) or "current" (its own amax, two reads). ``fp8_linear`` itself takes the state it is given.
GRAD_SCALING = "current"
GRAD_SCALINGS = ("delayed", "current")
# The format of the gradient dY in the backward GEMMs: "e5m2" (default, torchao's tensor-wise recipe), "e4m3" (one
# more mantissa bit, 2^8 less range: torchao's row-wise recipe casts dY so), or "bf16" (dY not quantised: dX and dW
# as bf16 GEMMs on the saved FP8 operands, dequantised; a numerics diagnostic, slower). Tensor-wise current scaling
# in all three; read at each backward (scripts/fp8_loss_curves.py --variants compares them).
GRAD_DTYPE = "e5m2"
GRAD_DTYPES = ("e5m2", "e4m3", "bf16")


class _Fp8Operands:
    """The FP8 operands of one ``_Fp8Matmul`` call, quantised before it (outside autograd: plain tensors).
    ``xq/xs``: X for the forward GEMM (row-wise or tensor-wise); ``xq_t/xs_t``: X tensor-wise transposed ``[K, T]``
    for dW (None without a weight gradient); ``wq/ws``: W for the forward; ``wq_t/ws_t``: W tensor-wise transposed
    ``[K, N]`` for dX (None without an input gradient)."""

    __slots__ = ("xq", "xs", "xq_t", "xs_t", "wq", "ws", "wq_t", "ws_t")

    def __init__(self, x4: tuple, w4: tuple) -> None:
        self.xq, self.xs, self.xq_t, self.xs_t = x4
        self.wq, self.ws, self.wq_t, self.ws_t = w4


class _Fp8Matmul(torch.autograd.Function):
    """``x [T, K] @ weight[N, K]^T`` with FP8 GEMMs forward and backward (module docstring) on operands quantised by
    the caller (``fp8_linear``): the backward reads the transposed copies saved here, transposes nothing and
    quantises only the incoming gradient (one pass writing it and its transpose)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        ops: _Fp8Operands,
        rowwise: bool,
        fast_grad: bool,
        grad_amax: AmaxState | None,
    ):
        ws = ops.ws.reshape(1, -1) if rowwise else ops.ws
        y = kernels.fp8_scaled_mm(ops.xq, ops.wq.t(), ops.xs, ws, x.dtype, True)
        ctx.x_dtype, ctx.w_dtype, ctx.fast_grad, ctx.grad_amax = x.dtype, weight.dtype, fast_grad, grad_amax
        # no W^T handed in (``keep_weight=False``): save the weight itself and cast it again in the backward
        w_again = weight if ops.wq_t is None and ctx.needs_input_grad[0] else None
        ctx.save_for_backward(ops.xq_t, ops.xs_t, ops.wq_t, ops.ws_t, w_again)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xq_t, xs_t, wq_t, ws_t, w_again = ctx.saved_tensors
        if w_again is not None:
            wq_t, ws_t = fp8_quantize_t(w_again, E4M3, False)[2:]
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = dy.contiguous()
        if GRAD_DTYPE == "bf16":
            dx, dw = _unquantised_grad_backward(ctx, dy, xq_t, xs_t, wq_t, ws_t, need_dx, need_dw)
            return dx, dw, None, None, None, None
        gdt = E4M3 if GRAD_DTYPE == "e4m3" else E5M2
        if need_dw and ctx.grad_amax is not None:  # delayed scale: one read of dY (module docstring)
            gq, gs, gq_t, _ = fp8_quantize_t_delayed(dy, gdt, ctx.grad_amax, _token_pad(dy))
        elif need_dw:  # dW needs dY^T row-major: the cast writes it beside dY (token dim padded as X^T's)
            gq, gs, gq_t, _ = fp8_quantize_t(dy, gdt, False, _token_pad(dy))
        else:
            (gq, gs), gq_t = kernels.fp8_quantize(dy, gdt, False), None
        dx = dw = None
        if need_dx:  # [T, N] @ [N, K]: the second operand column-major is wq_t row-major
            dx = kernels.fp8_scaled_mm(gq, wq_t.t(), gs, ws_t, ctx.x_dtype, ctx.fast_grad)
        if need_dw:  # [N, T_pad] @ [T_pad, K]: the padded tokens are zeros in both
            dw = kernels.fp8_scaled_mm(gq_t, xq_t.t(), gs, xs_t, ctx.w_dtype, ctx.fast_grad)
        return dx, dw, None, None, None, None


def _unquantised_grad_backward(ctx, dy, xq_t, xs_t, wq_t, ws_t, need_dx: bool, need_dw: bool) -> tuple:
    """``GRAD_DTYPE = "bf16"``: dX = dY W and dW = dY^T X in the compute dtype, with X and W the saved FP8 copies
    dequantised (so only dY's rounding is taken out of the FP8 backward)."""
    dx = dw = None
    if need_dx:
        w = (wq_t.to(torch.float32) * ws_t).to(ctx.x_dtype)  # [K, N]
        dx = dy @ w.t()
    if need_dw:
        x_t = (xq_t[:, : dy.shape[0]].to(torch.float32) * xs_t).to(dy.dtype)  # [K, T] (padding dropped)
        dw = (dy.t() @ x_t.t()).to(ctx.w_dtype)
    return dx, dw


def _quantize(t: torch.Tensor, rowwise: bool, with_t: bool, pad_t: int = 1) -> tuple:
    """(q, scale, q_t, scale_t) of ``t [M, K]`` in e4m3; q_t/scale_t None unless ``with_t`` (q_t ``[K, M]`` padded
    with zero columns to a multiple of ``pad_t``)."""
    if with_t:
        return fp8_quantize_t(t, E4M3, rowwise, pad_t)
    return (*kernels.fp8_quantize(t, E4M3, rowwise), None, None)


def _token_pad(t: torch.Tensor) -> int:
    """The multiple the token dim of X^T and dY^T is padded to: 16 where the weight gradient runs on
    ``torch._scaled_mm`` (its reduction dim must be; the cast writes the zero columns, so the GEMM copies nothing),
    1 on the reference GEMM (which needs none, and stays bit-equal to the unpadded product)."""
    return 16 if kernels.registry.select("fp8_scaled_mm", t.device.type, "float8_e4m3fn")[0] == "torch" else 1


def _cacheable(t: torch.Tensor) -> bool:
    return not t.is_inference() and not torch.compiler.is_compiling()


class _InputSlot(threading.local):
    """This thread's last quantised projection input: ``x`` (by identity, held weakly) at ``version`` -> its FP8
    operands. q/k/v (gate/up) run back to back on the same ``x``: the first quantises it, the others reuse that.
    One entry only (the next input replaces it; ``x``'s death frees it), so it keeps at most one input's FP8 copies
    alive beyond what the backward saves."""

    ref: weakref.ref | None = None
    key: tuple = ()
    value: tuple | None = None

    def clear(self) -> None:
        self.ref, self.key, self.value = None, (), None


_INPUT = _InputSlot()


def _input_operands(x: torch.Tensor, x2: torch.Tensor, rowwise: bool, with_t: bool) -> tuple:
    pad = _token_pad(x2) if with_t else 1
    if not (INPUT_CACHE and _cacheable(x)):
        return _quantize(x2, rowwise, with_t, pad)
    slot = _INPUT
    key = (x._version, rowwise, x2.shape, pad)
    if slot.ref is not None and slot.ref() is x and slot.key == key and (slot.value[2] is not None or not with_t):
        return slot.value
    value = _quantize(x2, rowwise, with_t, pad)

    def _freed(ref: weakref.ref, slot: _InputSlot = slot) -> None:
        if slot.ref is ref:
            slot.clear()

    slot.ref, slot.key, slot.value = weakref.ref(x, _freed), key, value
    return value


class _WeightCache:
    """Each trainable weight's FP8 operands from its forward until its gradient is accumulated (a
    ``post_accumulate_grad`` hook drops the entry: before any optimizer step can change the weight, whatever
    optimizer). A hit needs the same live tensor (held weakly), ``_version``, storage and recipe. Under activation
    checkpointing the recomputed forward hits; without it nothing reads an entry twice and it costs only the
    row-major copy's byte per parameter until the backward. Only a forward inside the backward (that
    recomputation) reads entries; every other forward quantises and replaces its weight's entry. Frozen weights (a
    LoRA base) are not cached: no gradient would ever drop them."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple] = {}
        self.hooked: dict[int, weakref.ref] = {}  # weights that carry the dropping hook (by identity, held weakly)

    def get(self, w: torch.Tensor, rowwise: bool, with_t: bool) -> tuple | None:
        e = self.entries.get(id(w))
        if e is None:
            return None
        ref, key, value = e
        if ref() is not w or key != self._key(w, rowwise) or (with_t and value[2] is None):
            return None
        return value

    def put(self, w: torch.Tensor, rowwise: bool, value: tuple) -> None:
        ref = self.hooked.get(id(w))
        if ref is None or ref() is not w:
            w.register_post_accumulate_grad_hook(self._drop)
            self.hooked[id(w)] = weakref.ref(w, lambda _, i=id(w): self.hooked.pop(i, None))
        self.entries[id(w)] = (weakref.ref(w), self._key(w, rowwise), value)

    def _drop(self, w: torch.Tensor) -> None:
        self.entries.pop(id(w), None)

    @staticmethod
    def _key(w: torch.Tensor, rowwise: bool) -> tuple:
        # capturing: an entry made outside a CUDA-graph capture is never read inside one (the graph would then lack
        # the cast and replay stale operands after the weight changes), nor one made inside read outside
        return (w._version, w.data_ptr(), w.shape, w.dtype, rowwise, device.is_capturing(w))

    def clear(self) -> None:
        self.entries.clear()


_WEIGHTS = _WeightCache()


def clear_fp8_caches() -> None:
    """Drop every cached FP8 operand (inputs and weights); nothing needs it for correctness (entries are checked
    and dropped on their own), it frees their memory now."""
    _INPUT.clear()
    _WEIGHTS.clear()


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (a checkpointed layer's recomputation does)."""
    return torch._C._current_graph_task_id() != -1


def _weight_operands(w: torch.Tensor, rowwise: bool, with_t: bool, keep: bool) -> tuple:
    if not keep:  # the forward's W only: nothing of the weight outlives this call
        return _quantize(w, rowwise, False)
    cache = WEIGHT_CACHE and w.requires_grad and w.is_leaf and torch.is_grad_enabled() and _cacheable(w)
    # read only by a recomputation (inside the backward): a plain forward always quantises afresh, so an entry left
    # by a forward whose backward never ran cannot reach it, even if the weight changed without a version bump
    if cache and _in_backward():
        hit = _WEIGHTS.get(w, rowwise, with_t)
        if hit is not None:
            return hit
    value = _quantize(w, rowwise, with_t)
    if cache:
        _WEIGHTS.put(w, rowwise, value)
    return value


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rowwise: bool = False,
    keep_weight: bool = True,
    grad_amax: AmaxState | None = None,
):
    """``F.linear(x, weight, bias)`` with the three GEMMs in FP8; ``x [..., K]``, differentiable in all three.
    ``keep_weight=False`` keeps no FP8 copy of the weight beyond the forward GEMM (the backward casts it again): for
    FSDP2-sharded weights, whose gathered copy is freed after the forward and must not live on as FP8.
    ``grad_amax``: the gradient dY is scaled delayed from this state (one per layer, kept across calls; module
    docstring); None: current scaling. Ignored under ``torch.compile`` (its state update is host-side)."""
    x2 = x.reshape(-1, x.shape[-1])
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and x.requires_grad, grad and weight.requires_grad
    ops = _Fp8Operands(
        _input_operands(x, x2, rowwise, need_dw), _weight_operands(weight, rowwise, need_dx, keep_weight)
    )
    if grad_amax is not None and torch.compiler.is_compiling():
        grad_amax = None
    y = _Fp8Matmul.apply(x2, weight, ops, rowwise, GRAD_FAST_ACCUM, grad_amax).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class _Fp8MatmulUnfused(torch.autograd.Function):
    """The FP8 linear as it was before the fused casts, kept as the baseline the kernels bench and the tests
    compare with: each operand quantised on its own, the backward re-quantises the weight and copies each
    transposed operand (``scaled_mm`` makes ``b`` column-major). Same numbers as ``_Fp8Matmul``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, rowwise: bool) -> torch.Tensor:
        xq, xs = kernels.fp8_quantize(x, E4M3, rowwise)
        wq, ws = kernels.fp8_quantize(weight, E4M3, rowwise)
        y = kernels.fp8_scaled_mm(xq, wq.t(), xs, ws.reshape(1, -1) if rowwise else ws, x.dtype, True)
        ctx.rowwise, ctx.x_dtype = rowwise, x.dtype
        ctx.save_for_backward(x if rowwise else xq, None if rowwise else xs, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_or_xq, xs, weight = ctx.saved_tensors
        xq = None if ctx.rowwise else x_or_xq
        gq, gs = kernels.fp8_quantize(dy.contiguous(), E5M2, False)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wq, ws = kernels.fp8_quantize(weight, E4M3, False)
            dx = kernels.fp8_scaled_mm(gq, wq, gs, ws, ctx.x_dtype, GRAD_FAST_ACCUM)
        if ctx.needs_input_grad[1]:
            if xq is None:
                xq, xs = kernels.fp8_quantize(x_or_xq, E4M3, False)
            dw = kernels.fp8_scaled_mm(gq.t(), xq, gs, xs, weight.dtype, GRAD_FAST_ACCUM)
        return dx, dw, None


def fp8_linear_unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rowwise: bool = False):
    """``fp8_linear`` through ``_Fp8MatmulUnfused`` (the baseline: no fused casts, no caches)."""
    y = _Fp8MatmulUnfused.apply(x.reshape(-1, x.shape[-1]), weight, rowwise).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` that trains with FP8 GEMMs (``fp8_linear``) and evaluates as itself. Made only by
    ``convert_to_fp8`` (a class swap in place), which sets ``fp8_rowwise``."""

    fp8_rowwise: bool = False
    fp8_keep_weight: bool = True  # False for an FSDP2-sharded weight (``convert_to_fp8``; ``fp8_linear``'s keep_weight)
    fp8_grad_amax: AmaxState | None = None  # this layer's delayed gradient scale (made at its first training forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, self.fp8_rowwise, self.fp8_keep_weight, self._grad_amax(x))

    def _grad_amax(self, x: torch.Tensor) -> AmaxState | None:
        """The layer's gradient amax state under ``GRAD_SCALING = "delayed"`` (on ``x``'s device), else None."""
        if GRAD_SCALING != "delayed":
            if GRAD_SCALING not in GRAD_SCALINGS:
                raise ValueError(f"fp8_linear.GRAD_SCALING must be one of {GRAD_SCALINGS}, got {GRAD_SCALING!r}")
            return None
        if torch.compiler.is_compiling():  # fp8_linear would drop it there (current scaling): nothing to make
            return None
        state = self.fp8_grad_amax
        if state is None or state.buf.device != x.device:
            if device.is_capturing(x):  # made inside a CUDA-graph capture, each replay would zero it: current here
                return None
            state = self.fp8_grad_amax = AmaxState(x.device)
        return state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={'rowwise' if self.fp8_rowwise else 'tensorwise'}"


def fp8_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every decoder projection named in ``FP8_TARGETS``, whatever its type."""
    return [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] in FP8_TARGETS]


def is_fp8_lora(module: nn.Module) -> bool:
    """A LoRA layer whose base can run in FP8: it has the ``fp8_rowwise`` switch and a dense base."""
    return hasattr(module, "lora_A") and hasattr(module, "fp8_rowwise") and getattr(module, "quant_shape", 0) is None


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a distributed tensor (an FSDP2 shard: the layer sees the gathered weight only in its forward
    and backward)."""
    if not torch.distributed.is_available():
        return False
    # lazy: torch.distributed.tensor exists only where torch.distributed is available (checked just above)
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def convert_to_fp8(model: nn.Module, scaling: str = "tensorwise") -> int:
    """Swap every plain ``nn.Linear`` among ``fp8_candidates`` to ``Fp8Linear`` in place (parameters kept) and switch
    on the FP8 base of every dense LoRA layer among them; returns how many. Converting twice only updates the
    scaling. A linear whose weight is already sharded (FSDP2) keeps no FP8 copy of it past the forward
    (``fp8_keep_weight``): convert after sharding, as ``TrainEngine`` does."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    n = 0
    for _, module in fp8_candidates(model):
        if type(module) in (nn.Linear, Fp8Linear):
            module.__class__ = Fp8Linear
            module.fp8_rowwise = scaling == "rowwise"
            module.fp8_keep_weight = not _is_dtensor(module.weight)
            n += 1
        elif is_fp8_lora(module):
            module.fp8_rowwise = scaling == "rowwise"
            n += 1
    return n


def convert_from_fp8(model: nn.Module) -> int:
    """Undo ``convert_to_fp8``: every ``Fp8Linear`` back to ``nn.Linear``; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is Fp8Linear:
            module.__class__ = nn.Linear
            module.__dict__.pop("fp8_rowwise", None)
            module.__dict__.pop("fp8_keep_weight", None)
            module.__dict__.pop("fp8_grad_amax", None)
            n += 1
        elif is_fp8_lora(module) and module.fp8_rowwise is not None:
            module.fp8_rowwise = None
            n += 1
    return n
