"""Paged attention and KV-cache writes: the references and the Triton kernels against contiguous varlen
attention over the same keys, with shuffled (non-contiguous) block tables, mixed decode + prefill-over-
prefix batches, GQA, sliding window, two block sizes and forced key-range splits (flash-decoding).

On the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` on tiny shapes (fp32/fp16: the
interpreter's bf16 ``tl.dot`` is wrong); real shapes and CUDA-graph capture carry the ``gpu`` marker.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.kernels.attention.reference import attend
from polyrl.kernels.paged_attention import reference as ref


@dataclass
class Batch:
    q: torch.Tensor  # [T_new, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    max_seqlen_q: int
    expected: torch.Tensor  # contiguous attention over each sequence's keys (fp32)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.cu_seqlens_q,
                self.max_seqlen_q)  # fmt: skip


def _batch(ctx, q_lens, hq, hk, d, page, dtype, window=None, device="cpu", spare_blocks=3) -> Batch:
    """Random keys per sequence written through the reference into shuffled cache blocks.

    Everything is made and computed on ``device``: at the real GPU shapes (a 1 GiB cache per dtype) building the
    batch on the host took most of a two-minute test."""
    n_blocks = [-(-c // page) for c in ctx]
    total = sum(n_blocks) + spare_blocks
    perm = torch.randperm(total)
    on = dict(dtype=dtype, device=device)
    k_cache = torch.randn(total, page, hk, d, **on)  # spare blocks hold garbage that must be ignored
    v_cache = torch.randn(total, page, hk, d, **on)
    tables = torch.full((len(ctx), max(n_blocks) + 1), total - 1, dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, **on)
    outs, used = [], 0
    for b, (c, ql) in enumerate(zip(ctx, q_lens)):
        tables[b, : n_blocks[b]] = perm[used : used + n_blocks[b]].int()
        used += n_blocks[b]
        k, v = torch.randn(c, hk, d, **on), torch.randn(c, hk, d, **on)
        pos = torch.arange(c)
        slots = (tables[b, pos // page].long() * page + pos % page).to(device)
        ref.write_kv_cache(k, v, k_cache, v_cache, slots)
        s = sum(q_lens[:b])
        outs.append(attend(q[s : s + ql].float(), k.float(), v.float(), d**-0.5, window))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: t.to(device)
    return Batch(q, k_cache, v_cache, to(tables), to(torch.tensor(ctx, dtype=torch.int32)), to(cu), max(q_lens),
                 torch.cat(outs).cpu())  # fmt: skip


# --- references --------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_contiguous_attention(seeded, window):
    # decode, prefill over a prefix, a full prompt (q_len == context), GQA 4:2, block size 16
    batch = _batch([9, 40, 17, 23], [1, 7, 17, 1], 4, 2, 16, 16, torch.float64, window)
    out = ref.paged_attention(*batch.args(), None, window)
    assert (out.double() - batch.expected.double()).abs().max().item() < 1e-6  # expected was computed in fp32


def test_reference_write_kv_cache_skips_negative_slots():
    k_cache = torch.zeros(3, 4, 1, 2)
    v_cache = torch.zeros(3, 4, 1, 2)
    k = torch.arange(10.0).reshape(5, 1, 2)
    slots = torch.tensor([5, -1, 0, -1, 11])
    ref.write_kv_cache(k, -k, k_cache, v_cache, slots)
    flat = k_cache.view(12, 2)
    assert flat[5].tolist() == [0.0, 1.0]
    assert flat[0].tolist() == [4.0, 5.0]  # slot 0 is written by token 2, not clobbered by the skipped tokens
    assert flat[11].tolist() == [8.0, 9.0]
    assert (v_cache.view(12, 2)[11] == -flat[11]).all()
    assert int((flat != 0).any(dim=1).sum()) == 3


def test_reference_write_kv_cache_keeps_slot_zero_when_only_skipped():
    k_cache = torch.full((2, 2, 1, 1), 7.0)
    v_cache = torch.full((2, 2, 1, 1), 7.0)
    ref.write_kv_cache(torch.ones(2, 1, 1), torch.ones(2, 1, 1), k_cache, v_cache, torch.tensor([-1, 3]))
    assert k_cache.flatten().tolist() == [7.0, 7.0, 7.0, 1.0]


def test_reference_write_kv_cache_reads_nothing_back_to_the_host(host_reads):
    """Regression (H200): indexing with a 0-dim argmax read it on the host, which broke graph capture."""
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 8)
    with host_reads() as reads:
        ref.write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([3, -1, 0, 40, -1]))
    assert reads.seen == []
    assert torch.equal(k_cache.view(-1, 2, 8)[40], k[3]) and torch.equal(k_cache.view(-1, 2, 8)[0], k[2])


# --- Triton ------------------------------------------------------------------------------------

CASES = [
    # ctx, q_lens, hq, hk, d, page, dtype, window, splits
    ([5, 40, 17], [1, 1, 1], 4, 2, 32, 16, torch.float32, None, None),  # pure decode
    ([5, 40, 17, 9], [1, 7, 17, 3], 4, 2, 32, 16, torch.float32, None, None),  # mixed decode + prefill
    ([5, 40, 17, 9], [1, 7, 17, 3], 8, 2, 16, 8, torch.float16, 6, 2),  # block size 8, window, split-K
    ([33, 3, 64], [1, 1, 2], 3, 1, 16, 16, torch.float32, None, 3),  # group of 3, splits incl. empty ones
]


@pytest.mark.parametrize("ctx,q_lens,hq,hk,d,page,dtype,window,splits", CASES)
def test_triton_paged_attention(triton_kernels, kernel_check, seeded, ctx, q_lens, hq, hk, d, page, dtype, window,
                                splits):  # fmt: skip
    mod_fn = triton_kernels.load("paged_attention", "_paged_attention")
    batch = _batch(ctx, q_lens, hq, hk, d, page, dtype, window, triton_kernels.device)
    out = mod_fn(*batch.args(), None, window, splits)
    assert out.dtype == dtype and out.shape == batch.q.shape
    kernel_check.assert_close(out.float().cpu(), batch.expected, dtype, "paged out")


def test_triton_paged_tuning_overrides_keep_the_result(triton_kernels, kernel_check, seeded):
    """The launch settings scripts/paged_attention_sweep.py tries (keys per tile, warps, stages, splits) change the
    schedule, not the result."""
    mod_fn = triton_kernels.load("paged_attention", "_paged_attention")
    batch = _batch([5, 40, 17], [1, 1, 1], 4, 2, 32, 16, torch.float32, None, triton_kernels.device)
    for tuning, splits in (({"block_n": 32, "num_warps": 2, "num_stages": 1}, None), ({"block_n": 16}, 2)):
        out = mod_fn(*batch.args(), None, None, splits, tuning)
        kernel_check.assert_close(out.float().cpu(), batch.expected, torch.float32, f"paged out {tuning}")


def test_triton_paged_public_entry_and_validation(triton_kernels, kernel_check, seeded):
    fn = triton_kernels.load("paged_attention")
    batch = _batch([20, 3], [4, 1], 2, 2, 16, 16, torch.float32, device=triton_kernels.device)
    kernel_check.assert_close(fn(*batch.args(), 0.25).cpu(), ref.paged_attention(*batch.args(), 0.25).cpu(),
                              torch.float32, "paged out, explicit scale")  # fmt: skip
    with pytest.raises(ConfigError, match="window"):
        fn(*batch.args(), None, 0)
    odd = _batch([20, 3], [4, 1], 2, 1, 24, 16, torch.float32, device=triton_kernels.device)  # head dim 24
    kernel_check.assert_close(fn(*odd.args()).cpu(), odd.expected, torch.float32, "paged out, head dim 24")


def test_triton_write_kv_cache(triton_kernels, seeded):
    fn = triton_kernels.load("paged_attention", "write_kv_cache")
    dev = triton_kernels.device
    num_blocks, page, hk, d = 4, 16, 3, 16
    k_cache = torch.randn(num_blocks, page, hk, d, device=dev)
    v_cache = torch.randn(num_blocks, page, hk, d, device=dev)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * page)[:9].to(dev)
    slots[[2, 5]] = -1  # padding tokens
    kv = torch.randn(9, 2 * hk, d, device=dev)
    k, v = kv[:, :hk], kv[:, hk:]  # strided views, as from a fused projection
    fn(k, v, k_cache, v_cache, slots)
    ref.write_kv_cache(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # fp32 values into an fp16 cache are rounded like .to(float16)
    k16, v16 = torch.zeros(num_blocks, page, hk, d, dtype=torch.float16, device=dev), None
    v16 = torch.zeros_like(k16)
    fn(k, v, k16, v16, slots)
    assert torch.equal(k16.view(-1, hk, d)[slots[0]], k[0].half())


# --- GPU: real shapes and CUDA graphs ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ctx,q_lens,hq,hk,d,page,window",
    [
        ([2048] * 256, [1] * 256, 32, 8, 128, 16, None),  # the decode bench shape
        ([7, 300, 4096, 1000], [1, 1, 1, 1], 16, 8, 128, 16, None),  # small batch, long context: split-K
        ([600, 2048, 129, 50], [1, 512, 129, 1], 32, 8, 128, 32, None),  # chunked prefill + decode
        ([3000, 90], [1, 90], 16, 2, 64, 16, 256),  # window
        ([500], [200], 8, 8, 256, 16, None),
    ],
)
def test_triton_paged_gpu_real_shapes(triton_kernels, kernel_check, seeded, ctx, q_lens, hq, hk, d, page, window):
    fn = triton_kernels.load("paged_attention")
    for dtype in (torch.bfloat16, torch.float16):
        batch = _batch(ctx, q_lens, hq, hk, d, page, dtype, window, triton_kernels.device)
        out = fn(*batch.args(), None, window)
        kernel_check.assert_close(out.float().cpu(), batch.expected, dtype, f"paged {dtype} ctx={ctx[:4]}")


@pytest.mark.gpu
def test_triton_paged_gpu_graph_capture(triton_kernels, seeded):
    """write_kv_cache + paged_attention (decode, split-K) captured in one CUDA graph and replayed."""
    from polyrl.platform import device

    api = device.graph_api()
    if api is None or triton_kernels.interpreted:
        pytest.skip("CUDA graphs are not available on this device")
    graph_cls, graph_ctx = api
    attn = triton_kernels.load("paged_attention")
    write = triton_kernels.load("paged_attention", "write_kv_cache")
    dev = triton_kernels.device
    batch = _batch([100, 1500], [1, 1], 8, 2, 128, 16, torch.bfloat16, device=dev)
    new_k = torch.randn(2, 2, 128, dtype=torch.bfloat16, device=dev)
    new_v = torch.randn_like(new_k)
    ctx = batch.context_lens.long()
    pos = ctx - 1
    slots = batch.block_tables[torch.arange(2, device=dev), pos // 16].long() * 16 + pos % 16
    write(new_k, new_v, batch.k_cache, batch.v_cache, slots)
    expected = attn(*batch.args())
    graph = graph_cls()
    with graph_ctx(graph):
        write(new_k, new_v, batch.k_cache, batch.v_cache, slots)
        out = attn(*batch.args())
    new_k.copy_(torch.randn_like(new_k))
    batch.q.copy_(torch.randn_like(batch.q))
    graph.replay()
    device.synchronize()
    assert not torch.equal(out, expected)
    eager_cache = batch.k_cache.clone()
    write(new_k, new_v, eager_cache, batch.v_cache, slots)
    assert torch.equal(eager_cache, batch.k_cache)
    assert torch.equal(out, attn(*batch.args()))


@pytest.mark.gpu
def test_reference_write_kv_cache_gpu_graph_capture(triton_kernels, seeded):
    from polyrl.platform import device

    api = device.graph_api()
    if api is None or triton_kernels.interpreted:
        pytest.skip("CUDA graphs are not available on this device")
    graph_cls, graph_ctx = api
    dev = triton_kernels.device
    k_cache = torch.zeros(4, 16, 2, 64, device=dev)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 64, device=dev)
    slots = torch.tensor([3, -1, 0, 40, -1], device=dev)
    ref.write_kv_cache(k, k, k_cache, v_cache, slots)  # warm-up
    graph = graph_cls()
    with graph_ctx(graph):
        ref.write_kv_cache(k, k, k_cache, v_cache, slots)
    k.copy_(torch.randn_like(k))
    graph.replay()
    device.synchronize()
    flat = k_cache.view(-1, 2, 64)
    assert torch.equal(flat[3], k[0]) and torch.equal(flat[0], k[2]) and torch.equal(flat[40], k[3])


def test_graph_safety_follows_the_selected_implementation():
    from polyrl import kernels

    assert not kernels.paged_attention_graph_safe("cpu", torch.float32, 64)  # the reference syncs the host
    if torch.cuda.is_available():
        assert not kernels.paged_attention_graph_safe("cuda", torch.bfloat16, 8)  # head dim the kernel lacks
        assert kernels.paged_attention_graph_safe("cuda", torch.bfloat16, 128)
