"""data.fixed_shapes: micro-batches padded to the token budget, a sequence capacity and one max_seqlen, so the shapes
repeat (a CUDA-graphed training step replays them) while the loss, its gradients, the normaliser, the counted tokens
and the model FLOPs stay those of the unpadded batch."""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.data import PackedBatchIterator, TokenizedSeq
from polyrl.data.batch import IGNORE_INDEX, PAD_CHUNK, pack_sequences


def seqs(lengths, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        out.append(TokenizedSeq(ids, [0] * (n // 3) + [1] * (n - n // 3)))  # a prompt part without loss
    return out


def test_padding_layout_and_what_is_unchanged():
    real = seqs([7, 20, 3])
    plain = pack_sequences(real)
    padded = pack_sequences(real, pad_to=300, num_sequences=8, max_seqlen=150)
    assert padded.input_ids.shape == (300,) and padded.cu_seqlens.shape == (9,) and padded.max_seqlen == 150
    # the real tokens first, unchanged; then 270 padding tokens in sequences of at most PAD_CHUNK; then empties
    assert torch.equal(padded.input_ids[:30], plain.input_ids) and torch.equal(padded.labels[:30], plain.labels)
    assert torch.equal(padded.cu_seqlens[:4], plain.cu_seqlens)
    assert padded.cu_seqlens.tolist()[3:] == [30, 30 + PAD_CHUNK, 30 + 2 * PAD_CHUNK, 300, 300, 300]
    assert (padded.labels[30:] == IGNORE_INDEX).all() and padded.position_ids[30 : 30 + PAD_CHUNK].tolist() == list(
        range(PAD_CHUNK)
    )
    assert padded.num_target_tokens == plain.num_target_tokens
    assert (padded.padding_tokens, padded.padding_sequences) == (270, 5)
    assert padded.to("cpu").padding_sequences == 5


def test_bad_fixed_shapes_say_what_does_not_fit():
    real = seqs([40, 40])
    with pytest.raises(ValueError, match="80 tokens do not fit a fixed-shape batch of 64"):
        pack_sequences(real, pad_to=64)
    with pytest.raises(ValueError, match=r"3 sequences \(2 \+ padding\) exceed the fixed capacity 2"):
        pack_sequences(real, pad_to=100, num_sequences=2)
    with pytest.raises(ValueError, match="max_seqlen 30 is shorter"):
        pack_sequences(real, pad_to=100, num_sequences=4, max_seqlen=30)


def test_iterator_batches_share_one_shape_and_hold_the_same_sequences():
    units = [(s,) for s in seqs([5 + (i * 37) % 90 for i in range(60)], seed=3)]
    plain = PackedBatchIterator(units, 256, max_epochs=2)
    fixed = PackedBatchIterator(units, 256, max_epochs=2, fixed_shapes=True)
    shapes = set()
    n = 0
    for a, b in zip(plain, fixed):
        k = a.input_ids.numel()
        assert torch.equal(b.input_ids[:k], a.input_ids) and torch.equal(b.labels[:k], a.labels)
        assert b.num_target_tokens == a.num_target_tokens and b.padding_tokens == 256 - k
        shapes.add((tuple(b.input_ids.shape), tuple(b.cu_seqlens.shape), b.max_seqlen))
        n += 1
    assert n == 2 * plain.batches_per_epoch > 4
    cap = fixed.sequence_capacity(0)
    assert shapes <= {((256,), (fixed.sequence_capacity(e) + 1,), PAD_CHUNK) for e in (0, 1)} and cap % 16 == 0
    # the bound is the longest sequence (here 94) or a padding sequence (PAD_CHUNK), whichever is longer
    assert fixed.max_seqlen == max(94, PAD_CHUNK) and cap >= 256 // PAD_CHUNK


def _loss_and_grads(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss, _ = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["tokens", "sequences"])
def test_same_loss_and_gradients_as_the_unpadded_batch(tiny_model, loss):
    from polyrl.algorithms.sft import SFTConfig, make_loss, normalizer

    cfg = SFTConfig(normalize=loss)
    loss_fn = make_loss(cfg)
    model = tiny_model(seed=0)
    twin = copy.deepcopy(model)
    real = seqs([9, 31, 4, 17], seed=5)
    plain = pack_sequences(real)
    padded = pack_sequences(real, pad_to=256, num_sequences=16, max_seqlen=128)
    l0, g0 = _loss_and_grads(model, plain, loss_fn)
    l1, g1 = _loss_and_grads(twin, padded, loss_fn)
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
    assert normalizer(cfg, [padded]) == normalizer(cfg, [plain])


def test_engine_counts_real_tokens_and_flops_only(tiny_model, monkeypatch):
    from polyrl.platform import device

    monkeypatch.setattr(device, "peak_bf16_flops", lambda *a: 1e15)  # the CPU has no peak: MFU accounting on
    from polyrl.train import OptimConfig, ScheduleConfig, TrainEngine

    real = seqs([9, 31, 4, 17], seed=5)
    stats = {}
    for name, batch in (("plain", pack_sequences(real)), ("fixed", pack_sequences(real, 256, 16, 128))):
        engine = TrainEngine(tiny_model(seed=0), OptimConfig(lr=1e-3), ScheduleConfig(decay="constant"))
        stats[name] = engine.step([batch])
        flops = engine._model_flops([batch])
        stats[name + "_flops"] = flops
    assert stats["plain"].tokens == stats["fixed"].tokens == 61
    assert stats["plain"].loss == pytest.approx(stats["fixed"].loss, rel=1e-6)
    assert stats["plain_flops"] == stats["fixed_flops"] > 0


def test_flops_of_many_short_sequences_are_counted_without_recounting_parameters(tiny_model, monkeypatch):
    """MFU accounting of a batch of hundreds of short sequences (the arithmetic task's shape): the same FLOPs as
    ``sum(flops_per_token(n) * n)``, and the model's parameters are not counted again per sequence or per step (that
    cost 0.4-2 s of host time per step on the H200)."""
    from polyrl.platform import device

    monkeypatch.setattr(device, "peak_bf16_flops", lambda *a: 1e15)
    from polyrl.train import OptimConfig, ScheduleConfig, TrainEngine

    model = tiny_model(seed=0)
    lengths = [5 + (7 * i) % 23 for i in range(300)]
    batch = pack_sequences(seqs(lengths, seed=3), 8192, 336, 128)
    expected = sum(model.flops_per_token(n) * n for n in lengths)
    engine = TrainEngine(model, OptimConfig(lr=1e-3), ScheduleConfig(decay="constant"))
    counted = []
    real = type(model).num_parameters
    monkeypatch.setattr(type(model), "num_parameters", lambda self, *a, **k: counted.append(1) or real(self, *a, **k))
    stats = [engine.step([batch]) for _ in range(2)]
    assert engine._model_flops([batch]) == pytest.approx(expected, rel=1e-12)
    assert counted == []
    assert stats[1].mfu == pytest.approx(expected / stats[1].time_s / 1e15, rel=1e-9)


def test_fixed_shapes_ab_script_reports_every_mode(capsys):
    """scripts/fixed_shapes_ab.py (run on the GPU by gpu_stage.sh fixed-shapes) at a tiny shape on the CPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "fixed_shapes_ab.py"
    spec = importlib.util.spec_from_file_location("fixed_shapes_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--shape", "tiny", "--budget", "512", "--batches", "3", "--median-len", "60"])
    assert set(out) == {label for label, _, _ in mod.MODES} and all(v > 0 for v in out.values())
    text = capsys.readouterr().out
    assert "fixed shapes, graphed" in text and "padding" in text
