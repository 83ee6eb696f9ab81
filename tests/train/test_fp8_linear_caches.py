"""The FP8 linear's fused casts and caches change no number: ``fp8_linear`` (transposed copies written by the cast,
q/k/v and gate/up sharing one quantised input, weights cast once per micro-batch) against ``fp8_linear_unfused`` (the
earlier composition) and against itself with the caches off, bit for bit on the CPU with the reference GEMM; how
many casts a layer runs with and without the caches; the weight cache emptied by the backward (so after every
optimizer step) and never read by a plain forward; activation checkpointing's recomputation reading it."""

from __future__ import annotations

import pytest
import torch
from train_helpers import pack, random_seqs, tiny_lm

from polyrl.models import fp8_linear as fl
from polyrl.models.fp8_linear import convert_to_fp8, fp8_linear, fp8_linear_unfused
from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine, causal_lm_loss

EMULATE = "fp8_scaled_mm:reference"


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    monkeypatch.setenv("POLYRL_KERNELS", EMULATE)
    fl.clear_fp8_caches()
    yield
    fl.clear_fp8_caches()


def _caches(monkeypatch, on: bool):
    monkeypatch.setattr(fl, "INPUT_CACHE", on)
    monkeypatch.setattr(fl, "WEIGHT_CACHE", on)


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_unfused_bit_for_bit(rowwise, dtype):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 7, 48, generator=g).to(dtype)  # 21 tokens: the dW GEMM's reduction dim is no multiple of 16
    w0 = (torch.randn(40, 48, generator=g) * 0.05).to(dtype)
    b0 = torch.randn(40, generator=g).to(dtype)
    dy = torch.randn(3, 7, 40, generator=g).to(dtype)
    outs = []
    for fn in (fp8_linear, fp8_linear_unfused):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = fn(x, w, b, rowwise)
        y.backward(dy)
        outs.append((y.detach(), x.grad, w.grad, b.grad))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("rowwise", [False, True])
def test_padded_token_dim_gives_the_same_weight_gradient(monkeypatch, rowwise):
    """Where the weight gradient runs on ``torch._scaled_mm`` the casts pad X^T's and dY^T's token dim to a multiple
    of 16 with zeros (here forced on the reference GEMM): the products are the same up to fp32 summation order."""
    g = torch.Generator().manual_seed(4)
    x0, w0, dy = torch.randn(21, 48, generator=g), torch.randn(40, 48, generator=g) * 0.05, torch.randn(21, 40)
    outs = []
    for pad in (1, 16):
        monkeypatch.setattr(fl, "_token_pad", lambda t, p=pad: p)
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, s=saved: s.append(t) or t, lambda t: t):
            y = fp8_linear(x, w, None, rowwise)
        y.backward(dy)
        x_t = [tuple(t.shape) for t in saved if t.dim() == 2 and t.shape[-1] in (21, 32)]
        assert x_t == [(48, 21 if pad == 1 else 32)]  # X^T saved with its token dim padded
        outs.append((y.detach(), x.grad, w.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[0][2], outs[1][2], rtol=1e-6, atol=1e-7)


def _count_casts(monkeypatch) -> list[tuple]:
    """Record every e4m3 cast of an input or weight the FP8 linear runs: (shape, with transposed copy)."""
    calls = []
    inner = fl._quantize

    def spy(t, rowwise, with_t, *pad):
        calls.append((tuple(t.shape), with_t))
        return inner(t, rowwise, with_t, *pad)

    monkeypatch.setattr(fl, "_quantize", spy)
    return calls


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, _ = causal_lm_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_caches_change_no_number_and_cut_the_casts(monkeypatch, checkpointing):
    batch = pack(random_seqs(2, 40, 64, seed=3))
    results, counts = {}, {}
    for on in (False, True):
        _caches(monkeypatch, on)
        model = tiny_lm(seed=0, hidden=64)
        model.gradient_checkpointing = checkpointing
        convert_to_fp8(model, "tensorwise")
        calls = _count_casts(monkeypatch)
        results[on] = _grads(model, batch)
        counts[on] = len(calls)
        assert all(with_t for _, with_t in calls)  # every cast here has a weight gradient or input gradient to feed
        monkeypatch.undo()
        monkeypatch.setenv("POLYRL_KERNELS", EMULATE)
        assert fl._WEIGHTS.entries == {}  # the backward dropped every weight's entry
    (la, ga), (lb, gb) = results[False], results[True]
    assert torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    layers = 2
    # per layer: 7 weights + 7 inputs without the caches; 7 weights + 4 inputs (attention in, o in, MLP in, down in)
    # with them; a checkpointed layer runs its forward twice, and the recomputation casts no weight with the cache
    per_layer_off, per_layer_on = 14, 11
    if checkpointing:
        assert counts == {False: 2 * per_layer_off * layers, True: (per_layer_on + 4) * layers}
    else:
        assert counts == {False: per_layer_off * layers, True: per_layer_on * layers}


def test_steps_with_caches_equal_steps_without(monkeypatch):
    """Three optimizer steps (the weights change in place between them): the same losses and weights bit for bit, so
    no step read another step's FP8 weights; after each step the weight cache is empty."""
    batch = pack(random_seqs(2, 40, 64, seed=5))
    runs = {}
    for on in (False, True):
        _caches(monkeypatch, on)
        model = tiny_lm(seed=1, hidden=64)
        eng = TrainEngine(
            model,
            OptimConfig(lr=3e-3, grad_clip=None),
            ScheduleConfig(decay="constant"),
            PrecisionConfig("fp32", linear="fp8"),
            StepConfig(activation_checkpointing=True),
        )
        losses = []
        for _ in range(3):
            losses.append(eng.step([batch, batch]).loss)  # two micro-batches: each casts each weight once
            assert fl._WEIGHTS.entries == {}
        runs[on] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    assert runs[False][0] == runs[True][0]
    assert all(torch.equal(runs[False][1][n], runs[True][1][n]) for n in runs[False][1])


def test_weight_cache_is_read_only_by_a_recomputation(monkeypatch):
    """A forward whose backward never runs leaves its weight's entry behind; a later plain forward must not read it
    (here the weight is changed through ``.data``, which bumps no version: only the rule saves it), a recomputation
    inside the backward does."""
    _caches(monkeypatch, True)
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(24, 32, generator=g) * 0.1)
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    fp8_linear(x, w, None)  # no backward: the entry stays
    assert len(fl._WEIGHTS.entries) == 1
    w.data.mul_(3.0)  # no version bump
    y = fp8_linear(x, w, None)
    expect = fp8_linear_unfused(x, w, None)
    assert torch.equal(y, expect)
    monkeypatch.setattr(fl, "INPUT_CACHE", False)  # count the input's casts too
    calls = _count_casts(monkeypatch)
    y = torch.utils.checkpoint.checkpoint(fp8_linear, x, w, None, use_reentrant=False)
    y.sum().backward()
    # the checkpointed forward casts x and w; the recomputation casts x again and reads w's entry
    assert [s for s, _ in calls] == [(16, 32), (24, 32), (16, 32)]
    assert fl._WEIGHTS.entries == {} and w.grad is not None


def test_input_slot_follows_identity_and_version(monkeypatch):
    _caches(monkeypatch, True)
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.nn.Parameter(torch.randn(8, 32, generator=g)) for _ in range(2))
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    calls = _count_casts(monkeypatch)
    h = x * 1.0
    fp8_linear(h, w1, None)
    fp8_linear(h, w2, None)  # same input: no new input cast
    assert [s for s, _ in calls] == [(16, 32), (8, 32), (8, 32)]
    with torch.no_grad():
        h.mul_(2.0)  # in place: a new version
    y = fp8_linear(h, w1, None)
    assert [s for s, _ in calls][3:] == [(16, 32), (8, 32)]
    assert torch.equal(y, fp8_linear_unfused(h, w1, None))
    del h  # the slot lets go of the input's FP8 copies with the input
    assert fl._INPUT.value is None


def test_keep_weight_false_saves_no_fp8_weight_and_changes_no_number(monkeypatch):
    """``keep_weight=False`` (an FSDP2-sharded weight): the backward casts the weight again instead of reading a
    saved FP8 copy; the same numbers, and the only weight-sized tensor saved is the weight itself."""
    _caches(monkeypatch, True)
    g = torch.Generator().manual_seed(2)
    x0, w0, dy = torch.randn(21, 48, generator=g), torch.randn(40, 48, generator=g) * 0.05, torch.randn(21, 40)
    results = {}
    for keep in (True, False):
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, s=saved: s.append(t) or t, lambda t: t):
            y = fp8_linear(x, w, None, False, keep)
        y.backward(dy)
        results[keep] = (y.detach(), x.grad, w.grad)
        weight_sized = [t for t in saved if t.shape in ((40, 48), (48, 40))]
        assert [t.dtype for t in weight_sized] == ([torch.float8_e4m3fn] if keep else [torch.float32])
        fl.clear_fp8_caches()
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


def test_convert_marks_only_sharded_weights():
    model = tiny_lm(seed=0)
    convert_to_fp8(model)
    assert all(m.fp8_keep_weight for m in model.modules() if isinstance(m, fl.Fp8Linear))


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("polyrl.platform.device", fromlist=["x"]).supports_fp8_gemm(), reason="needs an FP8 GPU (sm89+)"
)
@pytest.mark.parametrize("rowwise", [False, True])
def test_gpu_fused_equals_unfused(monkeypatch, rowwise):
    """On the GPU (Triton casts, ``torch._scaled_mm``) at a training shape: the fused path hands the GEMMs the very
    bytes the unfused one copies into place, so outputs and gradients are equal."""
    monkeypatch.delenv("POLYRL_KERNELS", raising=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(4096, 1024, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(3072, 1024, device="cuda", generator=g) * 0.03).bfloat16()
    dy = torch.randn(4096, 3072, device="cuda", generator=g).bfloat16()
    outs = []
    for fn in (fp8_linear, fp8_linear_unfused):
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        y = fn(x, w, None, rowwise)
        y.backward(dy)
        outs.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _grads_of(fn, x0, w0, dy, **kw):
    x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
    y = fn(x, w, None, **kw)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_delayed_gradient_scale_first_current_then_the_previous_amax():
    """With a gradient amax state: the first backward is the current-scaling one (bit for bit), the second casts
    dY with the first dY's amax x 256 (the dX and dW GEMMs equal the reference GEMM of that cast), forwards change
    not at all; without a state every call is the current one."""
    from polyrl.kernels.fp8 import AmaxState
    from polyrl.kernels.fp8 import reference as ref

    g = torch.Generator().manual_seed(5)
    x0, w0 = torch.randn(21, 48, generator=g), torch.randn(40, 48, generator=g) * 0.05
    dy1, dy2 = torch.randn(21, 40, generator=g), torch.randn(21, 40, generator=g) * 3.0
    state = AmaxState("cpu")
    first = _grads_of(fp8_linear, x0, w0, dy1, grad_amax=state)
    assert all(torch.equal(a, b) for a, b in zip(first, _grads_of(fp8_linear_unfused, x0, w0, dy1)))
    assert state.ready and state.amax() == dy1.abs().max()
    y, dx, dw = _grads_of(fp8_linear, x0, w0, dy2, grad_amax=state)
    cur_y, cur_dx, cur_dw = _grads_of(fp8_linear, x0, w0, dy2)
    assert torch.equal(y, cur_y) and not torch.equal(dw, cur_dw) and state.amax() == dy2.abs().max()
    sim = ref.quantize_t_delayed(dy2, torch.float8_e5m2, torch.zeros(2, dtype=torch.int32), False)
    buf = torch.zeros(2, dtype=torch.int32)
    buf[:1] = dy1.abs().max().reshape(1).view(torch.int32)
    gq, gs, gq_t, _ = ref.quantize_t_delayed(dy2, torch.float8_e5m2, buf, True)
    assert not torch.equal(gq.view(torch.uint8), sim[0].view(torch.uint8))  # another scale: other codes
    wq_t, ws_t = ref.quantize(w0.t().contiguous(), torch.float8_e4m3fn)  # W^T's tensor-wise cast = W's, transposed
    xq_t, xs_t = ref.quantize(x0.t().contiguous(), torch.float8_e4m3fn)
    assert torch.equal(dx, ref.scaled_mm(gq, wq_t.t(), gs, ws_t, torch.float32))
    assert torch.equal(dw, ref.scaled_mm(gq_t, xq_t.t(), gs, xs_t, torch.float32))
    exact = dy2.t() @ x0  # e5m2 keeps 2 mantissa bits at either scale: both as close to the exact product
    err, cur_err = ((dw - exact).norm() / exact.norm()).item(), ((cur_dw - exact).norm() / exact.norm()).item()
    assert err < 0.1 and cur_err < 0.1 and err < 1.5 * cur_err, (err, cur_err)


def test_fp8_linear_module_keeps_a_gradient_state_per_layer(monkeypatch):
    """``Fp8Linear`` under ``GRAD_SCALING = "delayed"`` makes its state at the first training forward and reuses it;
    "current" passes none (its gradients equal the stateless call's); a bad value is refused; converting back drops
    the state."""
    monkeypatch.setattr(fl, "GRAD_SCALING", "delayed")  # opt-in (the default is "current")
    model = tiny_lm(seed=0, hidden=32)
    convert_to_fp8(model)
    lin = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, lin.in_features)
    assert lin.fp8_grad_amax is None
    lin(x).sum().backward()
    state = lin.fp8_grad_amax
    assert state is not None and state.ready and state.buf.device == x.device
    lin(x).sum().backward()
    assert lin.fp8_grad_amax is state and model.model.layers[1].mlp.down_proj.fp8_grad_amax is None
    monkeypatch.setattr(fl, "GRAD_SCALING", "current")
    lin.weight.grad = None
    lin(x).sum().backward()
    assert torch.equal(
        lin.weight.grad, _grads_of(fp8_linear, x, lin.weight.detach(), torch.ones(5, lin.out_features))[2]
    )
    monkeypatch.setattr(fl, "GRAD_SCALING", "late")
    with pytest.raises(ValueError, match="GRAD_SCALING must be one of"):
        lin(x)
    fl.convert_from_fp8(model)
    assert "fp8_grad_amax" not in lin.__dict__
