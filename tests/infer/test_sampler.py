"""Sampler: top-k / top-p / min-p masks, greedy, reported log-probs, hash-seeded draws (independent of the
batch, reproducible from (seed, index, tokens generated)), and validation of SamplingParams."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.errors import UserError
from polyrl.infer.sampler import Sampler, apply_top_k_top_p_min_p
from polyrl.infer.sampling_params import SamplingParams, sample_seed
from polyrl.infer.sequence import Sequence
from polyrl.kernels.sampling.reference import gumbel_noise

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
LOGITS = PROBS.log()

_ids = iter(range(10**6))


def seqs(params: SamplingParams, n: int = 1, index: int = 0) -> list[Sequence]:
    return [Sequence(next(_ids), "r", index, [0], params) for _ in range(n)]


def kept(z: torch.Tensor) -> list[int]:
    return torch.isfinite(z).nonzero().flatten().tolist()


def test_masks():
    z = LOGITS[None]
    assert kept(apply_top_k_top_p_min_p(z, torch.tensor([2]), None, None)[0]) == [0, 1]
    # top_p: keep tokens whose preceding mass is <= p: 0.5 -> {0}; 0.6 -> {0, 1}; 0.9 -> {0, 1, 2}.
    for p, want in ((0.5, [0]), (0.6, [0, 1]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3, 4])):
        assert kept(apply_top_k_top_p_min_p(z, None, torch.tensor([p]), None)[0]) == want, p
    # min_p: drop p < min_p * p_max = 0.2 * 0.5 = 0.1.
    assert kept(apply_top_k_top_p_min_p(z, None, None, torch.tensor([0.2]))[0]) == [0, 1, 2]
    # Per-row parameters in one batch; top_k 0 disables; the kept logits are unchanged.
    z2 = LOGITS.repeat(2, 1)
    out = apply_top_k_top_p_min_p(z2, torch.tensor([0, 3]), torch.tensor([0.6, 1.0]), None)
    assert kept(out[0]) == [0, 1] and kept(out[1]) == [0, 1, 2]
    assert torch.equal(out[1, :3], LOGITS[:3])
    # Tiny top_p always keeps the top token.
    assert kept(apply_top_k_top_p_min_p(z, None, torch.tensor([1e-6]), None)[0]) == [0]


def test_sampled_frequencies_follow_the_truncated_distribution():
    torch.manual_seed(0)
    n = 6000
    params = SamplingParams(temperature=1.0, top_k=3)
    out = Sampler()(LOGITS.repeat(n, 1), seqs(params, n))
    counts = torch.bincount(torch.tensor(out.tokens), minlength=5).float() / n
    want = torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9
    assert (counts - want).abs().max() < 0.025
    # The reported log-prob is under the full (untruncated) distribution at temperature 1.
    assert all(abs(lp - math.log(PROBS[t])) < 1e-5 for t, lp in zip(out.tokens, out.logprobs))


def test_temperature_and_greedy_logprobs():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    greedy = Sampler()(logits, seqs(SamplingParams(temperature=0)) * 3)
    assert greedy.tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(greedy.logprobs), ref, atol=1e-6)
    hot = Sampler()(
        logits, seqs(SamplingParams(temperature=0.5, seed=3)) + seqs(SamplingParams(temperature=0.5, seed=4)) * 2
    )
    want = torch.log_softmax(logits / 0.5, -1).gather(-1, torch.tensor(hot.tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(hot.logprobs), want, atol=1e-6)


def _stream(mine: Sequence, logits: torch.Tensor, others: list[Sequence], steps: int, first: bool) -> list[int]:
    """Generate ``steps`` tokens for ``mine`` batched with ``others`` (appending every row's token)."""
    for _ in range(steps):
        batch = [mine] + others if first else others + [mine]
        out = Sampler()(logits.repeat(len(batch), 1), batch)
        for s, t in zip(batch, out.tokens):
            s.tokens.append(t)
    return mine.output_token_ids


def test_seeded_rows_do_not_depend_on_batch_composition_or_order():
    v = 50
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = _stream(seqs(params)[0], logits, [], 20, True)
    mixed = [*seqs(SamplingParams(temperature=1.0), 3), *seqs(SamplingParams(temperature=0.7, top_k=5, seed=5), 2)]
    assert _stream(seqs(params)[0], logits, mixed, 20, False) == alone
    assert _stream(seqs(params)[0], logits, seqs(SamplingParams(temperature=0), 8), 20, True) == alone
    assert len(set(alone)) > 3  # it really samples
    assert _stream(seqs(SamplingParams(seed=99))[0], logits, [], 20, True) != alone
    # Sample i of n gets its own stream: sample 1 differs from sample 0 with the same seed.
    assert _stream(seqs(params, index=1)[0], logits, [], 20, True) != alone


def test_same_seed_and_offset_give_the_same_token_and_match_the_hash():
    v = 40
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.8, seed=7)
    a = seqs(params, index=2)[0]
    stream = _stream(a, logits, [], 12, True)
    # A recomputed / resumed sequence with the same generated prefix draws the same next tokens.
    b = seqs(params, index=2)[0]
    b.tokens += stream[:5]
    assert _stream(b, logits, [], 7, True) == stream
    # The token is the Gumbel-max of z with the hash noise at (sample_seed(seed, index), tokens generated).
    z = logits * (1.0 / torch.tensor(0.8))
    for off in (0, 5, 11):
        g = gumbel_noise(torch.tensor([sample_seed(7, 2)]), torch.tensor([off]), v)
        assert stream[off] == int((z + g).argmax()), off


def test_truncated_rows_use_the_same_hash_noise():
    v = 30
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.3, top_p=0.8, top_k=10, seed=11)
    alone = _stream(seqs(params)[0], logits, [], 15, True)
    mixed = _stream(seqs(params)[0], logits, seqs(SamplingParams(temperature=1.0, seed=3), 4), 15, False)
    assert mixed == alone
    z = logits / 1.3
    zt = apply_top_k_top_p_min_p(z, torch.tensor([10]), torch.tensor([0.8]), None)
    for off, tok in enumerate(alone):
        g = gumbel_noise(torch.tensor([sample_seed(11, 0)]), torch.tensor([off]), v)
        assert tok == int((zt + g).argmax())
        assert torch.isfinite(zt[0, tok])  # inside the nucleus


def test_unseeded_rows_vary():
    v = 50
    logits = torch.zeros(1, v)  # uniform: 64 rows of one step all equal would be a (1/50)^63 event
    torch.manual_seed(0)
    first = Sampler()(logits.repeat(64, 1), seqs(SamplingParams(temperature=1.0), 64)).tokens
    assert len(set(first)) > 20
    again = Sampler()(logits.repeat(64, 1), seqs(SamplingParams(temperature=1.0), 64)).tokens
    assert again != first  # a fresh seed per step, even at the same offsets
    torch.manual_seed(0)
    assert Sampler()(logits.repeat(64, 1), seqs(SamplingParams(temperature=1.0), 64)).tokens == first


def test_suppressed_tokens_and_top_logprobs():
    logits = LOGITS[None].clone()
    out = Sampler()(logits, seqs(SamplingParams(temperature=0, logprobs=2)), suppress=[[0]])
    assert out.tokens == [1]  # token 0 forbidden (min_tokens), next best chosen
    assert abs(out.logprobs[0] - math.log(0.25)) < 1e-5  # reported under the unmasked distribution
    top = out.top_logprobs[0]
    assert list(top) == [0, 1] and abs(top[0] - math.log(0.5)) < 1e-5


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"n": 0},
        {"max_tokens": 0},
        {"min_tokens": 5, "max_tokens": 3},
        {"logprobs": 21},
        {"stop": [""]},
        {"seed": "x"},
        {"stop_token_ids": [-1]},
    ],
)
def test_invalid_params_raise_user_errors(kw):
    with pytest.raises(UserError, match="invalid sampling parameter"):
        SamplingParams(**kw)


def test_params_normalise_stop():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.max_stop_len == 3


def test_mixed_batch_reports_unmasked_logprobs():
    v = 20
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(4)) * 2
    batch = [
        *seqs(SamplingParams(temperature=0, logprobs=3)),
        *seqs(SamplingParams(temperature=0.6, top_k=4, seed=1)),
        *seqs(SamplingParams(temperature=1.5, min_p=0.1, logprobs=0)),
        *seqs(SamplingParams(temperature=0.9, seed=2)),
    ]
    banned = logits.argmax(-1).tolist()  # forbid each row's top token in rows 0 and 1
    out = Sampler()(logits, batch, suppress=[[banned[0]], [banned[1]], None, None])
    assert out.tokens[0] == int(logits[0].masked_fill(torch.arange(v) == banned[0], -1e9).argmax())
    assert out.tokens[1] != banned[1] and out.tokens[1] in logits[1].topk(4).indices.tolist()
    temps = torch.tensor([1.0, 0.6, 1.5, 0.9])[:, None]
    want = torch.log_softmax(logits / temps, -1).gather(-1, torch.tensor(out.tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-5)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] == {} and out.top_logprobs[3] is None
    top0 = torch.log_softmax(logits[0], -1).topk(3)
    assert list(out.top_logprobs[0]) == top0.indices.tolist()
    assert torch.allclose(torch.tensor(list(out.top_logprobs[0].values())), top0.values, atol=1e-6)
