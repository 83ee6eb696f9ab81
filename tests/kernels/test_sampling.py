"""sample_tokens: the hash RNG against plain Python integers, the reference's draws against softmax(z) (chi-square),
and the Triton kernel against the reference (exact tokens up to fp ties, log-probs allclose) under the
interpreter on CPU and at B=512 x V=151936 on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.kernels.sampling import reference as R

M = 0xFFFFFFFF


def _fmix_py(x: int) -> int:
    x ^= x >> 16
    x = (x * R.FMIX_C1) & M
    x ^= x >> 13
    x = (x * R.FMIX_C2) & M
    return x ^ (x >> 16)


def _hash_py(seed: int, offset: int, v: int) -> int:
    s = seed & ((1 << 64) - 1)
    s_lo, s_hi, o = s & M, s >> 32, offset & M
    k1 = _fmix_py(_fmix_py(_fmix_py(s_lo ^ R.KEY_C1) ^ s_hi) ^ o)
    k2 = _fmix_py(_fmix_py(_fmix_py(o ^ R.KEY_C2) ^ s_lo) ^ s_hi)
    return _fmix_py(_fmix_py(v ^ k1) ^ k2)


def test_hash_is_uint32_arithmetic_and_uniform_is_strictly_inside():
    seeds = [0, 1, 1234, 2**62 + 99, 2**63 - 1, -1, -(2**40)]
    offsets = [0, 3, 2**31 + 5, 2**33 + 7, 1, 0, 77]
    vs = [0, 1, 2, 999, 151935]
    bits = R.hash_bits(torch.tensor(seeds), torch.tensor(offsets), 151936)
    for b, (s, o) in enumerate(zip(seeds, offsets)):
        for v in vs:
            assert int(bits[b, v]) == _hash_py(s, o, v), (s, o, v)
    u = R.hash_uniform(torch.tensor(seeds), torch.tensor(offsets), 151936)
    assert float(u.min()) >= 2.0**-32 and float(u.max()) <= 1 - 2.0**-24
    w = torch.tensor([2.0**-32, 1e-6, 0.015, 0.0157, 0.3, 1 - 2.0**-24])
    assert torch.allclose(R.exponential_from_uniform(w).double(), -torch.log1p(-w.double()), rtol=3e-6, atol=0)
    # Every bit of the hash is a fair coin over many (offset, v); uniforms have mean 1/2 and variance 1/12.
    many = R.hash_bits(torch.full((64,), 5), torch.arange(64), 4096).flatten()  # 262144 draws
    ones = torch.stack([(many >> k) & 1 for k in range(32)]).double().mean(dim=1)
    assert (ones - 0.5).abs().max() < 0.005  # 5 sigma is 0.0049
    uu = R.hash_uniform(torch.full((64,), 5), torch.arange(64), 4096).double()
    assert abs(uu.mean().item() - 0.5) < 0.003 and abs(uu.var().item() - 1 / 12) < 0.002


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_reference_draws_follow_softmax_chi_square(temperature):
    """20000 draws of one row over offsets (and 4000 over seeds) against softmax(z): chi-square, 7 dof."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    p = torch.softmax(logits / temperature, -1).double()
    for n, seeds, offsets in (
        (20000, torch.full((20000,), 42), torch.arange(20000)),
        (4000, torch.arange(4000) * 7919 + 1, torch.full((4000,), 9)),
    ):
        toks, _ = R.sample_tokens(
            logits.repeat(n, 1), torch.full((n,), temperature), seeds, offsets, torch.zeros(n, dtype=torch.bool)
        )
        counts = torch.bincount(toks, minlength=8).double()
        chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
        assert chi2 < 24.3, f"chi-square {chi2:.1f} over 7 dof (p < 0.001 above 24.3)"


def test_reference_logprob_is_log_softmax_at_token_and_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    temp = torch.tensor([0.7, 1.0, 0.0, 1.3, 2.0, 0.0])
    greedy = temp == 0
    toks, lps = R.sample_tokens(logits, temp, torch.arange(6) + 10, torch.arange(6), greedy)
    t = torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    want = torch.log_softmax(logits / t, -1).gather(-1, toks[:, None])[:, 0]
    assert torch.allclose(lps, want, atol=1e-5)
    assert toks[greedy].tolist() == logits[greedy].argmax(-1).tolist()


def _inputs(B: int, V: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    temp = torch.rand(B, generator=g) * 1.2 + 0.4
    greedy = torch.zeros(B, dtype=torch.bool)
    greedy[1::4] = True
    temp[greedy] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g)
    offsets = torch.randint(0, 2**34, (B,), generator=g)
    if V > 10:  # suppressed (min_tokens) entries
        logits[0, :7] = float("-inf")
    return [t.to(device) for t in (logits, temp, seeds, offsets, greedy)]


def _assert_same_draws(tokens, logprobs, ref_tokens, ref_logprobs, logits, temp, seeds, offsets, greedy, atol):
    """Equal tokens except where the reference's best two scores are within fp noise; log-probs allclose."""
    diff = (tokens != ref_tokens).nonzero().flatten().tolist()
    if diff:
        z = logits.float() * R.inverse_temperature(temp, greedy)[:, None]
        score = torch.where(greedy[:, None], z, z + R.gumbel_noise(seeds, offsets, z.shape[1]))
        for b in diff:
            best = score[b, ref_tokens[b]]
            gap = (best - score[b, tokens[b]]).abs().item()
            assert gap <= 1e-5 * max(1.0, best.abs().item()), f"row {b}: tokens differ, score gap {gap:.2e}"
    assert len(diff) <= max(1, tokens.numel() // 200), f"{len(diff)} of {tokens.numel()} tokens differ"
    assert torch.allclose(logprobs, ref_logprobs, atol=atol, rtol=1e-5), (logprobs - ref_logprobs).abs().max()


@pytest.mark.parametrize("B,V,block", [(3, 1000, 256), (5, 37, None), (2, 5000, None), (4, 700, 128)])
def test_triton_matches_reference(triton_kernels, B, V, block):
    fn = triton_kernels.load("sampling", "sample_tokens")
    args = _inputs(B, V, triton_kernels.device, seed=B * V)
    tokens, logprobs = fn(*args, block_v=block)
    ref_tokens, ref_logprobs = R.sample_tokens(*args)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and tokens.shape == (B,)
    _assert_same_draws(tokens, logprobs, ref_tokens, ref_logprobs, *args, atol=1e-5)
    if triton_kernels.interpreted:  # numpy and torch agree here: every token equal, not just up to ties
        assert torch.equal(tokens, ref_tokens)
    assert bool(torch.isfinite(ref_logprobs).all()) and int(tokens[0]) >= 7  # suppressed ids never drawn


@pytest.mark.parametrize("B,V,block,splits", [(3, 1000, 128, 3), (2, 5000, 256, 8), (1, 700, 128, 6), (4, 37, 16, 2)])
def test_triton_split_rows_match_reference(triton_kernels, B, V, block, splits):
    """A row scanned by several programs and combined gives the one-program draw (same noise, same winner)."""
    fn = triton_kernels.load("sampling", "sample_tokens")
    args = _inputs(B, V, triton_kernels.device, seed=7 * B + V)
    tokens, logprobs = fn(*args, block_v=block, splits=splits)
    one_tokens, one_logprobs = fn(*args, block_v=block, splits=1)
    ref_tokens, ref_logprobs = R.sample_tokens(*args)
    _assert_same_draws(tokens, logprobs, ref_tokens, ref_logprobs, *args, atol=1e-5)
    assert torch.equal(tokens, one_tokens)
    assert torch.allclose(logprobs, one_logprobs, atol=1e-5, rtol=1e-5)


def test_triton_reads_bf16_logits_as_their_fp32_upcast(triton_kernels):
    fn = triton_kernels.load("sampling", "sample_tokens")
    logits, *rest = _inputs(5, 3000, triton_kernels.device, seed=5)
    half = logits.to(torch.bfloat16)
    for splits in (1, 4):
        tokens, logprobs = fn(half, *rest, splits=splits)
        up_tokens, up_logprobs = fn(half.float(), *rest, splits=splits)
        assert torch.equal(tokens, up_tokens) and torch.equal(logprobs, up_logprobs)


def test_num_splits_spreads_small_batches_only(triton_kernels):
    num_splits = triton_kernels.load("sampling", "num_splits")

    assert num_splits(1, 38, 132) == 38  # batch 1: one 4096-column block per program
    assert num_splits(64, 38, 132) == 17
    assert num_splits(512, 38, 132) == 3
    assert num_splits(4096, 38, 132) == 1
    assert num_splits(1, 1, 132) == 1


def test_triton_ties_go_to_the_lowest_index_across_blocks(triton_kernels):
    fn = triton_kernels.load("sampling", "sample_tokens")
    dev = triton_kernels.device
    logits = torch.zeros(3, 600)
    logits[1, 450] = logits[1, 130] = 5.0  # two equal maxima in different blocks
    logits[2, :] = float("-inf")
    logits[2, 599] = logits[2, 300] = 1.0
    args = [logits, torch.zeros(3), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    args = [t.to(dev) for t in args] + [torch.ones(3, dtype=torch.bool, device=dev)]
    tokens, logprobs = fn(*args, block_v=128)
    assert tokens.tolist() == [0, 130, 300] == R.sample_tokens(*args)[0].tolist()
    assert fn(*args, block_v=128, splits=5)[0].tolist() == [0, 130, 300]  # ties across splits too
    assert math.isclose(logprobs[0].item(), -math.log(600), rel_tol=1e-5)
    assert math.isclose(logprobs[2].item(), -math.log(2), rel_tol=1e-5)


def test_public_op_dispatches_and_is_batch_independent(triton_kernels):
    import polyrl.kernels as K

    logits, temp, seeds, offsets, greedy = _inputs(6, 257, triton_kernels.device, seed=3)
    tokens, lps = K.sample_tokens(logits, temp, seeds, offsets, greedy)
    perm = torch.tensor([5, 2, 0, 4, 1, 3], device=logits.device)
    t2, l2 = K.sample_tokens(logits[perm], temp[perm], seeds[perm], offsets[perm], greedy[perm])
    assert torch.equal(t2, tokens[perm]) and torch.equal(l2, lps[perm])
    one, _ = K.sample_tokens(logits[3:4], temp[3:4], seeds[3:4], offsets[3:4], greedy[3:4])
    assert int(one) == int(tokens[3])


@pytest.mark.gpu
def test_gpu_matches_reference_at_rollout_shape(triton_kernels):
    """B=512 x V=151936 (Qwen vocab) on the device: Triton against the reference computed there."""
    fn = triton_kernels.load("sampling", "sample_tokens")
    args = _inputs(512, 151936, triton_kernels.device, seed=11)
    tokens, logprobs = fn(*args)
    ref_tokens, ref_logprobs = R.sample_tokens(*args)
    _assert_same_draws(tokens, logprobs, ref_tokens, ref_logprobs, *args, atol=1e-4)
    again, _ = fn(*args)
    assert torch.equal(again, tokens)  # deterministic


@pytest.mark.gpu
def test_gpu_batch_one_split_row_from_bf16_logits(triton_kernels):
    """B=1 x V=151936 bf16 (a batch-1 decode graph's logits), split over programs: the reference's draws."""
    fn = triton_kernels.load("sampling", "sample_tokens")
    logits, *rest = _inputs(4, 151936, triton_kernels.device, seed=12)
    half = logits.to(torch.bfloat16)
    for b in range(4):
        one = [half[b : b + 1]] + [t[b : b + 1] for t in rest]
        tokens, logprobs = fn(*one)
        ref_tokens, ref_logprobs = R.sample_tokens(*one)
        _assert_same_draws(tokens, logprobs, ref_tokens, ref_logprobs, *one, atol=1e-4)
