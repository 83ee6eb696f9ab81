"""TrainEngine.step: global normalisation (gradient accumulation), clipping, NaN guard, switches, stats."""

from __future__ import annotations

import pytest
import torch
from train_helpers import pack, random_seqs, tiny_lm

from polyrl.errors import ConfigError, DataError
from polyrl.platform import device
from polyrl.train import (
    NonFiniteLossError,
    OptimConfig,
    PrecisionConfig,
    ScheduleConfig,
    StepConfig,
    TrainEngine,
    causal_lm_loss,
)

# eps = 1 makes AdamW's first update ~ lr * g (|g| << 1), so parameter deltas expose gradient errors
# that Adam's sign-like first step would hide.
SGD_LIKE = OptimConfig(lr=0.5, eps=1.0, grad_clip=None)


def _engine(model, optim: OptimConfig = SGD_LIKE, **engine_kw) -> TrainEngine:
    return TrainEngine(model, optim, ScheduleConfig(decay="constant"), PrecisionConfig("fp32"), StepConfig(**engine_kw))


def _varlen_seqs(total: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs, used = [], 0
    while used < total:
        n = min(int(torch.randint(8, 120, (1,), generator=g)), total - used)
        n = max(n, 2)
        seqs.append(torch.randint(0, 64, (n,), generator=g))
        used += n
    return seqs


def _split_by_budget(seqs: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    groups, cur, used = [], [], 0
    for s in seqs:
        if cur and used + len(s) > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += len(s)
    return groups + [cur]


def test_gradient_accumulation_1x4k_equals_4x1k():
    seqs = _varlen_seqs(4096, seed=3)
    one = [pack(seqs)]
    four = [pack(g) for g in _split_by_budget(seqs, 1024)]
    assert len(four) >= 4 and len({b.num_target_tokens for b in four}) > 1  # unequal targets per micro-batch
    assert sum(b.input_ids.numel() for b in four) == one[0].input_ids.numel() == 4096

    a, b = tiny_lm(seed=0), tiny_lm(seed=0)
    sa = _engine(a).step(one)
    sb = _engine(b).step(four)
    assert sa.normalizer == sb.normalizer == one[0].num_target_tokens
    assert sb.loss == pytest.approx(sa.loss, rel=1e-6)
    assert sb.grad_norm == pytest.approx(sa.grad_norm, rel=1e-6)
    delta = max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))
    assert delta < 1e-6

    # Negative control: normalising each micro-batch by its own target count (mean of means) is different.
    c = tiny_lm(seed=0)
    per_mb = lambda m, batch: (causal_lm_loss(m, batch)[0] / batch.num_target_tokens, {})
    sc = _engine(c).step(four, per_mb, normalizer=len(four))
    assert abs(sc.grad_norm - sa.grad_norm) / sa.grad_norm > 1e-4


def test_clipping_reports_preclip_norm_and_bounds_update():
    model = tiny_lm(seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    clip = 1e-4
    stats = _engine(model, OptimConfig(lr=0.5, eps=1.0, grad_clip=clip)).step([pack(random_seqs(4, 32, 64, 0))])
    assert stats.grad_norm > 100 * clip  # reported before clipping
    step_norm = torch.linalg.vector_norm(torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), before)]))
    # first AdamW step with eps=1: delta = lr * g / (|g| + 1), |g| <= clip, so ||delta|| ~= lr * clip
    assert step_norm.item() == pytest.approx(0.5 * clip, rel=1e-3)


def test_nan_guard_skips_counts_and_stops():
    model = tiny_lm(seed=2)
    engine = _engine(model, OptimConfig(lr=1e-3), nan_guard_max_consecutive=3)
    batch = [pack(random_seqs(2, 16, 64, 0))]
    nan_loss = lambda m, b: (causal_lm_loss(m, b)[0] * float("nan"), {})

    assert not engine.step(batch).skipped
    snapshot = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        s = engine.step(batch, nan_loss)
    assert s.skipped and s.skipped_total == 1 and s.step == 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), snapshot))  # no update
    assert not engine.step(batch).skipped and engine.consecutive_skips == 0  # a good step resets the run
    with pytest.warns(RuntimeWarning):
        engine.step(batch, nan_loss)
        engine.step(batch, nan_loss)
        with pytest.raises(NonFiniteLossError, match="3 steps in a row.*lower optim.lr"):
            engine.step(batch, nan_loss)
    assert engine.skipped_total == 4


def test_activation_checkpointing_gives_identical_steps():
    batch = [pack(random_seqs(3, 24, 64, 5))]
    plain, ckpt = tiny_lm(seed=4), tiny_lm(seed=4)
    e1 = _engine(plain, OptimConfig(lr=1e-2))
    e2 = _engine(ckpt, OptimConfig(lr=1e-2), activation_checkpointing=True)
    assert ckpt.gradient_checkpointing and not plain.gradient_checkpointing
    for _ in range(2):
        assert e1.step(batch).loss == e2.step(batch).loss
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), ckpt.parameters()))


def test_checkpoint_layers_reaches_the_model_and_keeps_steps_identical():
    batch = [pack(random_seqs(3, 24, 64, 5))]
    plain, part = tiny_lm(seed=4), tiny_lm(seed=4)
    e1 = _engine(plain, OptimConfig(lr=1e-2))
    e2 = _engine(part, OptimConfig(lr=1e-2), activation_checkpointing=True, checkpoint_layers=1)
    assert part.gradient_checkpointing and part.checkpoint_layers == 1 and plain.checkpoint_layers is None
    for _ in range(2):
        assert e1.step(batch).loss == e2.step(batch).loss
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), part.parameters()))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"checkpoint_layers": 4}, "set engine.activation_checkpointing = true"),
        ({"checkpoint_layers": -1, "activation_checkpointing": True}, ">= 0"),
        ({"checkpoint_layers": True, "activation_checkpointing": True}, "whole number of layers"),
        ({"checkpoint_layers": 2.5, "activation_checkpointing": True}, "whole number of layers"),
    ],
)
def test_checkpoint_layers_bad_values_say_what_to_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        StepConfig(**kwargs)


def test_a_compile_failure_at_run_time_falls_back_to_eager_under_checkpointing(monkeypatch):
    """A layer whose compiled call fails at run time (dynamo error): the step warns, drops every compiled frame
    (torch._dynamo.reset: compiled inner frames would otherwise run in the retry but not in the checkpoint's
    recompute) and redoes the step eagerly, giving the eager engine's loss and weights."""
    import torch._dynamo

    from polyrl.train import TrainEngine

    def broken(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("simulated run-time compile failure")

    def fake_compile(self):
        layers = list(self.model.model.layers)
        for layer in layers:
            layer._compiled_call_impl = broken
        return layers

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(TrainEngine, "_compile_layers", fake_compile)
    batch = [pack(random_seqs(3, 24, 64, 5))]
    model, ref = tiny_lm(seed=4), tiny_lm(seed=4)
    e = _engine(model, OptimConfig(lr=1e-2), activation_checkpointing=True, compile=True)
    e_ref = _engine(ref, OptimConfig(lr=1e-2), activation_checkpointing=True)
    with pytest.warns(RuntimeWarning, match="falling back to eager"):
        loss = e.step(batch).loss
    assert loss == e_ref.step(batch).loss
    assert resets and all(layer._compiled_call_impl is None for layer in model.model.layers)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("pause", [True, False])
def test_the_garbage_collector_is_paused_inside_a_step_and_restored_after(pause):
    """engine.pause_gc: automatic cyclic GC is off while forward/backward run (its passes stall the host), back on
    after the step, also when the step raises; pause_gc=False leaves it alone."""
    import gc

    seen = []

    def loss_fn(model, batch):
        seen.append(gc.isenabled())
        return causal_lm_loss(model, batch)

    def failing(model, batch):
        raise RuntimeError("boom")

    engine = _engine(tiny_lm(seed=0), OptimConfig(lr=1e-3), pause_gc=pause)
    batch = [pack(random_seqs(2, 10, 64, 0))]
    assert gc.isenabled()
    engine.step(batch, loss_fn)
    assert seen == [not pause] and gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        engine.step(batch, failing)
    assert gc.isenabled()


def test_stats_metrics_and_errors():
    model = tiny_lm(seed=0)
    engine = TrainEngine(model, OptimConfig(lr=1e-3), ScheduleConfig(warmup_steps=2, decay="linear"), total_steps=4)
    batches = [pack(random_seqs(2, 10, 64, 0)), pack(random_seqs(3, 10, 64, 1))]
    with_metrics = lambda m, b: (causal_lm_loss(m, b)[0], {"sequences": b.cu_seqlens.numel() - 1})
    s = engine.step(batches, with_metrics)
    assert s.tokens == 50 and s.normalizer == 45 and s.lr == pytest.approx(5e-4)
    assert s.metrics == {"sequences": pytest.approx(5 / 45)}
    d = s.to_dict()
    assert d["sequences"] == pytest.approx(5 / 45) and d["step"] == 1 and d["skipped"] is False
    if device.peak_bf16_flops() is None:
        assert s.mfu is None
    assert s.tokens_per_s > 0 and s.time_s > 0
    empty = pack(random_seqs(1, 4, 64, 0))
    empty.labels[:] = -100
    empty.num_target_tokens = 0
    with pytest.raises(DataError, match="no target tokens"):
        engine.step([empty])


def test_bf16_compute_learns_and_keeps_parameter_identity():
    model = tiny_lm(seed=0)
    ids = [id(p) for p in model.parameters()]
    engine = TrainEngine(
        model, OptimConfig(lr=1e-2), ScheduleConfig(decay="constant"), PrecisionConfig(compute_dtype="bf16")
    )
    ptrs = [p.data_ptr() for p in model.parameters()]
    batch = [pack(random_seqs(4, 32, 64, 0))]
    losses = [engine.step(batch).loss for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5
    assert [id(p) for p in model.parameters()] == ids and [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.gpu
def test_compiled_layers_match_eager_on_accelerator():
    """GPU check: per-layer torch.compile gives the eager losses (bf16 tolerance) and keeps parameters."""
    dev = device.torch_device()
    batch = [pack(random_seqs(4, 128, 64, 0))]
    runs = []
    for compile_ in (False, True):
        model = tiny_lm(seed=0).to(dev)
        engine = TrainEngine(
            model, OptimConfig(lr=1e-2), ScheduleConfig(decay="constant"), engine=StepConfig(compile=compile_)
        )
        runs.append([engine.step(batch).loss for _ in range(3)])
    assert runs[1] == pytest.approx(runs[0], rel=2e-2)


@pytest.mark.gpu
def test_bf16_fused_adamw_on_accelerator_learns_and_reports_mfu():
    """GPU check: auto precision is bf16 with fp32 masters, fused AdamW, parameters keep identity and
    storage, MFU and peak memory are reported, and the loss falls."""
    dev = device.torch_device()
    model = tiny_lm(seed=0, hidden=256, heads=8, layers=4).to(dev)
    engine = TrainEngine(model, OptimConfig(lr=3e-3), ScheduleConfig(warmup_steps=2, decay="constant"))
    assert engine.compute_dtype == torch.bfloat16 and engine.optimizer.has_masters
    assert engine.optimizer.inner.defaults.get("fused") is True
    ptrs = [p.data_ptr() for p in model.parameters()]
    batch = [pack(random_seqs(8, 256, 64, 0))]
    stats = [engine.step(batch) for _ in range(10)]
    assert stats[-1].loss < stats[0].loss - 0.3
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    if device.peak_bf16_flops() is not None:
        assert 0 < stats[-1].mfu < 1
    assert stats[-1].peak_memory_bytes > 0 and not any(s.skipped for s in stats)


def test_fp16_loss_scale_absorbs_overflow_without_tripping_the_guard():
    model = tiny_lm(seed=0)
    engine = TrainEngine(
        model,
        OptimConfig(lr=1e-2),
        ScheduleConfig(decay="constant"),
        PrecisionConfig(compute_dtype="fp16", initial_loss_scale=2.0**40),  # fp16 grads overflow at first
        StepConfig(nan_guard_max_consecutive=2),
    )
    assert all(p.dtype == torch.float16 for p in model.parameters())
    batch = [pack(random_seqs(2, 16, 64, 0))]
    stats = [engine.step(batch) for _ in range(30)]
    skipped = [s.skipped for s in stats]
    assert skipped[0] and not skipped[-1] and engine.consecutive_skips == 0  # > 2 overflows, no error
    first_good = skipped.index(False)
    assert stats[first_good].loss_scale == 2.0 ** (40 - first_good) and first_good > 2
    assert stats[-1].loss < stats[first_good].loss
