"""GAE, token-level rewards and whitening against straightforward Python loops: masks (right padding and holes),
varying lengths, gamma / lambda at 0 and 1."""

from __future__ import annotations

import random

import pytest
import torch

from polyrl.algorithms.gae import gae, pad_rows, token_rewards, unpad_rows, whiten


def _loop_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """The textbook recursion over one episode's valid steps (the value after the last step is 0)."""
    n = len(rewards)
    adv = [0.0] * n
    last = 0.0
    for t in reversed(range(n)):
        next_v = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.0, 0.7), (0.99, 0.0), (0.0, 0.0)])
def test_gae_matches_loop_with_holes_and_varying_lengths(gamma, lam):
    rng = random.Random(f"{gamma}-{lam}")
    B, L = 5, 9
    mask = torch.zeros(B, L)
    for b, n in enumerate([9, 4, 1, 0, 7]):
        mask[b, :n] = 1.0
    mask[4, 2] = mask[4, 5] = 0.0  # holes (e.g. tool-output tokens inside a completion)
    rewards = torch.tensor([[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)])
    values = torch.tensor([[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)])
    rewards[mask == 0] = float("nan")  # garbage at masked positions must not leak
    values[mask == 0] = 123.0
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        idx = [t for t in range(L) if mask[b, t] > 0]
        want_a, want_r = _loop_gae([rewards[b, t].item() for t in idx], [values[b, t].item() for t in idx], gamma, lam)
        assert adv[b, idx].tolist() == pytest.approx(want_a, abs=1e-5)
        assert ret[b, idx].tolist() == pytest.approx(want_r, abs=1e-5)
        off = [t for t in range(L) if mask[b, t] == 0]
        assert adv[b, off].abs().sum() == 0 and ret[b, off].abs().sum() == 0


def test_gae_edge_cases_in_closed_form():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.4]])
    m = torch.ones(1, 3)
    # gamma = lambda = 1: A_t = (sum of rewards from t) - V_t (Monte Carlo); returns = reward-to-go
    adv, ret = gae(r, v, m, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.8, 0.6]) and ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    # lambda = 0: one-step TD error r_t + gamma V_{t+1} - V_t
    adv, _ = gae(r, v, m, 0.5, 0.0)
    assert adv[0].tolist() == pytest.approx([0.5 * 0.2 - 0.5, 0.5 * 0.4 - 0.2, 1.0 - 0.4])
    # gamma = 0: A_t = r_t - V_t whatever lambda
    adv, _ = gae(r, v, m, 0.0, 1.0)
    assert adv[0].tolist() == pytest.approx([-0.5, -0.2, 0.6])


def test_token_rewards_put_the_score_on_the_last_token_and_kl_everywhere():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0.0]])
    scores = torch.tensor([2.0, -1.0, 5.0])
    r = token_rewards(scores, mask)
    assert r.tolist() == [[0, 0, 2.0, 0], [0, 0, -1.0, 0], [0, 0, 0, 0]]
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 9.0, -0.5, 9.0], [1.0, 1.0, 1.0, 1.0]])
    r = token_rewards(scores, mask, kl, kl_coef=0.5)
    want = [[-0.05, -0.1, 1.85, 0], [-0.25, 0, -0.75, 0], [0, 0, 0, 0]]
    assert all(row == pytest.approx(w) for row, w in zip(r.tolist(), want))


def test_whiten_matches_masked_statistics():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0.0]])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mean, std = vals.mean().item(), vals.std().item()  # unbiased
    w = whiten(x, m)
    assert w[m > 0].tolist() == pytest.approx([(v - mean) / std for v in vals.tolist()], rel=1e-5)
    assert w[m == 0].abs().sum() == 0
    kept = whiten(x, m, shift_mean=False)
    assert kept[m > 0].mean().item() == pytest.approx(mean, rel=1e-5)
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        whiten(x, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0.0]]))


def test_pad_and_unpad_round_trip():
    rows = [torch.tensor([1.0, 2.0]), torch.tensor([]), torch.tensor([3.0, 4.0, 5.0])]
    x, m = pad_rows(rows)
    assert x.shape == (3, 3) and m.sum().item() == 5
    assert [r.tolist() for r in unpad_rows(x, m)] == [[1.0, 2.0], [], [3.0, 4.0, 5.0]]
