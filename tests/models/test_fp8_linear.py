"""FP8 training linear: each of its three GEMMs is exactly the product of the quantised operands the module
docstring names (e4m3 forward, e5m2 x e4m3 backward; tensor-wise and row-wise), it approximates the exact linear to
FP8 accuracy, and the module swap keeps parameters and names and touches only the decoder projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polyrl.kernels.fp8 import reference as ref
from polyrl.models.fp8_linear import FP8_TARGETS, Fp8Linear, convert_from_fp8, convert_to_fp8, fp8_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _deq(t, fp8, rowwise=False):
    q, s = ref.quantize(t, fp8, rowwise)
    return q.double() * s.double()


@pytest.mark.parametrize("rowwise", [False, True])
def test_gemms_are_the_quantised_products(rowwise):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 48, generator=g, requires_grad=True)  # [B, S, K] -> 18 tokens (not a multiple of 16)
    w = (torch.randn(40, 48, generator=g) * 0.05).requires_grad_()
    b = torch.randn(40, generator=g, requires_grad=True)
    dy = torch.randn(2, 9, 40, generator=g)
    y = fp8_linear(x, w, b, rowwise)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(18, 48), dy.reshape(18, 40)
    expect_y = _deq(x2, E4M3, rowwise) @ _deq(w.detach(), E4M3, rowwise).t() + b.detach().double()
    torch.testing.assert_close(y.detach().reshape(18, 40).double(), expect_y, rtol=1e-5, atol=1e-5)
    g8 = _deq(dy2, E5M2)  # the gradient GEMMs: tensor-wise in both recipes
    torch.testing.assert_close(x.grad.reshape(18, 48).double(), g8 @ _deq(w.detach(), E4M3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), g8.t() @ _deq(x2, E4M3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, dy2.sum(0))
    # FP8 accuracy against the exact linear: relative error of a few percent (e4m3: <= 2^-4 per operand element,
    # e5m2: <= 2^-3), never zero (it did quantise) and never more than the per-element bound
    exact = x2 @ w.detach().t()
    rel = ((y.detach().reshape(18, 40) - b.detach() - exact).norm() / exact.norm()).item()
    assert 1e-3 < rel < 2 * 2.0**-4, rel
    gw = dy2.t() @ x2
    rel_w = ((w.grad - gw).norm() / gw.norm()).item()
    assert 1e-3 < rel_w < 2.0**-4 + 2.0**-3, rel_w


def test_frozen_weight_gets_no_gradient_gemm():
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(16, 32)
    fp8_linear(x, w, None).sum().backward()
    assert x.grad is not None and w.grad is None


def test_module_swap_keeps_parameters_and_targets_only_projections(tiny_model):
    model = tiny_model("qwen3")
    params = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n = convert_to_fp8(model, "rowwise")
    layers = model.config.num_layers
    assert n == 7 * layers
    for name, module in model.named_modules():
        is_target = name.rpartition(".")[2] in FP8_TARGETS
        assert (type(module) is Fp8Linear) == is_target, name
        if is_target:
            assert module.fp8_rowwise
    assert type(model.lm_head) is not Fp8Linear if model.lm_head is not None else True
    assert {n: p for n, p in model.named_parameters()} == params  # the very same Parameter objects
    assert list(model.state_dict()) == list(state)
    assert convert_to_fp8(model, "tensorwise") == n and not model.model.layers[0].self_attn.q_proj.fp8_rowwise
    assert convert_from_fp8(model) == n
    assert all(type(m) is not Fp8Linear for m in model.modules())
    with pytest.raises(ValueError, match="scaling"):
        convert_to_fp8(model, "blockwise")


def test_eval_mode_is_the_plain_linear():
    torch.manual_seed(0)
    lin = nn.Linear(32, 24)
    ref_lin = nn.Linear(32, 24)
    ref_lin.load_state_dict(lin.state_dict())
    holder = nn.ModuleDict({"q_proj": lin})
    convert_to_fp8(holder)
    x = torch.randn(5, 32)
    holder.eval()
    assert torch.equal(lin(x), ref_lin(x))
    holder.train()
    assert not torch.equal(lin(x), ref_lin(x))
    # e4m3 rounds each operand by up to 2^-4 relative: the product's error is a few percent of its norm, not per element
    assert (lin(x) - ref_lin(x)).norm() / ref_lin(x).norm() < 0.08


def test_lora_layer_on_an_fp8_base():
    """A LoRA layer with the FP8 base switched on: forward = FP8 base + adapter in train mode, the plain composition
    in eval mode; ``base_onto`` (the frozen down projection after a checkpoint) adds the FP8 base too."""
    from polyrl.models.lora.layer import LoraLinear

    g = torch.Generator().manual_seed(0)
    base = nn.Linear(32, 48)
    base.weight.requires_grad_(False)
    lora = LoraLinear(base, r=4, scaling=2.0)
    lora.reset_adapter(g)
    nn.init.normal_(lora.lora_B.weight, std=0.1, generator=g)
    holder = nn.ModuleDict({"down_proj": lora})
    assert convert_to_fp8(holder, "rowwise") == 1 and lora.fp8_rowwise is True
    x = torch.randn(10, 32, generator=g)
    expect = fp8_linear(x, lora.weight, lora.bias, True) + lora.adapter_product(x)
    torch.testing.assert_close(lora(x), expect)
    acc = torch.randn(10, 48, generator=g)
    torch.testing.assert_close(lora.base_onto(acc, x), acc + fp8_linear(x, lora.weight, lora.bias, True))
    holder.eval()
    plain = F.linear(x, lora.weight, lora.bias) + lora.adapter_product(x)
    torch.testing.assert_close(lora(x), plain)
    assert convert_from_fp8(holder) == 1 and lora.fp8_rowwise is None
