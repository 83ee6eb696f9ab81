"""data.fixed_shapes in training: a padded batch gives the unpadded batch's loss, gradients, normaliser, counted
tokens and model FLOPs."""

from __future__ import annotations

import copy

import pytest
import torch
from train_helpers import tiny_lm

from polyrl.data import TokenizedSeq
from polyrl.data.batch import pack_sequences


def seqs(lengths, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        out.append(TokenizedSeq(ids, [0] * (n // 3) + [1] * (n - n // 3)))
    return out


def _loss_and_grads(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss, _ = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["tokens", "sequences"])
def test_same_loss_and_gradients_as_the_unpadded_batch(loss):
    from polyrl.algorithms.sft import SFTConfig, make_loss, normalizer

    cfg = SFTConfig(normalize=loss)
    loss_fn = make_loss(cfg)
    model = tiny_lm(seed=0)
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


def test_engine_counts_real_tokens_and_flops_only(monkeypatch):
    from polyrl.platform import device

    monkeypatch.setattr(device, "peak_bf16_flops", lambda *a: 1e15)  # the CPU has no peak: MFU accounting on
    from polyrl.train import OptimConfig, ScheduleConfig, TrainEngine

    real = seqs([9, 31, 4, 17], seed=5)
    stats = {}
    for name, batch in (("plain", pack_sequences(real)), ("fixed", pack_sequences(real, 256, 16, 128))):
        engine = TrainEngine(tiny_lm(seed=0), OptimConfig(lr=1e-3), ScheduleConfig(decay="constant"))
        stats[name] = engine.step([batch])
        flops = engine._model_flops([batch])
        stats[name + "_flops"] = flops
    assert stats["plain"].tokens == stats["fixed"].tokens == 61
    assert stats["plain"].loss == pytest.approx(stats["fixed"].loss, rel=1e-6)
    assert stats["plain_flops"] == stats["fixed_flops"] > 0


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
