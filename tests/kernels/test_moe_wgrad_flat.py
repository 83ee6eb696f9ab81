"""The persistent flat-loop weight-gradient kernel of moe_experts (``_grouped_wgrad_flat_kernel``): its
``C[e] = A[rows of e]^T @ B[rows of e]`` equals the per-tile kernel's and an fp32 torch product for experts with
no rows, rows not a multiple of BLOCK_K, gathered and contiguous B, fp32 and bf16, programs that own tiles across
expert boundaries and spare programs with nothing to do; and the whole op with ``WGRAD_FLAT`` on equals the
default. Under the interpreter the tiles are 16 x 16 x 16 (``_INTERP``)."""

from __future__ import annotations

import importlib

import pytest
import torch

COUNTS = (0, 5, 16, 37, 0, 20, 0)  # rows per expert; BLOCK_K = 16: k-steps 1, 1, 1, 3, 1, 2, 1
M, N = 24, 40  # 2 x 3 output tiles of 16 x 16 per expert (both edges partial): 42 tiles in all


def _module(triton_kernels):
    triton_kernels.load("moe", "moe_experts")  # a fresh import for this test
    return importlib.import_module("polyrl.kernels.moe.triton")


def _route(tk, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = experts[torch.randperm(len(experts), generator=g)].reshape(-1, 1)  # k = 1, shuffled tokens
    return tk._Routing(ids, len(counts))


def _inputs(n, dtype, gather, seed=1):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, M, generator=g).to(dtype)
    if gather:
        b = torch.randn(n + 3, N, generator=g).to(dtype)
        b_idx = torch.randint(0, n + 3, (n,), generator=g).to(torch.int32)
    else:
        b, b_idx = torch.randn(n, N, generator=g).to(dtype), None
    return a, b, b_idx


def _reference(route, a, b, b_idx):
    rows = b[b_idx.long()] if b_idx is not None else b
    off = route.offsets.tolist()
    return torch.stack([a[s:e].double().t() @ rows[s:e].double() for s, e in zip(off[:-1], off[1:])])


def test_item_offsets_count_one_step_for_an_expert_without_rows():
    pytest.importorskip("triton")
    from polyrl.kernels.moe import triton as tk

    route = _route(tk, COUNTS)
    # k-steps 1, 1, 1, 3, 1, 2, 1 of 16 rows, times 6 tiles per expert
    assert route.wgrad_items(16, 6).tolist() == [0, 6, 12, 18, 36, 42, 54, 60]
    assert route.wgrad_items(64, 2).tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    assert route.wgrad_items(16, 6).dtype == torch.int32


@pytest.mark.parametrize("programs", [1, 5, 50], ids=["P1", "P5_across_experts", "P50_spare_programs"])
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flat_wgrad_equals_per_tile_kernel_and_reference(triton_kernels, kernel_check, dtype, gather, programs):
    tk = _module(triton_kernels)
    route = _route(tk, COUNTS)
    a, b, b_idx = _inputs(route.n, dtype, gather)
    per_tile = torch.full((len(COUNTS), M, N), float("nan"), dtype=dtype)
    tk._wgrad_gemm(route, a, b, b_idx, M, N, per_tile, flat=False)
    flat = torch.full_like(per_tile, float("nan"))  # every tile must be written, the empty experts' zeros too
    tk._wgrad_gemm(route, a, b, b_idx, M, N, flat, flat=True, programs=programs)
    assert torch.equal(flat, per_tile), f"max abs diff {(flat.double() - per_tile.double()).abs().max().item():.3e}"
    want = _reference(route, a, b, b_idx)
    kernel_check.assert_close(flat, want, dtype, "flat wgrad", 2.0 if dtype == torch.bfloat16 else 1.0)
    assert flat[[0, 4, 6]].abs().max().item() == 0.0, "experts without rows get zero tiles"


@pytest.mark.parametrize("split_items", [0, 1], ids=["split_tiles", "split_items"])
@pytest.mark.parametrize("store_if", [0, 1], ids=["masked_store", "store_under_if"])
@pytest.mark.parametrize("programs", [3, 50])
def test_flat_wgrad_variants(triton_kernels, monkeypatch, programs, store_if, split_items):
    """STORE_IF 0 (every step stores, masked off but on the tile's last) and 1 (stored under an if); programs' tile
    ranges of TILES_PER_PROG tiles (SPLIT_ITEMS 0) or balanced by items (1): the same output."""
    tk = _module(triton_kernels)
    route = _route(tk, COUNTS, seed=2)
    a, b, b_idx = _inputs(route.n, torch.float32, gather=True, seed=3)
    per_tile = torch.empty(len(COUNTS), M, N)
    tk._wgrad_gemm(route, a, b, b_idx, M, N, per_tile, flat=False)
    monkeypatch.setitem(tk.CONFIGS, "wgrad_flat", tk.CONFIGS["wgrad_flat"][:6] + (store_if, split_items))
    flat = torch.full_like(per_tile, float("nan"))
    tk._wgrad_gemm(route, a, b, b_idx, M, N, flat, flat=True, programs=programs)
    assert torch.equal(flat, per_tile)


def test_flat_wgrad_with_no_routed_rows(triton_kernels):
    """T = 0 routed rows: every expert runs one masked step per tile and stores zeros."""
    tk = _module(triton_kernels)
    route = tk._Routing(torch.zeros(0, 2, dtype=torch.int64), 3)
    out = torch.full((3, M, N), float("nan"))
    tk._wgrad_gemm(route, torch.empty(0, M), torch.empty(0, N), None, M, N, out, flat=True, programs=4)
    assert torch.equal(out, torch.zeros_like(out))


def test_op_with_wgrad_flat_equals_default(triton_kernels, monkeypatch):
    """moe_experts forward + backward with WGRAD_FLAT on (both weight gradients through the flat kernel, >= 48 rows
    per expert) equals the default; a LoRA rank tile (block_n) keeps the per-tile kernel."""
    tk = _module(triton_kernels)
    g = torch.Generator().manual_seed(5)
    t, hid, inter, e, k = 100, 32, 24, 4, 2  # 50 rows per expert on average
    x = torch.randn(t, hid, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    gu = torch.randn(e, 2 * inter, hid, generator=g) * hid**-0.5
    dn = torch.randn(e, hid, inter, generator=g) * inter**-0.5
    dy = torch.randn(t, hid, generator=g)

    def run():
        leaves = [v.clone().requires_grad_(True) for v in (x, w, gu, dn)]
        y = tk.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        y.backward(dy)
        return [y.detach()] + [v.grad for v in leaves]

    default = run()
    flat_calls = []
    real = tk._wgrad_flat

    def counted(*args):
        flat_calls.append(args[4:6])  # (m, n)
        return real(*args)

    monkeypatch.setattr(tk, "_wgrad_flat", counted)
    monkeypatch.setattr(tk, "WGRAD_FLAT", True)
    flat = run()
    assert sorted(flat_calls) == [(hid, inter), (2 * inter, hid)], flat_calls
    for name, p, q in zip(("y", "dx", "dw", "dgate_up", "ddown"), flat, default):
        assert torch.equal(p, q), f"{name}: max abs diff {(p - q).abs().max().item():.3e}"
    route = tk._Routing(ids, e)
    out = torch.empty(e, 2 * inter, 8)
    tk._wgrad_gemm(route, torch.randn(route.n, 2 * inter), torch.randn(route.n, 8), None, 2 * inter, 8, out,
                   block_n=16)  # fmt: skip
    assert len(flat_calls) == 2, "a rank tile override must keep the per-tile kernel"
