"""qk_norm_rope: the Triton kernel against the reference composition (rmsnorm then rope) for fp32 and bf16, odd head
counts, strided inputs; no autograd; the decoder's fused_qk_norm_rope path gives the unfused decode's tokens."""

from __future__ import annotations

import pytest
import torch

from polyrl.kernels.qk_norm_rope.reference import qk_norm_rope as ref
from polyrl.kernels.rope.reference import rope_cos_sin


def _inputs(t, hq, hk, d, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, hq, d, generator=g) * 3).to(dev, dtype)
    k = (torch.randn(t, hk, d, generator=g) * 3).to(dev, dtype)
    wq = (1 + 0.3 * torch.randn(d, generator=g)).to(dev, dtype)
    wk = (1 + 0.3 * torch.randn(d, generator=g)).to(dev, dtype)
    cos, sin = rope_cos_sin(torch.arange(t) * 7, d, 10000.0, dtype=torch.float32)
    return q, k, wq, wk, cos.to(dev), sin.to(dev)


@pytest.mark.parametrize("t,hq,hk,d", [(5, 4, 2, 16), (3, 3, 1, 32), (1, 16, 8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_unfused_reference(triton_kernels, kernel_check, t, hq, hk, d, dtype):
    fn = triton_kernels.load("qk_norm_rope")
    args = _inputs(t, hq, hk, d, dtype, triton_kernels.device, seed=t * hq + d)
    with torch.no_grad():
        q, k = fn(*args, 1e-6)
        rq, rk = ref(*args, 1e-6)
    assert q.dtype == dtype and q.shape == (t, hq, d) and k.shape == (t, hk, d)
    scale = 1.0 if dtype == torch.float32 else 2.0  # the reference's bf16 rope rounds three times, the kernel once
    kernel_check.assert_close(q.float(), rq.float(), dtype, "q", scale)
    kernel_check.assert_close(k.float(), rk.float(), dtype, "k", scale)


def test_triton_strided_views_and_no_backward(triton_kernels, kernel_check):
    fn = triton_kernels.load("qk_norm_rope")
    q, k, wq, wk, cos, sin = _inputs(4, 4, 2, 16, torch.float32, triton_kernels.device, seed=9)
    qkv = torch.cat([q.flatten(1), k.flatten(1), k.flatten(1)], dim=1)  # a fused projection's output
    qv, kv = qkv[:, :64].view(4, 4, 16), qkv[:, 64:96].view(4, 2, 16)
    with torch.no_grad():
        out = fn(qv, kv, wq, wk, cos, sin)
    want = ref(q, k, wq, wk, cos, sin)
    kernel_check.assert_close(out[0], want[0], torch.float32, "q")
    kernel_check.assert_close(out[1], want[1], torch.float32, "k")
    with pytest.raises(RuntimeError, match="autograd off"):
        fn(q.requires_grad_(True), k, wq, wk, cos, sin)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float8_e4m3fn)])  # fmt: skip
def test_cache_variant_stores_what_the_two_kernels_store(triton_kernels, kernel_check, dtype, cache_dtype):
    """``qk_norm_rope_cache`` against ``qk_norm_rope`` + ``write_kv_cache`` (the Triton kernels it replaces): the same
    q' and the same cache bytes, a negative slot skipped; and against the reference composition within tolerance."""
    from polyrl.kernels.qk_norm_rope.reference import qk_norm_rope_cache as ref_cache

    dev = triton_kernels.device
    fused = triton_kernels.load("qk_norm_rope", "qk_norm_rope_cache")
    plain = triton_kernels.load("qk_norm_rope")
    write = triton_kernels.load("paged_attention", "write_kv_cache")
    t, hq, hk, d, page, blocks = 6, 4, 2, 32, 4, 5
    q, k, wq, wk, cos, sin = _inputs(t, hq, hk, d, dtype, dev, seed=11)
    v = (torch.randn(t, hk, d, generator=torch.Generator().manual_seed(12)) * 3).to(dev, dtype)
    slots = torch.tensor([3, 17, -1, 0, 9, 12], dtype=torch.int64, device=dev)
    caches = [torch.zeros(blocks, page, hk, d, device=dev).to(cache_dtype) for _ in range(6)]
    with torch.no_grad():
        got_q = fused(q, k, v, wq, wk, cos, sin, 1e-6, caches[0], caches[1], slots)
        want_q, want_k = plain(q, k, wq, wk, cos, sin, 1e-6)
        write(want_k, v, caches[2], caches[3], slots)
        ref_q = ref_cache(q, k, v, wq, wk, cos, sin, 1e-6, caches[4], caches[5], slots)
    assert torch.equal(got_q, want_q)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # slots 3, 17, 0, 9, 12 (page 4) land in blocks 0, 4, 0, 2, 3: block 1 and every other slot stay empty
    assert caches[0].view(torch.uint8).flatten(1).any(-1).tolist() == [True, False, True, True, True]
    filled = caches[1].view(torch.uint8).view(-1, hk * d * caches[1].element_size()).any(-1)
    assert filled.nonzero().flatten().tolist() == [0, 3, 9, 12, 17]
    scale = 1.0 if dtype == torch.float32 else 2.0
    kernel_check.assert_close(got_q.float(), ref_q.float(), dtype, "q", scale)
    if cache_dtype != torch.float8_e4m3fn:
        kernel_check.assert_close(caches[0].float(), caches[4].float(), dtype, "k cache", scale)
        assert torch.equal(caches[1], caches[5])  # v is copied as it is
    with pytest.raises(ValueError, match="caches"):
        fused(q, k, v, wq, wk, cos, sin, 1e-6, caches[0][:, :, :1], caches[1], slots)


def test_decoder_fused_path_decodes_as_the_unfused_one(monkeypatch):
    """The option is set on the built model (``model.options``) and reaches every layer: the fused op runs only with
    it on."""
    import dataclasses

    from polyrl.infer import LLM, RolloutConfig, SamplingParams
    from polyrl.models.decoder import build_model, init_weights
    from polyrl.models.presets import preset_config

    model = init_weights(build_model(preset_config("tiny"), seed=0), seed=0, std=0.3).eval()
    assert model.model.layers[0].self_attn.q_norm is not None  # the tiny preset is Qwen3-shaped
    calls = []
    import polyrl.kernels as K

    real, real_cache = K.qk_norm_rope, K.qk_norm_rope_cache
    monkeypatch.setattr(K, "qk_norm_rope", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(K, "qk_norm_rope_cache", lambda *a: calls.append(1) or real_cache(*a))  # paged steps
    outs, runs = {}, {}
    for fused in (False, True):
        model.options = dataclasses.replace(model.options, fused_qk_norm_rope=fused)
        llm = LLM(model, None, RolloutConfig(num_blocks=64, max_num_seqs=4))
        before = len(calls)
        done = llm.generate([[5, 6, 7], [9, 10]], SamplingParams(temperature=0, max_tokens=6))
        runs[fused] = len(calls) - before
        outs[fused] = [o.outputs[0] for o in done]
    assert calls  # the fused op ran (the CPU selects its reference)
    # off: never; on: once per layer and forward (every layer sees the model's options)
    assert runs[False] == 0 and runs[True] > 0 and runs[True] % model.config.num_layers == 0
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_gpu_qwen3_shape_matches_the_unfused_triton_kernels(triton_kernels):
    """bf16 at qwen3-0.6b heads on the device: the fused kernel against the Triton rmsnorm + rope it replaces."""
    import polyrl.kernels as K

    fn = triton_kernels.load("qk_norm_rope")
    q, k, wq, wk, cos, sin = _inputs(64, 16, 8, 128, torch.bfloat16, triton_kernels.device, seed=3)
    with torch.no_grad():
        fq, fk = fn(q, k, wq, wk, cos, sin, 1e-6)
        uq, uk = K.apply_rope(K.rmsnorm(q, wq, 1e-6), K.rmsnorm(k, wk, 1e-6), cos, sin)
    diff = max((fq.float() - uq.float()).abs().max().item(), (fk.float() - uk.float()).abs().max().item())
    assert diff <= 2**-7 * max(uq.float().abs().max().item(), 1.0), diff  # one bf16 ulp of the largest value
