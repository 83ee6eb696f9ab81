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


def _spy_skinny(monkeypatch, fast: bool) -> list:
    """Record ``kernels.skinny_linear`` calls; ``fast``: pretend a non-reference implementation is selected here."""
    import polyrl.kernels as K

    calls = []
    real, real_select = K.skinny_linear, K.registry.select

    def spy(x, w, b=None):
        calls.append((tuple(x.shape), len(w) if isinstance(w, tuple) else 1))
        return real(x, w, b)

    def select(op, dev, dtype):
        name, fn = real_select(op, dev, dtype)
        return ("triton" if fast and op == "skinny_linear" else name), fn

    monkeypatch.setattr(K, "skinny_linear", spy)
    monkeypatch.setattr(K.registry, "select", select)
    return calls


def test_decoder_projects_decode_sized_inputs_through_skinny_linear(monkeypatch):
    from polyrl.models import decoder

    calls = _spy_skinny(monkeypatch, fast=True)
    lin = nn.Linear(16, 12)
    x = torch.randn(ROUTE_MAX_ROWS, 16)
    with torch.no_grad():
        torch.testing.assert_close(decoder.project(lin, x), lin(x), rtol=0, atol=0)  # the reference is F.linear
        decoder.project(lin, torch.randn(ROUTE_MAX_ROWS + 1, 16))  # more rows: the module (cuBLAS)
    decoder.project(lin, x)  # autograd on: the module (training never takes the kernel)
    with torch.inference_mode():
        decoder.project(lin, x[:1])
    assert calls == [((ROUTE_MAX_ROWS, 16), 1), ((1, 16), 1)]


def test_decoder_groups_qkv_and_gate_up_at_batch_one(monkeypatch):
    from polyrl.models import decoder

    calls = _spy_skinny(monkeypatch, fast=True)
    grouped = decoder.DecoderOptions(group_projections=True)
    qkv = (nn.Linear(16, 12), nn.Linear(16, 4), nn.Linear(16, 4))
    x = torch.randn(1, 16)
    with torch.no_grad():
        q, k, v = decoder.project_group(qkv, x, grouped)
        for out, lin in zip((q, k, v), qkv):
            torch.testing.assert_close(out, lin(x), rtol=0, atol=0)
            assert out.is_contiguous()
        decoder.project_group(qkv, x, decoder.DecoderOptions(group_projections=False))  # one launch per projection
        mixed = (nn.Linear(16, 4), nn.Linear(16, 4, bias=False))
        decoder.project_group(mixed, x, grouped)  # bias on one only: one launch each
    assert [n for _, n in calls] == [3, 1, 1, 1, 1, 1]


def test_decoder_keeps_the_module_where_only_the_reference_exists(monkeypatch):
    from polyrl.models import decoder

    calls = _spy_skinny(monkeypatch, fast=False)
    with torch.no_grad():
        decoder.project(nn.Linear(16, 12), torch.randn(1, 16))
        decoder.project_group((nn.Linear(16, 4), nn.Linear(16, 4)), torch.randn(1, 16), decoder.DecoderOptions())
    assert calls == []


def test_decode_with_skinny_projections_matches_prefill_logits():
    """A decode step (1 row per sequence through ``project``) gives the logits a full causal forward gives."""
    from polyrl.infer import LLM, RolloutConfig, SamplingParams
    from polyrl.models.decoder import build_model
    from polyrl.models.presets import preset_config

    model = build_model(preset_config("tiny"), dtype=torch.float32, device="cpu", seed=0).eval()
    llm = LLM(model, None, RolloutConfig(num_blocks=64, max_num_seqs=4))
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


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_several_weights_in_one_launch(triton_kernels, kernel_check, rows, with_bias):
    """q/k/v-like (3 weights, a block straddling each boundary) and gate/up-like (2): one output, side by side."""
    fn = triton_kernels.load("skinny_linear")
    dev = triton_kernels.device
    g = torch.Generator().manual_seed(rows + 10 * with_bias)
    x = torch.randn(rows, 96, generator=g).to(dev)
    for sizes in ([40, 12, 12], [37, 37], [20]):
        ws = [(torch.randn(n, 96, generator=g) * 0.1).to(dev) for n in sizes]
        bs = [torch.randn(n, generator=g).to(dev) for n in sizes] if with_bias else None
        want = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs or [None] * len(ws))], dim=-1)
        y = fn(x, tuple(ws), tuple(bs) if bs else None)
        assert y.shape == (rows, sum(sizes))
        kernel_check.assert_close(y, want, torch.float32, f"{sizes}")


def test_several_weights_input_checks(triton_kernels):
    fn = triton_kernels.load("skinny_linear")
    dev = triton_kernels.device
    x, w = torch.zeros(1, 8, device=dev), torch.zeros(4, 8, device=dev)
    with pytest.raises(ValueError, match="1 to 3 weights"):
        fn(x, (w, w, w, w))
    with pytest.raises(ValueError, match="one bias per weight"):
        fn(x, (w, w), (torch.zeros(4, device=dev),))
    with pytest.raises(ValueError, match="one dtype"):
        fn(x, (w, w.double()))


@pytest.mark.gpu
def test_gpu_grouped_qkv_and_gate_up_match_linear(triton_kernels, kernel_check):
    """qwen3-0.6b's q/k/v and gate/up weights (separate allocations, bf16) in one launch each, on the device."""
    fn = triton_kernels.load("skinny_linear")
    dev = triton_kernels.device
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1024, generator=g).to(dev, torch.bfloat16)
    for sizes in ([2048, 1024, 1024], [3072, 3072]):
        ws = [(torch.randn(n, 1024, generator=g) * 0.03).to(dev, torch.bfloat16) for n in sizes]
        want = torch.cat([F.linear(x.float(), w.float()) for w in ws], dim=-1)
        kernel_check.assert_close(fn(x, tuple(ws)), want, torch.bfloat16, f"{sizes}")


def test_parallel_projections_flag_gives_the_sequential_result():
    """parallel_projections forks the projections onto streams where there are any; on the CPU it runs them in order:
    either way the outputs are the modules' own, in order."""
    from polyrl.models import decoder
    from polyrl.platform import device

    lins = (nn.Linear(16, 12), nn.Linear(16, 4), nn.Linear(16, 4))
    x = torch.randn(5, 16)
    with torch.no_grad():
        outs = decoder.project_group(lins, x, decoder.DecoderOptions(parallel_projections=True))
    assert [tuple(o.shape) for o in outs] == [(5, 12), (5, 4), (5, 4)]
    for out, lin in zip(outs, lins):
        torch.testing.assert_close(out, lin(x).detach(), rtol=0, atol=0)
    assert device.run_concurrently([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]


@pytest.mark.gpu
def test_gpu_parallel_projections_decode_equals_sequential():
    """Decode (CUDA graphs, launch graphs) with q/k/v and gate/up forked onto streams gives the same tokens and
    log-probs as one stream: the same kernels run, only concurrently."""
    import dataclasses

    from polyrl.infer import LLM, RolloutConfig, SamplingParams
    from polyrl.models.decoder import build_model, init_weights
    from polyrl.models.presets import preset_config
    from polyrl.platform import device

    model = build_model(preset_config("tiny"), dtype=torch.bfloat16, device=device.torch_device(), seed=0)
    model = init_weights(model, seed=0, std=0.2).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 900, (int(n),), generator=g).tolist() for n in torch.randint(2, 40, (24,), generator=g)]
    params = [
        SamplingParams(temperature=0.0 if i % 3 else 1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(24)
    ]
    outs = {}
    for parallel in (False, True):
        model.options = dataclasses.replace(model.options, parallel_projections=parallel)
        llm = LLM(model, None, RolloutConfig(num_blocks=256, max_num_seqs=32))
        outs[parallel] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)
