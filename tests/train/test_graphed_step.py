"""CUDA-graph replay of the training step (train/graphed_step.py): when it applies, the gradient binding, and (GPU)
that captured steps give the eager losses and parameters, for full training and LoRA, with and without activation
checkpointing and gradient accumulation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from train_helpers import pack, random_seqs, tiny_lm

from polyrl.errors import ConfigError, UserError
from polyrl.models.lora import LoraConfig, apply_lora
from polyrl.platform import device
from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine, causal_lm_loss
from polyrl.train.graphed_step import GraphedMicroStep, batch_signature, is_graph_safe, model_is_deterministic


def test_signature_is_shapes_and_max_seqlen_only():
    a = pack(random_seqs(4, 32, 64, seed=0))
    b = pack(random_seqs(4, 32, 64, seed=1))  # other tokens, same shapes
    assert batch_signature(a) == batch_signature(b)
    longer = pack(random_seqs(4, 33, 64, seed=0))
    assert batch_signature(longer) != batch_signature(a)
    uneven = pack([torch.arange(40), torch.arange(24), torch.arange(32), torch.arange(32)])  # 128 tokens, max 40
    assert uneven.input_ids.shape == a.input_ids.shape and batch_signature(uneven) != batch_signature(a)
    assert batch_signature({"input_ids": a.input_ids}) is None


def test_only_marked_losses_and_dropout_free_models_are_graphed():
    assert is_graph_safe(causal_lm_loss)
    assert not is_graph_safe(lambda model, batch: causal_lm_loss(model, batch))
    model = tiny_lm(seed=0)
    assert model_is_deterministic(model)
    model.extra = nn.Dropout(0.1)
    assert not model_is_deterministic(model)
    lora = apply_lora(tiny_lm(seed=0), LoraConfig(r=4, alpha=8, dropout=0.05))
    assert not model_is_deterministic(lora)
    assert model_is_deterministic(apply_lora(tiny_lm(seed=0), LoraConfig(r=4, alpha=8)))


def test_config_rejects_unknown_mode_and_required_graphs_say_why():
    with pytest.raises(ConfigError, match="cuda_graphs must be true, false or unset"):
        StepConfig(cuda_graphs="always")
    engine = TrainEngine(
        tiny_lm(seed=0), OptimConfig(lr=1e-2), ScheduleConfig(decay="constant"), engine=StepConfig(cuda_graphs=True)
    )
    with pytest.raises(UserError, match="need a CUDA device, the model is on cpu"):
        engine.step([pack(random_seqs(2, 16, 64, 0))])


def test_a_failed_capture_warns_and_stays_eager_unless_graphs_are_required():
    def engine(graphs):
        cfg = StepConfig(cuda_graphs=graphs)
        return TrainEngine(tiny_lm(seed=0), OptimConfig(lr=1e-2), ScheduleConfig(decay="constant"), engine=cfg)

    auto = engine(None)
    with pytest.warns(RuntimeWarning, match="capture of the training step failed .RuntimeError: boom"):
        auto._capture_failed(RuntimeError("boom\nmore"))
    assert auto._graphs_failed and not auto._graphs_allowed(causal_lm_loss)
    with pytest.raises(UserError, match="cuda_graphs = true, but the capture failed .RuntimeError: boom"):
        engine(True)._capture_failed(RuntimeError("boom"))


def test_cpu_steps_never_capture():
    engine = TrainEngine(
        tiny_lm(seed=0), OptimConfig(lr=1e-2), ScheduleConfig(decay="constant"), PrecisionConfig("fp32")
    )
    batch = [pack(random_seqs(2, 16, 64, 0))]
    for _ in range(3):
        engine.step(batch)
    assert engine.graph_captures == 0 and engine.graph_replays == 0
    assert not device.is_capturing(torch.zeros(1)) and not device.is_capturing()


def test_replayed_gradients_add_to_what_the_step_holds():
    """Around a replay: a master without a gradient takes the replay's buffer; one holding an eager micro-batch's
    gradient gets the replay's added; one holding an earlier replay's buffer has it copied out first (the replay
    overwrites the buffer), then added."""
    masters = [torch.zeros(3), torch.zeros(2), torch.zeros(2)]
    step = GraphedMicroStep(("sig",), causal_lm_loss, masters)
    step.grads = [torch.zeros(3), torch.zeros(2), torch.full((2,), 5.0)]  # the graph's pool buffers
    masters[1].grad = torch.tensor([1.0, 2.0])  # an eager micro-batch ran first in this step
    masters[2].grad = step.grads[2]  # an earlier replay's output (5, 5)
    eager = masters[1].grad
    held = step._held_grads()
    for g, value in zip(step.grads, (7.0, 10.0, 100.0)):  # what "the replay" writes
        g.fill_(value)
    step._bind_grads(held)
    assert masters[0].grad is step.grads[0] and masters[0].grad.tolist() == [7.0] * 3
    assert masters[1].grad is eager and eager.tolist() == [11.0, 12.0]
    assert masters[2].grad is not step.grads[2] and masters[2].grad.tolist() == [105.0, 105.0]


# ---- GPU -------------------------------------------------------------------------------------------------------


def _run(make_model, graphs: bool | None, ckpt: bool, micro: int, steps: int = 4, batch_fn=None):
    model = make_model().to(device.torch_device())
    engine = TrainEngine(
        model,
        OptimConfig(lr=3e-3),
        ScheduleConfig(decay="constant"),
        engine=StepConfig(cuda_graphs=graphs, activation_checkpointing=ckpt),
    )
    batch_fn = batch_fn or (lambda seed: pack(random_seqs(4, 128, 64, seed=seed)))
    losses = []
    for s in range(steps):
        batch = [batch_fn(10 * s + i) for i in range(micro)]
        stats = engine.step(batch)
        losses.append((stats.loss, stats.grad_norm))
    params = {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    return losses, params, engine


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("ckpt,micro", [(False, 1), (True, 1), (True, 2)], ids=["plain", "ckpt", "ckpt-accum"])
def test_graphed_steps_equal_eager_steps(lora, ckpt, micro):
    def make():
        model = tiny_lm(seed=0, hidden=256, heads=8, layers=3)
        return apply_lora(model, LoraConfig(r=8, alpha=16)) if lora else model

    eager, eager_params, e0 = _run(make, False, ckpt, micro)
    graphed, graphed_params, e1 = _run(make, None, ckpt, micro)
    assert e0.graph_captures == 0
    # the first micro-batch of the shape runs eagerly (warm-up), the second captures; it and all later ones replay
    assert e1.graph_captures == 1 and e1.graph_replays == 4 * micro - 1
    for (l0, n0), (l1, n1) in zip(eager, graphed):
        assert l1 == pytest.approx(l0, rel=1e-5, abs=1e-6) and n1 == pytest.approx(n0, rel=1e-4, abs=1e-6)
    for name, p in eager_params.items():
        torch.testing.assert_close(graphed_params[name], p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "quantize, skip_down",
    [("nf4", False), (None, True), ("nf4", True)],
    ids=["qlora", "lora-frozen-down-after-ckpt", "qlora-frozen-down-after-ckpt"],
)
def test_graphed_lora_variants_equal_eager(quantize, skip_down):
    """QLoRA, and DecoderOptions.skip_frozen_down_recompute (the down projection's frozen base after each checkpoint),
    captured: the replayed steps give the eager losses and adapters."""

    def make():
        model = tiny_lm(seed=0, hidden=256, heads=8, layers=2)
        model.options = dataclasses.replace(model.options, skip_frozen_down_recompute=skip_down)
        return apply_lora(model, LoraConfig(r=8, alpha=16, quantize_base=quantize))

    eager, eager_params, _ = _run(make, False, True, 1, steps=3)
    graphed, graphed_params, e1 = _run(make, None, True, 1, steps=3)
    assert e1.graph_captures == 1 and e1.graph_replays == 2
    assert [x[0] for x in graphed] == pytest.approx([x[0] for x in eager], rel=1e-5)
    for name, p in eager_params.items():
        torch.testing.assert_close(graphed_params[name], p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_fixed_shape_batches_of_other_sequences_replay_one_graph():
    """data.fixed_shapes: chat-like batches (other sequence counts and lengths every step) padded to one shape are
    captured once and replayed, with the eager losses and parameters."""
    from polyrl.data import TokenizedSeq
    from polyrl.data.batch import pack_sequences

    def batch_fn(seed):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(20, 120, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        seqs = [TokenizedSeq(torch.randint(0, 64, (n,), generator=g).tolist(), [0] + [1] * (n - 1)) for n in lens]
        return pack_sequences(seqs, pad_to=768, num_sequences=16, max_seqlen=128)

    def make():
        return tiny_lm(seed=0, hidden=256, heads=8, layers=2)

    eager, eager_params, _ = _run(make, False, False, 1, steps=4, batch_fn=batch_fn)
    graphed, graphed_params, e1 = _run(make, None, False, 1, steps=4, batch_fn=batch_fn)
    assert e1.graph_captures == 1 and e1.graph_replays == 3
    for (l0, n0), (l1, n1) in zip(eager, graphed):
        assert l1 == pytest.approx(l0, rel=1e-5, abs=1e-6) and n1 == pytest.approx(n0, rel=1e-4, abs=1e-6)
    for name, p in eager_params.items():
        torch.testing.assert_close(graphed_params[name], p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_new_shape_recaptures_and_release_frees_the_graph():
    model = tiny_lm(seed=0, hidden=256, heads=8, layers=2).to(device.torch_device())
    engine = TrainEngine(model, OptimConfig(lr=1e-3), ScheduleConfig(decay="constant"))
    short = [pack(random_seqs(4, 64, 64, seed=0))]
    long = [pack(random_seqs(4, 96, 64, seed=0))]
    for batch in (short, short, short, long, long, long):
        assert torch.isfinite(torch.tensor(engine.step(batch).loss))
    assert engine.graph_captures == 2 and engine.graph_replays == 2  # the 96-token graph replaced the first
    engine.release_graphs()
    assert engine.graph_replays == 0


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [None, True], ids=["auto", "required"])
def test_shapes_that_change_every_other_step_stop_capturing_in_auto_mode(graphs):
    """Variable packed data repeats a shape now and then: each pair of equal steps captures a graph that the next
    shape throws away after one replay. Auto mode stops after two such captures (warning that names
    data.fixed_shapes) and trains eagerly with the same losses; required mode keeps capturing as asked."""
    import warnings

    model = tiny_lm(seed=0, hidden=256, heads=8, layers=2).to(device.torch_device())
    engine = TrainEngine(
        model, OptimConfig(lr=1e-3), ScheduleConfig(decay="constant"), engine=StepConfig(cuda_graphs=graphs)
    )
    lengths = [64, 64, 72, 72, 80, 80, 88, 88, 96, 96]  # each shape twice: warm-up, then capture + one replay
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, n in enumerate(lengths):
            assert torch.isfinite(torch.tensor(engine.step([pack(random_seqs(4, n, 64, seed=i))]).loss))
    churn = [w for w in caught if "data.fixed_shapes" in str(w.message)]
    if graphs is None:
        assert engine.graph_captures == 2 and engine.wasted_captures == 2 and len(churn) == 1
        assert engine.graph_replays == 0  # nothing held: eager from the third shape on
    else:
        assert engine.graph_captures == 5 and engine.wasted_captures == 4 and not churn
