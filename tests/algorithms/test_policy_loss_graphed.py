"""The graph-safe GRPO/GSPO policy loss (``grpo.PolicyLoss``, the default) against the eager path it replaced
(``graphed=False``: ``nonzero`` per micro-batch, a Python-float metric scale): the same loss, gradients and metrics
on the CPU in fp32, one loss object reused across steps (``set_step``), and the batch plumbing a CUDA-graphed step
needs (packed ``targets``, the per-token fields in the graph signature, the engine's one graphed shape per step)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from polyrl.algorithms.advantages import group_advantages
from polyrl.algorithms.grpo import GroupRelative, GRPOConfig, make_policy_loss
from polyrl.algorithms.gspo import GSPOConfig
from polyrl.algorithms.rl_batch import Sample, pack_samples, padding_batch, target_positions
from polyrl.models.decoder import build_model
from polyrl.models.presets import preset_config
from polyrl.train.graphed_step import batch_signature, shape_key


def _model(seed: int = 0):
    return build_model(preset_config("tiny"), dtype=torch.float32, seed=seed)


def _samples(vocab: int, n: int = 6, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(3, 7), rng.randint(2, 9)
        lp = [-rng.uniform(0.1, 3.0) for _ in range(c)]
        ids = [rng.randrange(vocab) for _ in range(p + c)]
        out.append(Sample(ids[:p], ids[p:], lp, "length", "", group=i // 3, index=i % 3))
    return out


def _fields(samples: list[Sample], seed: int = 1) -> dict:
    rng = random.Random(seed)
    adv = group_advantages([rng.random() for _ in samples], [s.group for s in samples])
    rollout = [s.logprobs for s in samples]
    old = [[x + rng.uniform(-0.3, 0.3) for x in s.logprobs] for s in samples]  # ratios away from 1: clipping acts
    ref = [[x - rng.uniform(0.0, 0.5) for x in s.logprobs] for s in samples]
    isw = [[rng.uniform(0.5, 2.0) for _ in s.logprobs] for s in samples]
    return {"adv": adv, "old_logp": old, "rollout_logp": rollout, "ref_logp": ref, "is_w": isw}


def _grads_and_metrics(model, loss_fn, batches):
    model.zero_grad(set_to_none=True)
    total, sums = 0.0, {}
    for b in batches:
        loss, metrics = loss_fn(model, b)
        loss.backward()
        total += float(loss.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads, sums


@pytest.mark.parametrize(
    "cfg",
    [
        GRPOConfig(max_new_tokens=9),
        GRPOConfig(max_new_tokens=9, loss_agg="seq-mean-token-mean", kl_coef=0.1, clip_high=0.28),
        GSPOConfig(max_new_tokens=9, loss_agg="constant"),
    ],
    ids=["grpo", "grpo-seqmean-kl", "gspo-constant"],
)
def test_graph_safe_loss_equals_the_eager_path_in_fp32(cfg):
    model = _model()
    samples = _samples(model.config.vocab_size)
    batches = pack_samples(samples, _fields(samples), max_tokens=32)
    assert len(batches) > 1
    tokens = float(sum(b.num_target_tokens for b in batches))
    old = make_policy_loss(cfg, tokens, tokens * 0.5, measure=True)  # the default: the eager path
    new = make_policy_loss(cfg, tokens, tokens * 0.5, measure=True, graphed=True)
    assert new.graph_safe and not old.graph_safe
    l0, g0, m0 = _grads_and_metrics(model, old, batches)
    l1, g1, m1 = _grads_and_metrics(model, new, batches)
    assert l1 == l0 and m1 == m0  # the same kernels on the same rows: bit for bit
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    assert float(new.mismatch_max) == float(old.mismatch_max) > 0
    assert m0["clip_fraction"] > 0  # the configs exercise the clipped branch


def test_one_loss_object_serves_every_step():
    """``GroupRelative.make_loss`` keeps one loss per ``measure`` and refills it: the next step's scale and a
    mismatch max counted from zero again, equal to a fresh loss's."""
    model = _model()
    samples = _samples(model.config.vocab_size, seed=3)
    batches = pack_samples(samples, _fields(samples), max_tokens=32)
    hooks = GroupRelative(GRPOConfig(max_new_tokens=9))
    first = hooks.make_loss(100.0, 50.0, measure=True)
    _grads_and_metrics(model, first, batches)
    assert hooks.make_loss(100.0, 50.0) is not first  # measure=False: its own object
    tokens = float(sum(b.num_target_tokens for b in batches))
    again = hooks.make_loss(tokens, tokens, measure=True)
    assert again is first and again.graph_safe and again.scale == 1.0 and float(again.mismatch_max) == 0.0
    _, _, m_again = _grads_and_metrics(model, again, batches[:1])
    fresh = make_policy_loss(hooks.cfg, tokens, tokens, measure=True, graphed=False)
    _, _, m_fresh = _grads_and_metrics(model, fresh, batches[:1])
    assert m_again == m_fresh and float(again.mismatch_max) == float(fresh.mismatch_max)


def test_packed_targets_are_the_mask_positions_and_travel_with_the_batch():
    samples = _samples(50, seed=5)
    samples[1].mask = [1, 0] + [1] * (len(samples[1].completion_ids) - 2)  # an agentic episode: a tool token
    samples[1].logprobs = samples[1].logprobs[: sum(samples[1].mask)]
    for b in pack_samples(samples, {"adv": [1.0] * len(samples)}, max_tokens=40):
        want = torch.nonzero(b.mask > 0).squeeze(-1)
        assert torch.equal(b.targets, want) and torch.equal(
            target_positions(dataclasses.replace(b, targets=None)), want
        )
        moved = b.to("cpu")
        assert torch.equal(moved.targets, want) and moved.fields.keys() == b.fields.keys()
        pad = padding_batch(b)
        assert pad.targets.numel() == 0 and float(pad.mask.sum()) == 0


def test_signature_covers_the_per_token_fields_and_ignores_the_device():
    samples = _samples(50, n=4, seed=7)
    same = [dataclasses.replace(s, completion_ids=list(reversed(s.completion_ids))) for s in samples]
    a = pack_samples(samples, {"adv": [1.0] * 4}, max_tokens=1000)[0]
    b = pack_samples(same, {"adv": [2.0] * 4}, max_tokens=1000)[0]
    assert batch_signature(a) == batch_signature(b)  # other tokens and values, same shapes
    c = pack_samples(samples, {"adv": [1.0] * 4, "is_w": [1.0] * 4}, max_tokens=1000)[0]
    assert batch_signature(c) != batch_signature(a)  # one more field: another capture
    assert ("fields", "adv", (a.input_ids.numel(),), torch.float32, a.mask.device) in batch_signature(a)
    assert shape_key(batch_signature(a)) == shape_key(batch_signature(b))
    assert all(
        not isinstance(x, torch.device)
        for p in shape_key(batch_signature(a))
        for x in (p if isinstance(p, tuple) else ())
    )


def test_engine_graphs_the_steps_dominant_shape_and_keeps_a_held_graph_for_a_tail():
    """``TrainEngine._graph_plan``: 9 equal packs and a short tail graph the packs' shape; with that graph held, a
    step that has its shape keeps it (the tail runs eagerly) rather than re-capturing every step."""
    from polyrl.train import OptimConfig, ScheduleConfig, TrainEngine

    samples = _samples(50, n=12, seed=9)
    for s in samples:
        s.prompt_ids, s.completion_ids, s.logprobs = s.prompt_ids[:3], s.completion_ids[:2], s.logprobs[:2]
    full = pack_samples(samples[:10], {"adv": [1.0] * 10}, max_tokens=10)  # 2 samples of 5 tokens per pack
    tail = pack_samples(samples[:1], {"adv": [1.0]}, max_tokens=10)
    engine = TrainEngine(_model(), OptimConfig(lr=1e-3), ScheduleConfig(decay="constant"))
    key = shape_key(batch_signature(full[0]))
    assert engine._graph_plan([*full, *tail]) == key
    assert engine._graph_plan([*tail, *tail, full[0]]) == shape_key(batch_signature(tail[0]))

    class Held:
        signature = batch_signature(full[0])

    engine._graph = Held()
    assert engine._graph_plan([*tail, *tail, full[0]]) == key  # the held graph's shape is in the step
    assert engine._graph_plan([*tail, *tail]) == shape_key(batch_signature(tail[0]))
    engine._graph = None


@pytest.mark.gpu
def test_graphed_rl_steps_equal_eager_steps_and_capture_once():
    """On the GPU: three GRPO updates over [A, A, A, B] packs (three equal packs and a shorter tail), with the run's
    kept graph-safe loss, capture the packs' shape once and replay it in every step (the tail runs eagerly), with
    the eager path's losses, metrics and parameters."""
    from polyrl.platform import device
    from polyrl.train import OptimConfig, ScheduleConfig, TrainEngine

    dev = device.torch_device()
    if dev.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    cfg = GRPOConfig(max_new_tokens=8)
    rng = random.Random(0)
    samples = []
    for i in range(14):
        ids = [rng.randrange(100) for _ in range(12)]
        samples.append(Sample(ids[:4], ids[4:], [-rng.uniform(0.1, 3.0) for _ in range(8)], "length", "", i // 2))
    fields = _fields(samples)
    fields["old_logp"] = fields["rollout_logp"]
    packs = pack_samples(samples, {k: fields[k] for k in ("adv", "old_logp", "rollout_logp")}, max_tokens=48)
    assert [b.input_ids.numel() for b in packs] == [48, 48, 48, 24]

    def run(graphed: bool):
        model = build_model(preset_config("tiny"), dtype=torch.float32, device=dev, seed=0)
        engine = TrainEngine(model, OptimConfig(lr=1e-3), ScheduleConfig(decay="constant"))
        hooks = GroupRelative(cfg)
        tokens = float(sum(b.num_target_tokens for b in packs))
        out = []
        for _ in range(3):
            loss_fn = (
                hooks.make_loss(tokens, tokens, measure=True)
                if graphed
                else make_policy_loss(cfg, tokens, tokens, measure=True)
            )
            stats = engine.step(packs, loss_fn, tokens)
            out.append((stats.loss, stats.grad_norm, stats.metrics["mismatch_mean"], float(loss_fn.mismatch_max)))
        params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
        return out, params, engine

    eager, p0, e0 = run(False)
    graphed, p1, e1 = run(True)
    assert e0.graph_captures == 0 and e1.graph_captures == 1 and e1.graph_replays == 8
    for a, b in zip(eager, graphed):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    for name, p in p0.items():
        torch.testing.assert_close(p1[name], p, rtol=1e-4, atol=1e-5, msg=name)
