"""apply_token_bitmask: the reference against a bit-by-bit construction from Python integers, and the Triton kernel
against the reference (masked logits bit-exact, logsumexps allclose) under the interpreter on CPU, and at
B=256 x V=151936 on the GPU."""

from __future__ import annotations

import pytest
import torch

from polyrl import kernels
from polyrl.kernels.token_bitmask import reference as R


def _bitmask(G: int, V: int, seed: int, extra_words: int = 0) -> tuple[torch.Tensor, list[list[bool]]]:
    g = torch.Generator().manual_seed(seed)
    W = (V + 31) // 32 + extra_words
    allowed = [[bool(b) for b in row] for row in (torch.rand(G, 32 * W, generator=g) < 0.3).tolist()]
    allowed[0] = [False] * (32 * W)  # a row allowing nothing: both logsumexps stay finite only where they should
    allowed[0][V - 1] = True  # ... the last column only
    words = []
    for row in allowed:
        ws = []
        for w in range(W):
            u = sum(1 << b for b in range(32) if row[32 * w + b])
            ws.append(u - (1 << 32) if u >= 1 << 31 else u)  # as int32
        words.append(ws)
    return torch.tensor(words, dtype=torch.int32), allowed


def test_unpack_is_lsb_first_per_word():
    bm, allowed = _bitmask(3, 77, seed=1, extra_words=1)
    got = R.unpack_bitmask(bm, 77)
    assert got.shape == (3, 77)
    assert got.tolist() == [row[:77] for row in allowed]


@pytest.mark.parametrize("rows", [None, [3, 0]])
def test_reference_masks_and_measures_the_allowed_mass(rows):
    B, V = 4, 77
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, V, generator=g) * 3
    inv = torch.tensor([1.0, 0.5, 2.0, 1.25])
    G = B if rows is None else len(rows)
    bm, allowed = _bitmask(G, V, seed=3)
    idx = None if rows is None else torch.tensor(rows)
    masked, lse, lse_m = R.apply_token_bitmask(logits, bm, idx, inv)
    row_of = list(range(B)) if rows is None else rows
    expect = logits.clone()
    for j, r in enumerate(row_of):
        for v in range(V):
            if not allowed[j][v]:
                expect[r, v] = float("-inf")
    assert torch.equal(masked, expect)
    assert torch.equal(logits.isinf().sum(), torch.tensor(0))  # the input is left as it was
    for j, r in enumerate(row_of):
        z = logits[r].double() * float(inv[r])
        keep = torch.tensor(allowed[j][:V])
        assert abs(float(lse[j]) - float(torch.logsumexp(z, 0))) < 1e-5
        assert abs(float(lse_m[j]) - float(torch.logsumexp(z[keep], 0))) < 1e-5
    assert float(lse_m[0]) == pytest.approx(float(logits[row_of[0], V - 1] * inv[row_of[0]]), abs=1e-5)


def test_op_dispatches_to_the_reference_on_cpu():
    logits = torch.randn(2, 40)
    bm, _ = _bitmask(2, 40, seed=4)
    out = kernels.apply_token_bitmask(logits, bm, None, torch.ones(2))
    ref = R.apply_token_bitmask(logits, bm, None, torch.ones(2))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize(
    "B,V,rows,dtype",
    [(3, 70, None, torch.float32), (4, 4100, [2, 0, 3], torch.bfloat16), (2, 33, [1], torch.float16)],
)
def test_triton_matches_reference(triton_kernels, B, V, rows, dtype):
    fn = triton_kernels.load("token_bitmask", "apply_token_bitmask")
    dev = triton_kernels.device
    g = torch.Generator().manual_seed(B * V)
    logits = (torch.randn(B, V, generator=g) * 4).to(dtype).to(dev)
    inv = (torch.rand(B, generator=g) + 0.5).to(dev)
    G = B if rows is None else len(rows)
    bm, _ = _bitmask(G, V, seed=V)
    bm = bm.to(dev)
    idx = None if rows is None else torch.tensor(rows, device=dev)
    got = fn(logits, bm, idx, inv)
    ref = R.apply_token_bitmask(logits.cpu(), bm.cpu(), None if idx is None else idx.cpu(), inv.cpu())
    assert got[0].dtype == dtype and torch.equal(got[0].cpu(), ref[0])  # a copy and -inf: exact
    torch.testing.assert_close(got[1].cpu(), ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2].cpu(), ref[2], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_triton_at_the_bench_shape(triton_kernels):
    if triton_kernels.interpreted:
        pytest.skip("real shape: GPU only")
    fn = triton_kernels.load("token_bitmask", "apply_token_bitmask")
    dev = triton_kernels.device
    B, V = 256, 151936
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(B, V, device=dev, generator=g).to(torch.bfloat16)
    bm = torch.randint(-(2**31), 2**31 - 1, (B, (V + 31) // 32), device=dev, dtype=torch.int32, generator=g)
    inv = torch.ones(B, device=dev)
    got = fn(logits, bm, None, inv)
    ref = R.apply_token_bitmask(logits, bm, None, inv)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-4)
