"""Sampler: top-k / top-p / min-p masks, greedy, reported log-probs, seeds independent of the batch,
and validation of SamplingParams."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.errors import UserError
from polyrl.infer.sampler import Sampler, apply_top_k_top_p_min_p
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.sequence import Sequence

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


def test_seeded_rows_do_not_depend_on_batch_composition():
    v = 50
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(extra_rows: int, steps: int = 20) -> list[int]:
        mine = seqs(params)[0]
        others = seqs(SamplingParams(temperature=1.0), extra_rows)
        got = []
        for _ in range(steps):
            batch = others + [mine] if extra_rows % 2 else [mine] + others
            rows = logits.repeat(len(batch), 1)
            out = Sampler()(rows, batch)
            got.append(out.tokens[batch.index(mine)])
        return got

    alone = draw(0)
    assert draw(3) == alone and draw(8) == alone
    assert len(set(alone)) > 3  # it really samples
    other_seed = Sampler()(logits.repeat(20, 1), [seqs(SamplingParams(seed=99))[0] for _ in range(20)]).tokens
    assert other_seed != alone
    # Sample i of n gets its own stream: sample 1 differs from sample 0 with the same seed.
    s1 = seqs(params, index=1)[0]
    assert [Sampler()(logits, [s1]).tokens[0] for _ in range(20)] != alone


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
