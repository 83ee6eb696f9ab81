"""Policy-loss math (polyrl.algorithms.losses) and group advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.algorithms import losses as L
from polyrl.algorithms.advantages import group_advantages, informative_groups


def _logp_pair(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.log(torch.tensor([0.3, 0.2, 0.6, 0.1, 0.4, 0.5][: len(ratios)], dtype=torch.float64))
    logp = (old + torch.log(torch.tensor(ratios, dtype=torch.float64))).requires_grad_(True)
    return logp, old


def test_clipped_token_loss_each_region_value_and_gradient():
    # ratio inside / above 1+hi with A>0 / below 1-lo with A<0 / inside with A<0 / above with A<0 / below with A>0
    logp, old = _logp_pair([1.0, 1.5, 0.5, 1.1, 1.5, 0.5])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -2.0, 2.0], dtype=torch.float64)
    loss, clipped, ratio = L.clipped_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert ratio.detach().tolist() == pytest.approx([1.0, 1.5, 0.5, 1.1, 1.5, 0.5])
    # max(-A r, -A clip(r, 0.8, 1.28))
    assert loss.tolist() == pytest.approx([-1.0, -1.28, 0.8, 1.1, 3.0, -1.0])
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    loss.sum().backward()
    # d/dlogp of -A r = -A r where unclipped; 0 where clipped
    assert logp.grad.tolist() == pytest.approx([-1.0, 0.0, 0.0, 1.1, 3.0, -1.0])


def test_ratio_one_equals_reinforce_value_and_gradient_every_aggregation():
    torch.manual_seed(0)
    T, num_seqs = 9, 3
    seq_index = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.float64)
    adv_seq = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    adv = adv_seq[seq_index]
    base = torch.randn(T, dtype=torch.float64)
    for mode in L.AGGREGATIONS:
        logp = base.clone().requires_grad_(True)
        per_tok, info = L.policy_loss(logp, logp.detach(), adv, mask, seq_index, num_seqs, clip_low=0.2, clip_high=0.2)
        s, norm = L.aggregate(per_tok, mask, seq_index, num_seqs, mode, max_new_tokens=5)
        (s / norm).backward()
        logp2 = base.clone().requires_grad_(True)
        reinforce = -(adv * logp2)
        s2, norm2 = L.aggregate(reinforce, mask, seq_index, num_seqs, mode, max_new_tokens=5)
        (s2 / norm2).backward()
        assert norm == norm2
        # values: ratio 1 -> per-token loss -A (REINFORCE's surrogate has value -A logp, gradient -A grad logp)
        expected_value = L.aggregate(-adv, mask, seq_index, num_seqs, mode, max_new_tokens=5)
        assert float((s / norm).detach()) == pytest.approx(float(expected_value[0] / expected_value[1]))
        assert torch.allclose(logp.grad, logp2.grad)
        assert float(info["clipped"].sum()) == 0.0


def test_aggregation_modes_with_padding_hand_values():
    # padded [2, 4] batch flattened; padding holds garbage that must not leak
    per = torch.tensor([[1.0, 2.0, 3.0, float("inf")], [4.0, 6.0, float("nan"), 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    seq_index = torch.arange(2).repeat_interleave(4)
    flat, m = per.reshape(-1), mask.reshape(-1)
    s, n = L.aggregate(flat, m, seq_index, 2, "token-mean")
    assert (float(s), n) == (16.0, 5.0)
    s, n = L.aggregate(flat, m, seq_index, 2, "seq-mean-token-mean")
    assert float(s) == pytest.approx(2.0 + 5.0) and n == 2.0
    s, n = L.aggregate(flat, m, seq_index, 2, "constant", max_new_tokens=4)
    assert (float(s), n) == (16.0, 8.0)
    w = L.token_weights(m, seq_index, 2, "seq-mean-token-mean")
    assert w.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0, 0.5, 0.5, 0, 0])
    with pytest.raises(ValueError, match="max_new_tokens"):
        L.aggregate(flat, m, seq_index, 2, "constant")
    with pytest.raises(ValueError, match="aggregation"):
        L.aggregate(flat, m, seq_index, 2, "sum")


def test_gspo_sequence_ratio_clip_and_token_gradients():
    # seq 0: log-ratio [0.1, 0.3] -> mean 0.2 -> s = e^0.2, far above 1 + 4e-4 with A > 0: clipped, no gradient.
    # seq 1: log-ratio [1e-4, -1e-4] -> s = 1 (inside the range): loss -A per token, grad -A * s per token.
    # seq 2 (A < 0): log-ratio [-0.01] -> s = e^-0.01 < 1 - 3e-4: clipped at (1 - 3e-4), no gradient.
    old = torch.log(torch.tensor([0.2, 0.3, 0.4, 0.5, 0.6], dtype=torch.float64))
    delta = torch.tensor([0.1, 0.3, 1e-4, -1e-4, -0.01], dtype=torch.float64)
    logp = (old + delta).requires_grad_(True)
    seq_index = torch.tensor([0, 0, 1, 1, 2])
    mask = torch.ones(5, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 2.0, 2.0, -1.0], dtype=torch.float64)
    log_s = L.sequence_log_ratio(logp, old, mask, seq_index, 3)
    assert log_s.tolist() == pytest.approx([0.2, 0.0, -0.01], abs=1e-12)
    loss, clipped, ratio = L.gspo_token_loss(logp, old, adv, mask, seq_index, 3, 3e-4, 4e-4)
    assert ratio.tolist() == pytest.approx([math.exp(0.2)] * 2 + [1.0, 1.0] + [math.exp(-0.01)])
    assert loss.tolist() == pytest.approx([-(1 + 4e-4)] * 2 + [-2.0, -2.0] + [1 - 3e-4])
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    s, n = L.aggregate(loss, mask, seq_index, 3, "seq-mean-token-mean")
    (s / n).backward()
    # GSPO gradient of seq 1: -(A * s / |y|) d logp_t, over 3 sequences
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -2.0 / 2 / 3, -2.0 / 2 / 3, 0.0])


def test_kl_estimators_and_tis_weights():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.25]))
    assert L.kl_penalty(logp, ref, "k1").tolist() == pytest.approx([math.log(2), 0.0])
    assert L.kl_penalty(logp, ref, "k3").tolist() == pytest.approx([0.5 - math.log(0.5) - 1, 0.0], abs=1e-7)
    assert L.kl_penalty(logp, ref, "k3").min() >= 0
    with pytest.raises(ValueError):
        L.kl_penalty(logp, ref, "k2x")
    w = L.tis_weights(torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.25, 0.4])), cap=1.5)
    assert w.tolist() == pytest.approx([1.5, 0.5])


def test_policy_loss_adds_kl_and_is_weights():
    logp = torch.log(torch.tensor([0.5, 0.25], dtype=torch.float64))
    old = logp.clone()
    ref = torch.log(torch.tensor([0.25, 0.25], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask, idx = torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    w = torch.tensor([0.5, 2.0], dtype=torch.float64)
    loss, info = L.policy_loss(logp, old, adv, mask, idx, 1, ref_logp=ref, kl_coef=0.1, kl_estimator="k1", is_weights=w)
    assert loss.tolist() == pytest.approx([-1.0 * 0.5 + 0.1 * math.log(2), 1.0 * 2.0 + 0.0])
    assert info["kl"].tolist() == pytest.approx([math.log(2), 0.0])


def test_group_advantages_std_and_dr_grpo_and_filter():
    rewards = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 3.0]
    groups = [0, 0, 0, 0, 1, 1, 2]
    a = group_advantages(rewards, groups, "std", eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert a == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0, 0.0])
    assert group_advantages(rewards, groups, "none") == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    assert informative_groups(rewards, groups) == {0}


def test_aggregate_sum_is_aggregates_loss_without_a_host_sync():
    """The graph-safe PolicyLoss sums with ``aggregate_sum``: bit-equal to ``aggregate``'s sum (same ops) for every
    mode, padding and empty sequences included; an unknown mode is refused the same way."""
    from polyrl.algorithms.losses import AGGREGATIONS, aggregate, aggregate_sum

    g = torch.Generator().manual_seed(0)
    per_tok = torch.randn(11, generator=g, requires_grad=True)
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3])  # sequence 2 has no masked token
    for mode in AGGREGATIONS:
        want, _ = aggregate(per_tok, mask, seq, 4, mode, max_new_tokens=8)
        got = aggregate_sum(per_tok, mask, seq, 4, mode)
        assert torch.equal(got, want), mode
        (ga,) = torch.autograd.grad(got, per_tok)
        (gw,) = torch.autograd.grad(want, per_tok)
        assert torch.equal(ga, gw) and ga[2] == 0 and ga[5] == 0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_sum(per_tok, mask, seq, 4, "mean-of-means")
