"""skinny_linear: the Triton kernel against ``F.linear`` (every row count up to MAX_ROWS, widths that are not
multiples of the blocks, bias, strided input, fp32 and bf16), its input checks, and the decoder's routing
(``project``): only plain ``nn.Linear`` with autograd off and a few rows goes there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polyrl.kernels.skinny_linear import MAX_ROWS, ROUTE_MAX_ROWS


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(24, 64), (37, 130), (8, 1000)])
def test_triton_fp32_matches_linear(triton_kernels, kernel_check, rows, n, k):
    fn = triton_kernels.load("skinny_linear")
    dev = triton_kernels.device
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).to(dev)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dev)
    b = torch.randn(n, generator=g).to(dev)
    kernel_check.assert_close(fn(x, w), F.linear(x, w), torch.float32, "y")
    kernel_check.assert_close(fn(x, w, b), F.linear(x, w, b), torch.float32, "y + bias")


def test_triton_bf16_and_strided_input(triton_kernels, kernel_check):
    fn = triton_kernels.load("skinny_linear")
    dev = triton_kernels.device
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 2 * 192, generator=g).to(dev, torch.bfloat16)
    x = wide[:, ::2]  # a non-contiguous [4, 192] view
    w = (torch.randn(40, 192, generator=g) * 0.07).to(dev, torch.bfloat16)
    y = fn(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 40)
    kernel_check.assert_close(y, F.linear(x.float(), w.float()), torch.bfloat16, "bf16 y")


def test_triton_rejects_bad_shapes(triton_kernels):
    fn = triton_kernels.load("skinny_linear")
    dev = triton_kernels.device
    with pytest.raises(ValueError, match="at most"):
        fn(torch.zeros(MAX_ROWS + 1, 4, device=dev), torch.zeros(3, 4, device=dev))
    with pytest.raises(ValueError, match="expected x"):
        fn(torch.zeros(2, 5, device=dev), torch.zeros(3, 4, device=dev))
    assert fn(torch.zeros(0, 4, device=dev), torch.zeros(3, 4, device=dev)).shape == (0, 3)


def test_decoder_projects_decode_sized_inputs_through_skinny_linear(monkeypatch):
    import polyrl.kernels as K
    from polyrl.models import decoder

    calls = []
    real = K.skinny_linear

    def spy(x, w, b=None):
        calls.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(K, "skinny_linear", spy)
    lin = nn.Linear(16, 12)
    x = torch.randn(ROUTE_MAX_ROWS, 16)
    with torch.no_grad():
        torch.testing.assert_close(decoder.project(lin, x), lin(x), rtol=0, atol=0)  # the reference is F.linear
        decoder.project(lin, torch.randn(ROUTE_MAX_ROWS + 1, 16))  # more rows: the module (cuBLAS)
    decoder.project(lin, x)  # autograd on: the module (training never takes the kernel)
    with torch.inference_mode():
        decoder.project(lin, x[:1])
    assert calls == [(ROUTE_MAX_ROWS, 16), (1, 16)]


def test_decode_with_skinny_projections_matches_prefill_logits():
    """A decode step (1 row per sequence through ``project``) gives the logits a full causal forward gives."""
    from polyrl.infer import LLM, EngineConfig, SamplingParams
    from polyrl.models.decoder import build_model
    from polyrl.models.presets import preset_config

    model = build_model(preset_config("tiny"), dtype=torch.float32, device="cpu", seed=0).eval()
    llm = LLM(model, None, EngineConfig(num_blocks=64, max_num_seqs=4))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0]
    ids = torch.tensor([5, 6, 7, 8] + out.token_ids[:-1])
    from polyrl.models.attention_metadata import AttnMetadata

    with torch.no_grad():
        cu = torch.tensor([0, ids.numel()], dtype=torch.int32)
        hidden = model(ids, torch.arange(ids.numel()), AttnMetadata(cu_seqlens=cu, max_seqlen=ids.numel()))
        greedy = model.compute_logits(hidden)[3:].argmax(-1)
    assert greedy.tolist() == out.token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gpu_decode_projection_shapes_match_linear(triton_kernels, kernel_check, rows):
    """qwen3-0.6b's projections (bf16) on the device, against cuBLAS in fp32."""
    fn = triton_kernels.load("skinny_linear")
    dev = triton_kernels.device
    g = torch.Generator().manual_seed(rows)
    for n, k in [(2048, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (1024, 3072)]:
        x = torch.randn(rows, k, generator=g).to(dev, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dev, torch.bfloat16)
        b = torch.randn(n, generator=g).to(dev, torch.bfloat16)
        kernel_check.assert_close(fn(x, w, b), F.linear(x.float(), w.float(), b.float()), torch.bfloat16, f"{n}x{k}")
