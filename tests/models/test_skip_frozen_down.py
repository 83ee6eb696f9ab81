"""DecoderOptions.skip_frozen_down_recompute: under activation checkpointing a frozen down projection (LoRA, QLoRA,
or no adapter there) runs after the layer's checkpoint. Same outputs and adapter gradients as the checkpointed layer,
one frozen-base GEMM fewer per layer and step, and nothing more saved."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from model_helpers import packed
from torch.utils._python_dispatch import TorchDispatchMode

from polyrl.models import decoder
from polyrl.models.lora import LoraConfig, adapter_parameters, apply_lora

NO_DOWN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def _lora_model(tiny_model, quantize=None, targets=None, dtype=torch.float32, device="cpu"):
    model = tiny_model(seed=0).to(device, dtype)
    cfg = LoraConfig(r=4, alpha=8, quantize_base=quantize, **({"targets": targets} if targets else {}))
    apply_lora(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 at init would hide the adapter's part (and A's gradient)
        for p in adapter_parameters(model).values():
            # in the compute dtype, as the training engine casts them (the fused path needs one dtype)
            p.data = (0.2 * torch.randn(p.shape, generator=g)).to(p.device, dtype)
    model.gradient_checkpointing = True
    return model.train()


def _step(model, skip: bool, lens=(9, 5, 12)):
    model.options = dataclasses.replace(model.options, skip_frozen_down_recompute=skip)
    dev = next(model.parameters()).device
    ids, pos, meta = packed(list(lens), model.config.vocab_size)
    ids, pos, meta = ids.to(dev), pos.to(dev), meta.to(dev)
    h = model(ids, pos, meta)
    proj = torch.randn(h.shape, generator=torch.Generator().manual_seed(2)).to(dev)
    (h.float() * proj).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return h.detach(), grads


@pytest.mark.parametrize("quantize", [None, "nf4"], ids=["lora", "qlora"])
def test_same_output_and_adapter_gradients(tiny_model, quantize):
    model = _lora_model(tiny_model, quantize)
    assert all(decoder.down_splits(layer) for layer in model.model.layers)
    h_off, g_off = _step(model, False)
    h_on, g_on = _step(model, True)
    torch.testing.assert_close(h_on, h_off, rtol=1e-6, atol=1e-6)
    assert g_off.keys() == g_on.keys() and len(g_on) > 0
    for n in g_off:
        torch.testing.assert_close(g_on[n], g_off[n], rtol=1e-5, atol=1e-6, msg=n)


class _WeightUses(TorchDispatchMode):
    """Counts matmuls that read any of the given tensors' storage."""

    def __init__(self, tensors):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten.mm.default, aten.addmm.default, aten.addmm_.default):
            self.count += sum(
                1 for a in args if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.ptrs
            )
        return func(*args, **(kwargs or {}))


def test_the_frozen_down_gemm_is_not_recomputed(tiny_model):
    model = _lora_model(tiny_model)
    downs = [layer.mlp.down_proj.weight for layer in model.model.layers]
    uses = {}
    for skip in (False, True):
        with _WeightUses(downs) as mode:
            _step(model, skip)
        uses[skip] = mode.count
    layers = len(downs)
    # forward, recomputed forward, input gradient -> forward, input gradient
    assert uses == {False: 3 * layers, True: 2 * layers}


def _dense_of(nf4):
    from polyrl.kernels.nf4.reference import dequantize_nf4

    return dequantize_nf4(nf4.packed, nf4.absmax, nf4.shape, torch.float32)


def test_the_frozen_base_saves_no_activation():
    from polyrl.kernels.lora_linear.fused import frozen_base_onto
    from polyrl.kernels.nf4.reference import NF4Weight, quantize_nf4

    w = torch.randn(8, 64)
    x = torch.randn(5, 64, requires_grad=True)
    acc = torch.randn(5, 8, requires_grad=True)
    for weight in (w, NF4Weight(*quantize_nf4(w), (8, 64))):
        saved: list[torch.Tensor] = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = frozen_base_onto(acc, x, weight, None)
        assert [s.data_ptr() for s in saved] == ([w.data_ptr()] if weight is w else [])
        y.sum().backward()
        dense = w if weight is w else _dense_of(weight)
        torch.testing.assert_close(x.grad, torch.ones(5, 8) @ dense)
        torch.testing.assert_close(acc.grad, torch.ones(5, 8))
        x.grad = acc.grad = None
    with pytest.raises(ValueError, match="frozen"):
        frozen_base_onto(None, x, torch.randn(8, 64, requires_grad=True), None)


def test_which_down_projections_split(tiny_model):
    full = tiny_model(seed=0)  # full fine-tuning: the down weight needs its input, it stays inside
    assert not any(decoder.down_splits(layer) for layer in full.model.layers)
    # a frozen down_proj without an adapter saves nothing, so the checkpoint never recomputes it: nothing to split
    no_down = _lora_model(tiny_model, targets=NO_DOWN)
    assert not any(decoder.down_splits(layer) for layer in no_down.model.layers)
    model = _lora_model(tiny_model)
    down = model.model.layers[0].mlp.down_proj
    down.merge()
    assert not decoder.down_splits(model.model.layers[0])
    down.unmerge()
    down.dropout = 0.1  # dropout draws inside the checkpoint: left to the fused path
    assert not decoder.down_splits(model.model.layers[0])
    model.eval()
    assert decoder.down_splits(model.model.layers[0])


def test_full_training_is_unchanged_with_the_flag_on(tiny_model):
    model = tiny_model(seed=0).train()
    model.gradient_checkpointing = True
    twin = copy.deepcopy(model)
    h_off, g_off = _step(model, False)
    h_on, g_on = _step(twin, True)
    assert torch.equal(h_on, h_off)
    assert all(torch.equal(g_on[n], g_off[n]) for n in g_off)


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_gpu_bf16_same_gradients_and_no_more_memory(tiny_model, quantize):
    from polyrl.platform import device

    dev = device.torch_device()
    model = _lora_model(tiny_model, quantize, dtype=torch.bfloat16, device=dev)
    lens = (700, 300, 1000)
    peaks, outs = {}, {}
    for skip in (False, True, False, True):  # the first pair warms the kernels up
        device.synchronize()
        device.reset_peak_memory_stats()
        base = device.memory_allocated()
        outs[skip] = _step(model, skip, lens)
        device.synchronize()
        peaks[skip] = device.max_memory_allocated() - base
    h_off, g_off = outs[False]
    h_on, g_on = outs[True]
    torch.testing.assert_close(h_on, h_off, rtol=2e-2, atol=2e-2)
    for n in g_off:
        torch.testing.assert_close(g_on[n].float(), g_off[n].float(), rtol=5e-2, atol=5e-2, msg=n)
    assert peaks[True] <= peaks[False] * 1.02 + 2**20, peaks
