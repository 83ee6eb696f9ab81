"""FP8 (``float8_e4m3fn``, static unit scale) paged KV caches: the reference write (saturating, round to nearest even,
negative slots skipped, no host reads), the reference attention against contiguous attention over the dequantised
keys, and the Triton write and attention kernels against the references on the same FP8 caches (interpreter on the
CPU on tiny shapes; real shapes and a CUDA-graph capture carry the ``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

from polyrl.kernels.attention.reference import attend
from polyrl.kernels.paged_attention import reference as ref

FP8 = torch.float8_e4m3fn


def _dequant(x: torch.Tensor) -> torch.Tensor:
    """What an FP8 cache holds for ``x``, as fp32 (the spec: saturate to +-448, round to nearest even)."""
    return x.float().clamp(-448.0, 448.0).to(FP8).float()


def _fp8_batch(ctx, q_lens, hq, hk, d, page, q_dtype, window=None, device="cpu", kv_std=1.0):
    """Random keys per sequence written through the reference into shuffled FP8 blocks; ``expected`` is contiguous
    attention (fp32) over the dequantised keys and values. Returns (args, expected)."""
    n_blocks = [-(-c // page) for c in ctx]
    total = sum(n_blocks) + 2
    perm = torch.randperm(total)
    k_cache = (torch.randn(total, page, hk, d, device=device) * 3).to(FP8)  # spare blocks: garbage to ignore
    v_cache = (torch.randn(total, page, hk, d, device=device) * 3).to(FP8)
    tables = torch.full((len(ctx), max(n_blocks) + 1), total - 1, dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, device=device, dtype=q_dtype)
    outs, used = [], 0
    for b, (c, ql) in enumerate(zip(ctx, q_lens)):
        tables[b, : n_blocks[b]] = perm[used : used + n_blocks[b]].int()
        used += n_blocks[b]
        k = torch.randn(c, hk, d, device=device, dtype=q_dtype) * kv_std
        v = torch.randn(c, hk, d, device=device, dtype=q_dtype) * kv_std
        pos = torch.arange(c)
        slots = (tables[b, pos // page].long() * page + pos % page).to(device)
        ref.write_kv_cache(k, v, k_cache, v_cache, slots)
        s = sum(q_lens[:b])
        outs.append(attend(q[s : s + ql].float(), _dequant(k), _dequant(v), d**-0.5, window))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables.to(device), torch.tensor(ctx, dtype=torch.int32, device=device),
            cu.to(device), max(q_lens))  # fmt: skip
    return args, torch.cat(outs).cpu()


# --- references --------------------------------------------------------------------------------


def test_reference_fp8_write_saturates_rounds_and_skips():
    k_cache = torch.zeros(3, 4, 1, 4, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.tensor([[[1000.0, -1000.0, 0.3, 100.0]], [[1.0, 2.0, 3.0, 4.0]], [[5.0, 6.0, 7.0, 8.0]]])
    ref.write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k, flat_v = k_cache.view(-1, 1, 4).float(), v_cache.view(-1, 1, 4).float()
    # saturated (not NaN), 0.3 -> 0.3125 (3 mantissa bits), 100 is a tie between 96 and 104 -> even mantissa 96
    assert flat_k[5, 0].tolist() == [448.0, -448.0, 0.3125, 96.0]
    assert flat_v[5, 0].tolist() == [-448.0, 448.0, -0.3125, -96.0]
    assert flat_k[0, 0].tolist() == [5.0, 6.0, 7.0, 8.0]
    written = {0, 5}
    assert all(flat_k[i].abs().sum() == 0 for i in range(12) if i not in written)  # the skipped row wrote nothing


def test_reference_fp8_write_reads_nothing_back_to_the_host(host_reads):
    k_cache = torch.zeros(4, 16, 2, 8, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 8)
    with host_reads() as reads:
        ref.write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([3, -1, 0, 40, -1]))
    assert reads.seen == []
    flat = k_cache.view(-1, 2, 8).float()
    assert torch.equal(flat[40], _dequant(k[3])) and torch.equal(flat[0], _dequant(k[2]))


@pytest.mark.parametrize("window", [None, 5])
def test_reference_attention_over_an_fp8_cache_is_attention_over_the_dequantised_keys(seeded, window):
    args, expected = _fp8_batch([9, 40, 17, 23], [1, 7, 17, 1], 4, 2, 16, 16, torch.float64, window)
    out = ref.paged_attention(*args, None, window)
    assert args[1].dtype == FP8 and out.dtype == torch.float64
    assert (out.double() - expected.double()).abs().max().item() < 1e-6  # expected computed in fp32


# --- Triton ------------------------------------------------------------------------------------

CASES = [
    # ctx, q_lens, hq, hk, d, page, q dtype, window, splits
    ([5, 40, 17], [1, 1, 1], 4, 2, 32, 16, torch.float32, None, None),  # pure decode
    ([5, 40, 17, 9], [1, 7, 17, 3], 4, 2, 32, 16, torch.float32, None, None),  # decode + prefill over a prefix
    ([5, 40, 17, 9], [1, 7, 17, 3], 8, 2, 16, 8, torch.float16, 6, 2),  # fp16 q, block size 8, window, split-K
    ([5, 40, 17, 9], [1, 7, 17, 3], 4, 2, 32, 16, torch.bfloat16, None, None),  # bf16 q: the dots run in fp16
]


@pytest.mark.parametrize("ctx,q_lens,hq,hk,d,page,dtype,window,splits", CASES)
def test_triton_paged_attention_reads_fp8_caches(triton_kernels, kernel_check, seeded, ctx, q_lens, hq, hk, d, page,
                                                 dtype, window, splits):  # fmt: skip
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    args, expected = _fp8_batch(ctx, q_lens, hq, hk, d, page, dtype, window, triton_kernels.device)
    out = fn(*args, None, window, splits)
    assert out.dtype == dtype and out.shape == args[0].shape
    kernel_check.assert_close(out.float().cpu(), expected, dtype, "paged out over an fp8 cache")
    # the reference on the very same FP8 cache: the kernel's upcast in registers is the reference's explicit one
    kernel_check.assert_close(
        out.float().cpu(), ref.paged_attention(*args, None, window).float().cpu(), dtype, "vs ref"
    )


def test_triton_write_into_an_fp8_cache(triton_kernels, seeded):
    fn = triton_kernels.load("paged_attention", "write_kv_cache")
    dev = triton_kernels.device
    num_blocks, page, hk, d = 4, 16, 3, 16
    k_cache = torch.zeros(num_blocks, page, hk, d, dtype=FP8, device=dev)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * page)[:9].to(dev)
    slots[[2, 5]] = -1  # padding tokens
    kv = torch.randn(9, 2 * hk, d, device=dev) * 4
    kv[0, 0, :3] = torch.tensor([1000.0, -700.0, 448.0])  # past e4m3's range: saturates
    k, v = kv[:, :hk], kv[:, hk:]  # strided views, as from a fused projection
    fn(k, v, k_cache, v_cache, slots)
    ref.write_kv_cache(k, v, k_ref, v_ref, slots)
    assert torch.isfinite(k_cache.float()).all() and torch.isfinite(v_cache.float()).all()
    assert k_cache.view(-1, hk, d)[slots[0], 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    if triton_kernels.interpreted:
        # Triton 3.9's interpreter converts fp32 -> e4m3 its own way: ties away from zero, subnormals flushed, and a
        # round-up into the next power of two loses the carry (1.97 -> 1.0, not 2.0); hardware rounds as torch does
        for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
            got, want = got.float(), want.float()
            near = (got - want).abs() <= want.abs() / 8 + 2.0**-9
            lost_carry = (got * 2 == want) & (torch.frexp(want).mantissa.abs() == 0.5)
            assert (near | lost_carry).all()
            assert (got == want).float().mean().item() > 0.9
    else:  # hardware rounds to nearest even, as torch: bit-exact
        assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
        assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


# --- GPU: real shapes and CUDA graphs ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ctx,q_lens,hq,hk,d,page",
    [
        ([384] * 256, [1] * 256, 32, 8, 128, 16),  # the qwen3-8b rollout bench's decode (B256, ~384 tokens)
        ([7, 300, 4096, 1000], [1, 1, 1, 1], 16, 8, 128, 16),  # small batch, long context: split-K
        ([600, 2048, 129, 50], [1, 512, 129, 1], 32, 8, 128, 16),  # chunked prefill over cached prefixes + decode
    ],
)
def test_triton_paged_fp8_gpu_real_shapes(triton_kernels, kernel_check, seeded, ctx, q_lens, hq, hk, d, page):
    fn = triton_kernels.load("paged_attention")
    args, expected = _fp8_batch(ctx, q_lens, hq, hk, d, page, torch.bfloat16, None, triton_kernels.device)
    out = fn(*args)
    kernel_check.assert_close(out.float().cpu(), expected, torch.bfloat16, f"paged fp8 ctx={ctx[:4]}")


@pytest.mark.gpu
def test_triton_paged_fp8_gpu_graph_capture(triton_kernels, seeded):
    """write (quantising) + paged attention over FP8 blocks captured in one CUDA graph and replayed."""
    from polyrl.platform import device

    api = device.graph_api()
    if api is None or triton_kernels.interpreted:
        pytest.skip("CUDA graphs are not available on this device")
    graph_cls, graph_ctx = api
    attn = triton_kernels.load("paged_attention")
    write = triton_kernels.load("paged_attention", "write_kv_cache")
    dev = triton_kernels.device
    args, _ = _fp8_batch([100, 1500], [1, 1], 8, 2, 128, 16, torch.bfloat16, device=dev)
    q, k_cache, v_cache, tables, ctx_lens = args[:5]
    new_k = torch.randn(2, 2, 128, dtype=torch.bfloat16, device=dev)
    new_v = torch.randn_like(new_k)
    pos = ctx_lens.long() - 1
    slots = tables[torch.arange(2, device=dev), pos // 16].long() * 16 + pos % 16
    write(new_k, new_v, k_cache, v_cache, slots)
    expected = attn(*args)
    graph = graph_cls()
    with graph_ctx(graph):
        write(new_k, new_v, k_cache, v_cache, slots)
        out = attn(*args)
    new_k.copy_(torch.randn_like(new_k))
    q.copy_(torch.randn_like(q))
    graph.replay()
    device.synchronize()
    assert not torch.equal(out, expected)
    want = k_cache.clone()
    ref.write_kv_cache(new_k, new_v, want, v_cache.clone(), slots)
    assert torch.equal(want.view(torch.uint8), k_cache.view(torch.uint8))  # the replay quantised the new keys
    assert torch.equal(out, attn(*args))
