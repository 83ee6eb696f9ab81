"""Varlen causal attention: the reference against independent formulas, the SDPA path and the Triton
flash-attention kernel (forward and dq/dk/dv) against the reference, GQA and sliding window.

On the CPU the Triton kernel runs under ``TRITON_INTERPRET=1`` (see conftest.py) on tiny shapes; the
interpreter's ``tl.dot`` is wrong for bf16 (it multiplies the raw bits), so bf16 is checked on the GPU.
Real shapes carry the ``gpu`` marker.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl.errors import ConfigError
from polyrl.kernels import registry
from polyrl.kernels.attention import cudnn, sdpa
from polyrl.kernels.attention import reference as ref


def _cu(lens: list[int], device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _qkv(lens, hq, hk, d, dtype, device="cpu", requires_grad=True):
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, dtype=dtype, device=device) for h in (hq, hk, hk))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def _naive(q, k, v, cu, scale, window):
    """One query at a time, one head at a time, plain Python loops over allowed keys (fp64)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        for i in range(s, e):
            keys = [j for j in range(s, i + 1) if window is None or i - j < window]
            for h in range(q.shape[1]):
                kk = k[keys, h // group].double()
                w = torch.softmax((kk @ q[i, h].double()) * scale, dim=0)
                out[i, h] = w @ v[keys, h // group].double()
    return out


def _sdpa_math(q, k, v, cu, scale):
    """torch SDPA's math backend, is_causal, per sequence, k/v heads repeated by hand."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu.tolist()
    with sdpa_kernel(SDPBackend.MATH):
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs = q[s:e].transpose(0, 1)
            ks = k[s:e].repeat_interleave(group, 1).transpose(0, 1)
            vs = v[s:e].repeat_interleave(group, 1).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def _grads(fn, q, k, v, do):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


# --- the reference is the spec: check it against formulas that share no code with it ----------------


def test_reference_matches_sdpa_math_forward_and_grads(seeded):
    lens = [1, 7, 33]
    cu = _cu(lens)
    q, k, v = _qkv(lens, 4, 2, 16, torch.float64)
    do = torch.randn_like(q)
    got = _grads(lambda a, b, c: ref.varlen_attention(a, b, c, cu, 33, 0.3), q, k, v, do)
    want = _grads(lambda a, b, c: _sdpa_math(a, b, c, cu, 0.3), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert (a - b).abs().max().item() < 1e-12, name


@pytest.mark.parametrize("window", [None, 1, 4])
def test_reference_matches_naive_loop(seeded, window):
    lens = [1, 6, 11]
    cu = _cu(lens)
    q, k, v = _qkv(lens, 4, 1, 8, torch.float64, requires_grad=False)
    got = ref.varlen_attention(q, k, v, cu, 11, 0.5, window)
    assert (got - _naive(q, k, v, cu, 0.5, window)).abs().max().item() < 1e-12
    if window == 1:  # each token sees only itself
        assert torch.allclose(got, v.repeat_interleave(4, 1), atol=1e-12)


# --- the SDPA path ------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 5, 100])
def test_sdpa_matches_reference(seeded, kernel_check, window):
    lens = [1, 7, 0, 33]
    cu = _cu(lens)
    q, k, v = _qkv(lens, 4, 2, 32, torch.float32)
    do = torch.randn_like(q)
    got = _grads(lambda a, b, c: sdpa.varlen_attention(a, b, c, cu, 33, None, window), q, k, v, do)
    want = _grads(lambda a, b, c: ref.varlen_attention(a, b, c, cu, 33, None, window), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        kernel_check.assert_close(a, b, torch.float32, f"sdpa {name}")


def test_registry_prefers_sdpa_on_cpu(monkeypatch):
    monkeypatch.delenv("POLYRL_KERNELS", raising=False)
    registry.reset_cache()
    assert registry.select("attention", "cpu", "float32")[0] == "sdpa"
    assert [i.name for i in registry.implementations("attention")] == ["cudnn", "triton", "sdpa", "reference"]
    cudnn_impl = registry.implementations("attention")[0]
    assert cudnn_impl.devices == {"cuda"} and cudnn_impl.dtypes == {"bfloat16", "float16"}
    registry.reset_cache()


# --- the uniform-length fast path (batched SDPA; cuDNN/flash on CUDA, whatever SDPA picks on the CPU) ---


def test_uniform_batch_detection_is_a_shape_test():
    q = torch.empty(12, 4, 16)
    assert cudnn.uniform_batch(q, _cu([4, 4, 4]), 4, None) == 3
    assert cudnn.uniform_batch(q, _cu([6, 6]), 6, 6) == 2  # a window as long as the sequence cuts nothing
    assert cudnn.uniform_batch(q, _cu([6, 6]), 6, 5) is None  # a real window: fallback
    assert cudnn.uniform_batch(q, _cu([4, 8]), 8, None) is None  # 12 != 2 * 8: mixed lengths
    assert cudnn.uniform_batch(q, _cu([]), 0, None) is None
    assert cudnn.uniform_batch(torch.empty(0, 4, 16), _cu([0]), 0, None) is None


def test_fast_path_plan_verifies_the_contract_once_per_cu_tensor():
    q, k = torch.empty(8, 4, 16), torch.empty(8, 2, 16)
    cu = _cu([4, 4])
    assert cudnn.plan(q, k, cu, 4, None) == (2, None)
    cu[1] = 3  # in place: lengths 3 and 5 (max_seqlen understated) -> the version counter forces a recheck
    assert cudnn.plan(q, k, cu, 4, None) is None
    # T == B * max_seqlen but the sequences end before T (trailing rows): not uniform.
    assert cudnn.plan(q, k, _cu([3, 3]), 4, None) is None


def test_fast_path_delegates_for_inference_tensors():
    """Inference tensors have no version counter to guard a cached verdict: the fast path steps aside."""
    q, k = torch.empty(8, 4, 16), torch.empty(8, 2, 16)
    with torch.inference_mode():
        cu = _cu([4, 4])
        assert cu.is_inference()
        assert cudnn.plan(q, k, cu, 4, None) is None
    assert cudnn.plan(q, k, _cu([4, 4]), 4, None) == (2, None)
    assert cudnn.plan(q, torch.empty(8, 3, 16), _cu([4, 4]), 4, None) is None  # 4 q heads, 3 kv heads
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert cudnn.plan(q, k, _cu([4, 4]), 4, None) is None  # bitwise-reproducible runs keep the Triton kernel
    finally:
        torch.use_deterministic_algorithms(prev)


def test_fast_path_probe_skips_unusable_backends_with_a_warning():
    """On the CPU there is no cuDNN SDPA: the probe warns and settles on the next backend that matches."""
    with pytest.warns(RuntimeWarning, match="CUDNN_ATTENTION unusable"):
        chosen = cudnn._probe(torch.device("cpu"), torch.float32, 4, 2, 16, seq=40)
    assert chosen == "FLASH_ATTENTION"  # torch's CPU flash kernel, checked against the reference


@pytest.mark.parametrize("lens,hq,hk,window", [([16, 16, 16], 4, 2, None), ([9, 9], 2, 2, 9), ([5, 7], 4, 1, None),
                                               ([12, 12], 4, 2, 5)])  # fmt: skip
def test_fast_path_matches_reference_and_delegates(seeded, kernel_check, lens, hq, hk, window):
    cu = _cu(lens)
    q, k, v = _qkv(lens, hq, hk, 32, torch.float32)
    do = torch.randn_like(q)
    expect_fast = len(set(lens)) == 1 and (window is None or window >= lens[0])
    assert (cudnn.plan(q, k, cu, max(lens), window) is not None) == expect_fast
    got = _grads(lambda a, b, c: cudnn.varlen_attention(a, b, c, cu, max(lens), 0.2, window), q, k, v, do)
    want = _grads(lambda a, b, c: ref.varlen_attention(a, b, c, cu, max(lens), 0.2, window), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        kernel_check.assert_close(a, b, torch.float32, f"fast path {name} lens={lens}")


# --- Triton (interpreter on the CPU, compiled on a GPU) -------------------------------------------

CASES = [
    # lens, hq, hk, d, dtype, window
    ([1, 7, 33], 4, 2, 32, torch.float32, None),
    ([16, 1, 33], 4, 2, 16, torch.float32, 5),
    ([1, 7, 33], 2, 2, 64, torch.float16, None),
    ([7, 0, 33], 4, 1, 16, torch.float16, 9),
]


@pytest.mark.parametrize("lens,hq,hk,d,dtype,window", CASES)
def test_triton_matches_reference(triton_kernels, kernel_check, seeded, lens, hq, hk, d, dtype, window):
    fn = triton_kernels.load("attention", "varlen_attention")
    dev = triton_kernels.device
    cu = _cu(lens, dev)
    q, k, v = _qkv(lens, hq, hk, d, dtype, dev)
    do = torch.randn_like(q)
    got = _grads(lambda a, b, c: fn(a, b, c, cu, max(lens), None, window), q, k, v, do)
    # The reference in fp32 on the same (rounded) inputs.
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = _grads(lambda a, b, c: ref.varlen_attention(a, b, c, cu, max(lens), None, window), q32, k32, v32, do.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype, name
        kernel_check.assert_close(a.float(), b, dtype, f"triton {name}", scale=2.0 if name != "out" else 1.0)


def test_triton_fixed_shape_layout_trailing_empties_and_a_loose_max_seqlen(triton_kernels, kernel_check, seeded):
    """data.fixed_shapes batches: real sequences, padding sequences, then empty ones, and max_seqlen an upper bound
    (the dataset's longest), not this batch's longest: forward and gradients are the reference's."""
    fn = triton_kernels.load("attention", "varlen_attention")
    dev = triton_kernels.device
    lens = [7, 21, 16, 16, 0, 0, 0]
    cu = _cu(lens, dev)
    q, k, v = _qkv(lens, 4, 2, 16, torch.float32, dev)
    do = torch.randn_like(q)
    got = _grads(lambda a, b, c: fn(a, b, c, cu, 48, None, None), q, k, v, do)
    want = _grads(lambda a, b, c: ref.varlen_attention(a, b, c, cu, max(lens), None, None), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        kernel_check.assert_close(a, b, torch.float32, f"triton {name}")


def test_triton_strided_inputs_and_scale(triton_kernels, kernel_check, seeded):
    """q/k/v as column slices of a fused qkv projection (row stride != H * D), explicit scale."""
    fn = triton_kernels.load("attention", "varlen_attention")
    dev = triton_kernels.device
    lens = [5, 20]
    cu = _cu(lens, dev)
    qkv = torch.randn(25, 4 + 2 + 2, 16, device=dev, requires_grad=True)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert q.stride(0) == 8 * 16
    do = torch.randn(25, 4, 16, device=dev)
    out = fn(q, k, v, cu, 20, 0.2)
    (g,) = torch.autograd.grad(out, qkv, do)
    out_ref = ref.varlen_attention(q, k, v, cu, 20, 0.2)
    (g_ref,) = torch.autograd.grad(out_ref, qkv, do)
    kernel_check.assert_close(out, out_ref, torch.float32, "out")
    kernel_check.assert_close(g, g_ref, torch.float32, "dqkv")


def test_triton_fixed_config_prunes_autotuning_to_one_config(triton_kernels):
    """Inside ``fixed_config()`` (validate's tiny/small shapes) every autotuning key gets exactly one config."""
    import importlib

    import triton

    triton_kernels.load("attention", "fixed_config")
    tri = importlib.import_module("polyrl.kernels.attention.triton")
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4) for m, n in ((128, 64), (64, 64), (64, 32))]
    args = {"HEAD_DIM": 64, "Q": torch.empty(1, dtype=torch.bfloat16)}
    assert len(tri._prune(configs, args)) == 3
    with tri.fixed_config():
        assert tri._prune(configs, args) == configs[-1:]
    assert len(tri._prune(configs, args)) == 3


def test_triton_rejects_empty_window(triton_kernels):
    fn = triton_kernels.load("attention", "varlen_attention")
    q, k, v = _qkv([3], 2, 2, 16, torch.float32, triton_kernels.device, requires_grad=False)
    with pytest.raises(ConfigError, match="window"):
        fn(q, k, v, _cu([3], triton_kernels.device), 3, None, 0)


def test_triton_odd_head_dim_falls_back_to_sdpa(triton_kernels, kernel_check, seeded):
    fn = triton_kernels.load("attention", "varlen_attention")
    q, k, v = _qkv([9], 2, 1, 24, torch.float32, triton_kernels.device, requires_grad=False)
    cu = _cu([9], triton_kernels.device)
    kernel_check.assert_close(fn(q, k, v, cu, 9), ref.varlen_attention(q, k, v, cu, 9), torch.float32, "out")


# --- GPU: real shapes (bf16, head dims 64/128/256, long and mixed sequences) ----------------------


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lens,hq,hk,d,window,dtypes",
    [
        ([4096], 32, 8, 128, None, (BF16, FP16)),
        ([1, 100, 1025, 2047, 923], 16, 8, 128, None, (BF16,)),
        ([3000, 17, 1000], 16, 4, 64, 512, (BF16, FP32)),
        ([1500, 1], 8, 8, 256, None, (BF16,)),
        ([777, 64], 8, 2, 32, 100, (BF16, FP16, FP32)),
    ],
)
def test_triton_gpu_real_shapes(triton_kernels, kernel_check, seeded, lens, hq, hk, d, window, dtypes):
    # A correctness sweep: one config per kernel, no autotuning; bf16 (the training dtype) at every shape, fp16
    # and fp32 at some. Each (shape, dtype) compiles its own forward and backward kernels: on a cold Triton cache
    # every dtype at every shape took 80 s for the head-dim-256 case alone on the H200.
    from polyrl.kernels.attention.triton import fixed_config

    with fixed_config():
        _check_real_shape(triton_kernels, kernel_check, lens, hq, hk, d, window, dtypes)


def _check_real_shape(triton_kernels, kernel_check, lens, hq, hk, d, window, dtypes):
    fn = triton_kernels.load("attention", "varlen_attention")
    dev = triton_kernels.device
    cu = _cu(lens, dev)
    for dtype in dtypes:
        q, k, v = _qkv(lens, hq, hk, d, dtype, dev)
        do = torch.randn_like(q)
        got = _grads(lambda a, b, c: fn(a, b, c, cu, max(lens), None, window), q, k, v, do)
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        want = _grads(lambda a, b, c: sdpa.varlen_attention(a, b, c, cu, max(lens), None, window), q32, k32, v32,
                      do.float())  # fmt: skip
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            # fp32 reference on the GPU may itself use TF32 inside SDPA; compare with the dtype's tolerance.
            tol = torch.float16 if dtype == torch.float32 else dtype
            kernel_check.assert_close(a.float(), b, tol, f"{dtype} {name} lens={lens}", scale=2.0)


@pytest.mark.gpu
def test_triton_gpu_no_host_sync_in_forward(triton_kernels, seeded):
    """The forward launches without reading device values, so a CUDA graph can capture it."""
    from polyrl.platform import device

    api = device.graph_api()
    if api is None or triton_kernels.interpreted:
        pytest.skip("CUDA graphs are not available on this device")
    graph_cls, graph_ctx = api
    fn = triton_kernels.load("attention", "varlen_attention")
    dev = triton_kernels.device
    lens = [300, 17, 600]
    cu = _cu(lens, dev)
    q, k, v = _qkv(lens, 8, 2, 128, torch.bfloat16, dev, requires_grad=False)
    expected = fn(q, k, v, cu, 600)  # warm-up compiles and autotunes outside the capture
    graph = graph_cls()
    with graph_ctx(graph):
        out = fn(q, k, v, cu, 600)
    q.copy_(torch.randn_like(q))
    graph.replay()
    device.synchronize()
    assert not torch.equal(out, expected)
    assert torch.equal(out, fn(q, k, v, cu, 600))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens,hq,hk,d", [([2048, 2048], 16, 8, 128), ([1024] * 3, 8, 8, 64), ([4096], 32, 8, 128)])
def test_fast_path_gpu_uses_sdpa_and_matches_reference(seeded, kernel_check, dtype, lens, hq, hk, d):
    from polyrl.platform import device

    if device.device_type() != "cuda":
        pytest.skip("the fast path is registered for CUDA devices")
    registry.reset_cache()
    assert registry.select("attention", "cuda", {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype])[0] == (
        "cudnn"
    )
    dev = device.torch_device()
    cu = _cu(lens, dev)
    q, k, v = _qkv(lens, hq, hk, d, dtype, dev)
    plan = cudnn.plan(q, k, cu, max(lens), None)
    assert plan is not None and plan[1] in cudnn.PROBE_BACKENDS, f"no SDPA backend passed the probe: {plan}"
    do = torch.randn_like(q)
    got = _grads(lambda a, b, c: cudnn.varlen_attention(a, b, c, cu, max(lens)), q, k, v, do)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = _grads(lambda a, b, c: sdpa.varlen_attention(a, b, c, cu, max(lens)), q32, k32, v32, do.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype
        kernel_check.assert_close(a.float(), b, dtype, f"{plan[1]} {name}", scale=2.0)


@pytest.mark.gpu
def test_fast_path_gpu_graph_capture_and_mixed_lengths(seeded):
    """Under graph capture the fast path hands over to Triton (capturable); mixed lengths go to Triton too."""
    from polyrl.platform import device

    api = device.graph_api()
    if api is None:
        pytest.skip("CUDA graphs are not available on this device")
    graph_cls, graph_ctx = api
    dev = device.torch_device()
    lens = [512, 512]
    cu = _cu(lens, dev)
    q, k, v = _qkv(lens, 8, 2, 128, torch.bfloat16, dev, requires_grad=False)
    from polyrl.kernels.attention import triton as tri

    assert cudnn.plan(q, k, cu, 512, None) is not None  # eager: the batched SDPA path
    expected = tri.varlen_attention(q, k, v, cu, 512)  # compiles and autotunes outside the capture
    graph = graph_cls()
    with graph_ctx(graph):
        out = cudnn.varlen_attention(q, k, v, cu, 512)
    q.copy_(torch.randn_like(q))
    graph.replay()
    device.synchronize()
    assert not torch.equal(out, expected)
    assert torch.equal(out, tri.varlen_attention(q, k, v, cu, 512))
    mixed = _cu([700, 324], dev)
    assert cudnn.plan(q, k, mixed, 700, None) is None
    assert torch.equal(cudnn.varlen_attention(q, k, v, mixed, 700), tri.varlen_attention(q, k, v, mixed, 700))


def test_backend_probe_inside_a_checkpointed_layer_leaves_checkpointing_intact(monkeypatch):
    """Regression (H200, LoRA + activation checkpointing): the fast path's one-time backend probe runs autograd;
    run inside a non-reentrant checkpointed forward, its saved tensors were recorded by the checkpoint's hooks in the
    forward but not in the recomputation, and backward failed. The probe now runs on its own thread."""
    from torch.utils.checkpoint import checkpoint

    def probe(device, dtype, hq, hk, d):
        w = torch.randn(4, requires_grad=True)
        torch.autograd.grad((w.sin() * w).sum(), w)  # saves tensors for backward, as the real probe does
        return "FLASH_ATTENTION"

    monkeypatch.setattr(cudnn, "_probe", probe)
    monkeypatch.setattr(cudnn, "_BACKEND", {})
    x = torch.randn(8, requires_grad=True)

    def layer(t):
        assert cudnn.backend_for(torch.device("cpu"), torch.float32, 2, 1, 16) == "FLASH_ATTENTION"
        return (t.sin() * t).sum()

    checkpoint(layer, x, use_reentrant=False).backward()
    assert torch.allclose(x.grad, x.sin() + x * x.cos())
