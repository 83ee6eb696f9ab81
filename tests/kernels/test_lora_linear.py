"""lora_linear: the fused autograd node (adapter products added by the GEMMs) against the plain composition, in
forward and every gradient; selection through the registry; LoraLinear takes it in the training case."""

from __future__ import annotations

import pytest
import torch

from polyrl import kernels
from polyrl.kernels.lora_linear.fused import lora_linear as fused
from polyrl.kernels.lora_linear.fused import lora_linear_adapter_first as fused_adapter_first
from polyrl.kernels.lora_linear.reference import lora_linear as reference


def _inputs(shape, n_out, r, dtype, device, bias, gen, base_grad=False):
    k = shape[-1]
    x = torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(n_out, k, generator=gen) / k**0.5).to(device, dtype).requires_grad_(base_grad)
    b = torch.randn(n_out, generator=gen).to(device, dtype).requires_grad_(base_grad) if bias else None
    a = (torch.randn(r, k, generator=gen) / k**0.5).to(device, dtype).requires_grad_()
    bb = torch.randn(n_out, r, generator=gen).to(device, dtype).requires_grad_()  # non-zero: B's path is tested
    return x, w, b, a, bb


def _run(fn, inputs, dy):
    x, w, b, a, bb = inputs
    y = fn(x, w, b, a, bb, 2.0)
    y.backward(dy)
    grads = [t.grad for t in (x, w, b, a, bb) if t is not None and t.requires_grad]
    return y.detach(), grads


@pytest.mark.parametrize("impl", [fused, fused_adapter_first], ids=["fused", "adapter_first"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(7, 32), (2, 5, 48)])
@pytest.mark.parametrize("base_grad", [False, True])
def test_fused_equals_the_composition_forward_and_backward_fp32(shape, bias, base_grad, impl, seeded):
    n_out, r = 24, 4
    ins = _inputs(shape, n_out, r, torch.float32, "cpu", bias, seeded, base_grad)
    dy = torch.randn(*shape[:-1], n_out, generator=seeded)
    clone = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in ins]
    y_ref, g_ref = _run(reference, ins, dy)
    y_fused, g_fused = _run(impl, clone, dy)
    assert y_fused.shape == y_ref.shape == (*shape[:-1], n_out)
    assert torch.allclose(y_fused, y_ref, atol=1e-5, rtol=1e-5)
    assert len(g_fused) == len(g_ref) == 3 + ((1 + bias) if base_grad else 0)
    for gf, gr in zip(g_fused, g_ref):
        assert gf.shape == gr.shape
        assert torch.allclose(gf, gr, atol=1e-4, rtol=1e-4), (gf - gr).abs().max()
    if not base_grad:
        assert ins[1].grad is None and clone[1].grad is None  # the frozen base gets no gradient


def test_fused_node_does_not_differentiate_frozen_inputs(seeded):
    x, w, b, a, bb = _inputs((6, 16), 8, 2, torch.float32, "cpu", True, seeded)
    x.requires_grad_(False)
    y = fused(x, w, b, a, bb, 0.5)
    y.sum().backward()
    assert x.grad is None and w.grad is None and b.grad is None
    assert a.grad is not None and bb.grad is not None


def test_registry_picks_the_fused_node_and_the_reference_can_be_forced(monkeypatch):
    x = torch.randn(3, 8)
    assert kernels.registry.select("lora_linear", "cpu", "float32")[0] == "fused_adapter_first"
    monkeypatch.setenv("POLYRL_KERNELS", "lora_linear:reference")
    kernels.registry.reset_cache()
    try:
        assert kernels.registry.select("lora_linear", "cpu", "float32")[0] == "reference"
        y = kernels.lora_linear(x, torch.eye(8), None, torch.zeros(2, 8), torch.zeros(8, 2), 1.0)
        assert torch.equal(y, x)
    finally:
        monkeypatch.delenv("POLYRL_KERNELS")
        kernels.registry.reset_cache()


def test_lora_layer_uses_the_fused_node_when_training_and_matches_the_composition(seeded):
    from polyrl.models.lora.layer import LoraLinear

    base = torch.nn.Linear(32, 16, bias=True)
    layer = LoraLinear(base, r=4, scaling=2.0)
    torch.nn.init.normal_(layer.lora_B.weight, generator=seeded)
    x = torch.randn(5, 32, generator=seeded, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == "_FusedLoraLinearBackward"
    want = reference(x, layer.weight, layer.bias, layer.lora_A.weight, layer.lora_B.weight, 2.0)
    assert torch.allclose(y, want, atol=1e-5)
    layer.disabled = True
    assert torch.allclose(layer(x), base(x))


@pytest.mark.gpu
def test_fused_nf4_base_equals_the_composition_on_the_gpu(seeded):
    """QLoRA's node: the NF4 base dequantized by the Triton kernel in forward and backward, against the reference
    composition (nf4_matmul + adapter) in bf16, both within the bf16 error of the fp32 result."""
    from polyrl.kernels.nf4.reference import NF4Weight, dequantize_nf4, quantize_nf4
    from polyrl.platform import device

    dev = device.torch_device()
    if dev.type == "cpu":
        pytest.skip("needs an accelerator")
    shape, n_out, r = (2, 1024, 2048), 6144, 16
    x, w, _, a, bb = _inputs(shape, n_out, r, torch.bfloat16, dev, False, seeded)
    packed, absmax = quantize_nf4(w.detach())
    nf4 = NF4Weight(packed, absmax, (n_out, shape[-1]))
    dense = dequantize_nf4(packed, absmax, nf4.shape, torch.float32)
    dy = torch.randn(*shape[:-1], n_out, generator=seeded).to(dev, torch.bfloat16)

    def run(fn, base, dtype):
        xs, As, Bs = (t.detach().to(dtype).requires_grad_() for t in (x, a, bb))
        y = fn(xs, base, None, As, Bs, 2.0)
        y.backward(dy.to(dtype))
        return [y.detach(), xs.grad, As.grad, Bs.grad]

    exact = run(reference, dense, torch.float32)
    low = run(reference, nf4, torch.bfloat16)
    got = run(fused, nf4, torch.bfloat16)
    for g, lo, ex in zip(got, low, exact):
        err, budget = (g.float() - ex).abs().max(), (lo.float() - ex).abs().max()
        assert err <= 2 * budget + 1e-3, (err, budget)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [fused, fused_adapter_first], ids=["fused", "adapter_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_the_composition_on_the_gpu(dtype, impl, seeded):
    from polyrl.platform import device

    dev = device.torch_device()
    if dev.type == "cpu":
        pytest.skip("needs an accelerator")
    shape, n_out, r = (2, 1024, 2048), 6144, 16
    ins = _inputs(shape, n_out, r, dtype, dev, False, seeded)
    dy = torch.randn(*shape[:-1], n_out, generator=seeded).to(dev, dtype)
    clone = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in ins]
    fp32 = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None for t in ins]
    y_ref, g_ref = _run(reference, fp32, dy.float())
    y_low, g_low = _run(reference, ins, dy)  # the composition in the low precision: the error budget
    y_fused, g_fused = _run(impl, clone, dy)
    for got, low, exact in zip([y_fused, *g_fused], [y_low, *g_low], [y_ref, *g_ref]):
        err, budget = (got.float() - exact).abs().max(), (low.float() - exact).abs().max()
        assert err <= 2 * budget + 1e-3, (err, budget)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_nf4_and_dropout_paths_add_the_adapter_in_place_with_the_compositions_gradients(dropout, seeded):
    """An NF4 base (or dropout) keeps the base matmul and adds the adapter with an in-place addmm_: its output and
    its gradients (input, A, B) equal the composition over the dequantized base with the same dropout mask."""
    from polyrl.models.lora.layer import LoraLinear

    base = torch.nn.Linear(64, 24, bias=False)
    layer = LoraLinear(base, r=4, scaling=2.0, dropout=dropout)
    torch.nn.init.normal_(layer.lora_B.weight, generator=seeded)
    layer.quantize_nf4()
    w = layer.base_weight(torch.float32)
    x = torch.randn(2, 5, 64, generator=seeded, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(2, 5, 24, generator=seeded)
    torch.manual_seed(7)
    y = layer(x)
    y.backward(dy)
    got = [x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad]
    layer.zero_grad()
    torch.manual_seed(7)  # the same dropout mask
    h = torch.nn.functional.dropout(x_ref, dropout, True) if dropout else x_ref
    want_y = x_ref @ w.t() + (h @ layer.lora_A.weight.t()) @ layer.lora_B.weight.t() * 2.0
    want_y.backward(dy)
    want = [x_ref.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad]
    assert torch.allclose(y, want_y, atol=1e-4)
    for g, r in zip(got, want):
        assert torch.allclose(g, r, atol=1e-4), (g - r).abs().max()
