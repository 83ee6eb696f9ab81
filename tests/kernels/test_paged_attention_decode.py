"""The decode kernel (``kernels/paged_attention/decode.py``: one new token per sequence, KV heads packed into one
program) against the reference (``reference.py``, the spec) over shuffled block tables: GQA groups 1, 2, 3, 4 and 8,
KV heads per program below and equal to Hk (and a non-power-of-two Hk), contexts at page boundaries, sequences with
no new token, sliding windows, FP8 caches, fp32 queries and forced key-range splits; mixed batches (0, 1 and more new
tokens a sequence) where every decode row equals a decode-only call of the same sequences bit for bit; and its launch
heuristics. On the CPU under the Triton interpreter on tiny shapes; real shapes carry the ``gpu`` marker.
"""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.kernels.paged_attention import reference as ref

FP8 = torch.float8_e4m3fn
CTX = [1, 15, 16, 17, 100]  # one token, both sides of a 16-token page, several pages


def _case(ctx, q_lens, hq, hk, d, page, q_dtype, kv_dtype=None, device="cpu", spare=3):
    """Random K/V per sequence written through the reference write into shuffled cache blocks (spare blocks and the
    unused table entries point at garbage). Returns the ``paged_attention`` positional args."""
    kv_dtype = kv_dtype or q_dtype
    n_blocks = [-(-c // page) for c in ctx]
    total = sum(n_blocks) + spare
    perm = torch.randperm(total)
    k_cache = (torch.randn(total, page, hk, d, device=device) * 2).to(kv_dtype)
    v_cache = (torch.randn(total, page, hk, d, device=device) * 2).to(kv_dtype)
    tables = torch.full((len(ctx), max(n_blocks) + 1), total - 1, dtype=torch.int32)
    used = 0
    for b, c in enumerate(ctx):
        tables[b, : n_blocks[b]] = perm[used : used + n_blocks[b]].int()
        used += n_blocks[b]
        pos = torch.arange(c)
        slots = (tables[b, pos // page].long() * page + pos % page).to(device)
        k, v = torch.randn(c, hk, d, device=device), torch.randn(c, hk, d, device=device)
        ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), hq, d, device=device).to(q_dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables.to(device), lens, cu, max(q_lens)


def _expected(args, window=None):
    """The reference in fp64 over the very same caches (their values are exact in fp32 and fp64)."""
    q, kc, vc = args[:3]
    return ref.paged_attention(q.double(), kc.float(), vc.float(), *args[3:], None, window).float().cpu()


def _sub_batch(args, seqs):
    """The same sequences' rows of a batch, alone (same caches, same block tables)."""
    q, kc, vc, tables, lens, cu, _ = args
    bounds = cu.tolist()
    rows = [torch.arange(bounds[b], bounds[b + 1]) for b in seqs]
    q_lens = [len(r) for r in rows]
    cu_sub = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=cu.device)
    idx = torch.cat(rows).to(q.device)
    sel = torch.tensor(seqs, device=tables.device)
    return (q[idx], kc, vc, tables[sel], lens[sel], cu_sub, max(q_lens)), idx


DECODE_CASES = [
    # hq, hk, d, page, q dtype, kv heads per program (None: heuristic), window, splits
    (4, 4, 32, 16, torch.float32, None, None, None),  # GROUP 1, all four KV heads in one program
    (8, 4, 32, 16, torch.float32, 2, None, None),  # GROUP 2, two programs of two KV heads
    (8, 2, 16, 16, torch.float16, None, None, 2),  # GROUP 4, fp16, split in two
    (8, 1, 16, 8, torch.float16, None, 5, None),  # GROUP 8 (one KV head), page 8: tiles span two pages, window
    (6, 2, 16, 16, torch.float32, 1, 20, 4),  # GROUP 3 (rows padded), one KV head a program, window + 4 splits
    (6, 3, 16, 16, torch.float32, None, None, 1),  # Hk 3: one program of 4 KV-head slots, the last one masked
]


@pytest.mark.parametrize("hq,hk,d,page,dtype,kv_heads,window,splits", DECODE_CASES)
def test_decode_matches_the_reference(triton_kernels, kernel_check, seeded, hq, hk, d, page, dtype, kv_heads, window,
                                      splits):  # fmt: skip
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    # the contexts at page boundaries, plus sequences with no new token (an empty one and one with a cached prefix)
    args = _case([*CTX, 0, 20], [1] * len(CTX) + [0, 0], hq, hk, d, page, dtype, device=triton_kernels.device)
    tuning = {"kv_heads": kv_heads} if kv_heads else None
    out = fn(*args, None, window, splits, tuning)
    assert out.dtype == dtype and out.shape == args[0].shape
    kernel_check.assert_close(out.float().cpu(), _expected(args, window), dtype, f"decode hq={hq} hk={hk}")


@pytest.mark.parametrize("q_dtype,splits", [(torch.bfloat16, None), (torch.float16, 2), (torch.float32, None)])
def test_decode_over_an_fp8_cache(triton_kernels, kernel_check, seeded, q_dtype, splits):
    """bf16 queries: the dots run in fp16 (``_f16_dots``); fp16 and fp32 queries upcast the FP8 tiles to their own."""
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    args = _case(CTX, [1] * len(CTX), 8, 2, 32, 16, q_dtype, FP8, device=triton_kernels.device)
    out = fn(*args, None, None, splits)
    kernel_check.assert_close(out.float().cpu(), _expected(args), q_dtype, f"decode over fp8, {q_dtype} q")


@pytest.mark.parametrize("splits", [1, 2, None])
def test_mixed_batch_decode_rows_equal_a_decode_only_call(triton_kernels, kernel_check, seeded, splits):
    """Batch invariance: a sequence with one new token decodes to the same bits whether its batch also holds prefill
    chunks and empty sequences or not (at the same split count); the prefill rows are the general kernel's, exactly
    as on the old ("rows") path, and everything matches the reference."""
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    ctx, q_lens = [17, 40, 0, 100, 23, 16, 9], [1, 7, 0, 1, 23, 1, 0]
    args = _case(ctx, q_lens, 8, 2, 16, 16, torch.float32, device=triton_kernels.device)
    mixed = fn(*args, None, None, splits)
    kernel_check.assert_close(mixed.cpu(), _expected(args), torch.float32, "mixed batch")
    decode_args, rows = _sub_batch(args, [0, 3, 5])
    alone = fn(*decode_args, None, None, splits)
    assert torch.equal(mixed[rows], alone)
    prefill_args, prefill_rows = _sub_batch(args, [1, 4])
    old = fn(*args, None, None, splits, {"decode": "rows"})
    assert torch.equal(mixed[prefill_rows], old[prefill_rows])
    kernel_check.assert_close(old.cpu(), _expected(args), torch.float32, "mixed batch, rows path")
    kernel_check.assert_close(fn(*prefill_args, None, None, splits).cpu(), _expected(prefill_args), torch.float32,
                              "prefill only")  # fmt: skip


@pytest.mark.parametrize("splits", [1, 2])
def test_each_kernel_of_a_mixed_step_leaves_the_others_rows_alone(triton_kernels, seeded, splits):
    """In a mixed step the decode kernel writes only the rows of one-token sequences and the general kernel (and its
    split combine) only the others: launched alone over the batch, each leaves the other's rows as they were."""
    mod = triton_kernels.load("paged_attention", "decode")
    gen = triton_kernels.load("paged_attention", "_general")
    args = _case([17, 40, 0, 100, 23], [1, 7, 0, 1, 23], 8, 2, 16, 16, torch.float32, device=triton_kernels.device)
    q, kc, vc, tables, lens, cu, max_q = args
    decode_rows = torch.tensor([0, 8], device=q.device)
    other = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    other[decode_rows] = False
    out = torch.full_like(q, float("nan"))
    mod.paged_decode(q, kc, vc, tables, lens, cu, out, 16**-0.5 * math.log2(math.e), None, False, splits)
    assert not out[decode_rows].isnan().any() and out[other].isnan().all()
    out = torch.full_like(q, float("nan"))
    gen(q, kc, vc, tables, lens, cu, max_q, 16**-0.5, None, splits, {}, out, skip_decode=True)
    assert out[decode_rows].isnan().all() and not out[other].isnan().any()


def test_the_rows_path_and_the_tuning_overrides_keep_the_result(triton_kernels, kernel_check, seeded):
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    args = _case(CTX, [1] * len(CTX), 8, 4, 32, 16, torch.float32, device=triton_kernels.device)
    want = _expected(args)
    for tuning in ({"decode": "rows"}, {"kv_heads": 1, "block_n": 32, "num_warps": 2, "num_stages": 1},
                   {"kv_heads": 4, "block_n": 4}):  # fmt: skip
        kernel_check.assert_close(fn(*args, None, None, None, tuning).cpu(), want, torch.float32, f"{tuning}")
    with pytest.raises(ConfigError, match="decode path"):
        fn(*args, None, None, None, {"decode": "columns"})
    with pytest.raises(ConfigError, match="power of two"):
        fn(*args, None, None, None, {"kv_heads": 3})
    with pytest.raises(ConfigError, match=">= 16"):
        fn(*args, None, None, None, {"kv_heads": 2, "block_n": 4})


def test_decode_settings_follow_the_head_shapes_only(triton_kernels):
    decode_settings = triton_kernels.load("paged_attention", "decode").decode_settings
    # qwen3-0.6b (Hq 16, Hk 8), bf16 cache: 4 KV heads a program (8 query rows), one page a tile, 4 warps, 2 stages
    assert decode_settings(2, 8, 128, 2) == decode_settings(2, 8, 128, 2, {"decode": "heads"})
    s = decode_settings(2, 8, 128, 2)
    assert (s.kv_heads, s.block_n, s.num_warps, s.num_stages) == (4, 16, 4, 2)
    assert decode_settings(4, 8, 128, 2).kv_heads == 4  # qwen3-8b: 16 rows
    assert decode_settings(8, 8, 128, 2).kv_heads == 2  # 16 rows at most
    assert decode_settings(16, 8, 128, 2).kv_heads == 1
    assert decode_settings(1, 2, 64, 2).kv_heads == 2  # no more KV heads than the model has
    assert decode_settings(128, 1, 64, 2).kv_heads == 1
    assert decode_settings(2, 8, 128, 4).block_n == 16  # fp32 cache: 16 positions x 4 heads = 64 KB of K + V
    assert decode_settings(2, 8, 256, 4).block_n == 8
    assert decode_settings(2, 8, 128, 1).num_stages == 5  # fp8: the sweep's best at the 8b shape
    assert decode_settings(1, 1, 128, 4).block_n == 16  # at least 16 key rows a tile (the MMA's K)
    tuned = decode_settings(2, 8, 128, 2, {"kv_heads": 2, "block_n": 32, "num_warps": 8, "num_stages": 4})
    assert (tuned.kv_heads, tuned.block_n, tuned.num_warps, tuned.num_stages) == (2, 32, 8, 4)
    # the register cap: proposed over FP8 only (four programs an SM), removable or resettable through tuning
    assert decode_settings(4, 8, 128, 1).max_registers == 128
    assert decode_settings(4, 8, 128, 2).max_registers is None
    assert decode_settings(4, 8, 128, 1, {"max_registers": 0}).max_registers is None
    assert decode_settings(4, 8, 128, 2, {"max_registers": 96}).max_registers == 96


def test_register_cap_only_where_it_saves_a_wave(triton_kernels):
    """The FP8 cap is kept only where four programs an SM need fewer waves than the uncapped three: qwen3-8b B256
    (512 programs, 132 SMs: 1 wave against 2), not B128 (256 programs: one wave either way) nor 1,060 programs (3
    waves either way); 2,048 programs: 4 against 6, kept. A cap from tuning is kept as given."""
    mod = triton_kernels.load("paged_attention", "decode")
    fp8 = mod.decode_settings(4, 8, 128, 1)
    assert mod.register_cap(fp8, 512, 132).max_registers == 128
    assert mod.register_cap(fp8, 256, 132).max_registers is None
    assert mod.register_cap(fp8, 396, 132).max_registers is None  # exactly three an SM: one wave uncapped
    assert mod.register_cap(fp8, 397, 132).max_registers == 128
    assert mod.register_cap(fp8, 1060, 132).max_registers is None  # 3 waves either way (1,056 < 1,060 <= 1,188)
    assert mod.register_cap(fp8, 2048, 132).max_registers == 128  # 4 waves against 6
    tuned = mod.decode_settings(4, 8, 128, 1, {"max_registers": 128})
    assert mod.register_cap(tuned, 256, 132, {"max_registers": 128}).max_registers == 128
    bf16 = mod.decode_settings(4, 8, 128, 2)
    assert mod.register_cap(bf16, 512, 132) == bf16
    eight_warps = mod.decode_settings(4, 8, 128, 1, {"num_warps": 8})  # the rule's counts are the 4-warp kernel's
    assert mod.register_cap(eight_warps, 512, 132).max_registers is None
    # ... on a Hopper part, where they were measured: not on Ada (8.9) nor where the capability is unknown
    assert mod.register_cap(fp8, 512, 132, capability=(9, 0)).max_registers == 128
    assert mod.register_cap(fp8, 512, 142, capability=(8, 9)).max_registers is None
    assert mod.register_cap(fp8, 512, 132, capability=None).max_registers is None
    # the launch options carry the cap only where the backend takes it
    options = fp8.launch_options()
    assert (options["num_warps"], options["num_stages"]) == (4, 5)
    assert options.get("maxnreg") == (128 if mod._REGISTER_CAP else None)
    assert "maxnreg" not in bf16.launch_options()


def test_small_batches_keep_the_general_kernel(triton_kernels, kernel_check, monkeypatch, seeded):
    """Without tuning or a forced split count the decode kernel serves only batches that fill the GPU on their own
    (B * Hk >= the general kernel's 1024-program target); smaller ones keep the general kernel and its splits."""
    mod = triton_kernels.load("paged_attention", "decode")
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    calls = []
    real = mod.paged_decode
    monkeypatch.setattr(mod, "paged_decode", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for b, want_heads in ((4, False), (128, True)):
        args = _case([3] * b, [1] * b, 8, 8, 16, 16, torch.float32, device=triton_kernels.device)
        calls.clear()
        out = fn(*args)
        assert bool(calls) == want_heads, (b, calls)
        kernel_check.assert_close(out.cpu(), _expected(args), torch.float32, f"B{b}")


def test_decode_splits_only_when_the_programs_are_few(triton_kernels):
    decode_splits = triton_kernels.load("paged_attention", "decode").decode_splits
    assert decode_splits(256, 2048) == 1  # B256 with every KV head in one program: enough programs
    assert decode_splits(128, 400) == 2
    assert decode_splits(64, 4176) == 4
    assert decode_splits(1, 272) == 4  # batch 1: split while a split keeps >= 64 keys
    assert decode_splits(8, 100) == 1  # too short to split


# --- GPU: real shapes --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kv_dtype", [(16, torch.bfloat16), (32, torch.bfloat16), (16, FP8)])
def test_decode_gpu_real_shapes_and_batch_invariance(triton_kernels, kernel_check, seeded, hq, kv_dtype):
    """qwen3-0.6b / -8b heads (Hk 8, D 128, page 16): 64 decode sequences next to two prefill chunks and alone give
    the same bits at the same split count, match the reference, and the old path within tolerance."""
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(1, 700, (66,), generator=g).tolist()
    q_lens = [1] * 64 + [128, 37]
    ctx[-2:] = [900, 37]
    args = _case(ctx, q_lens, hq, 8, 128, 16, torch.bfloat16, kv_dtype, device=triton_kernels.device)
    want = _expected(args)
    decode_args, rows = _sub_batch(args, list(range(64)))
    for splits in (1, 2, 4):
        mixed = fn(*args, None, None, splits)
        kernel_check.assert_close(mixed.float().cpu(), want, torch.bfloat16, f"mixed, {splits} splits")
        assert torch.equal(mixed[rows], fn(*decode_args, None, None, splits))
    old = fn(*decode_args, None, None, None, {"decode": "rows"})
    kernel_check.assert_close(fn(*decode_args).float().cpu(), old.float().cpu(), torch.bfloat16, "heads vs rows")


@pytest.mark.gpu
def test_decode_gpu_mixed_step_graph_capture(triton_kernels, seeded):
    """A mixed step (both kernels, both split combines) captured in one CUDA graph replays to the eager result."""
    from polyrl.platform import device

    api = device.graph_api()
    if api is None or triton_kernels.interpreted:
        pytest.skip("CUDA graphs are not available on this device")
    graph_cls, graph_ctx = api
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    args = _case([100, 1500, 40, 7], [1, 300, 0, 1], 16, 8, 128, 16, torch.bfloat16, device=triton_kernels.device)
    fn(*args, None, None, 2)  # compile outside the capture
    graph = graph_cls()
    with graph_ctx(graph):
        out = fn(*args, None, None, 2)
    args[0].copy_(torch.randn_like(args[0]))
    graph.replay()
    device.synchronize()
    assert torch.equal(out, fn(*args, None, None, 2))


@pytest.mark.gpu
def test_decode_gpu_fp8_register_cap_keeps_the_bits(triton_kernels, seeded):
    """qwen3-8b heads over an FP8 cache at a batch where the cap applies (B256: 512 programs, more than three an SM
    on any GPU under 171 SMs): the capped launch gives exactly the uncapped kernel's output."""
    fn = triton_kernels.load("paged_attention", "_paged_attention")
    g = torch.Generator().manual_seed(5)
    ctx = torch.randint(1, 300, (256,), generator=g).tolist()
    args = _case(ctx, [1] * 256, 32, 8, 128, 16, torch.bfloat16, FP8, device=triton_kernels.device)
    capped = fn(*args, None, None, 1, {"max_registers": 128})
    assert torch.equal(capped, fn(*args, None, None, 1, {"max_registers": 0}))
    assert torch.equal(capped, fn(*args, None, None, 1))
