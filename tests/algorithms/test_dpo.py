"""DPO: the loss against its closed form (beta, label smoothing, IPO), sequence log-probs and the reference
table against a direct computation, config errors, and tiny runs on builtin:arithmetic-pref (the margin and
accuracy rise; resume reads the reference cache; a separate reference model is used when given)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from polyrl import algorithms
from polyrl import run as runner
from polyrl.algorithms.dpo import (
    CACHE_NAME,
    DPOConfig,
    ReferenceLogps,
    batch_keys,
    dpo_loss,
    make_loss,
    normalizer,
    sequence_logps,
)
from polyrl.data import TokenizedSeq, pack_sequences
from polyrl.errors import ConfigError
from polyrl.run import config as rc


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- the loss -----------------------------------------------------------------------------------
@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2), (2.0, 0.45)])
def test_sigmoid_loss_matches_closed_form(beta, eps):
    pc = torch.tensor([-3.0, -10.0, -1.5])
    pr = torch.tensor([-4.0, -2.0, -1.5])
    rc_ = torch.tensor([-3.5, -9.0, -2.0])
    rr = torch.tensor([-3.0, -2.5, -1.0])
    got = dpo_loss(pc, pr, rc_, rr, beta, eps, "sigmoid")
    for i in range(3):
        h = (pc[i] - rc_[i]).item() - (pr[i] - rr[i]).item()
        want = -(1 - eps) * math.log(_sig(beta * h)) - eps * math.log(_sig(-beta * h))
        assert got[i].item() == pytest.approx(want, rel=1e-6, abs=1e-7)
    # h = 0 (policy == reference): log 2 whatever beta and eps.
    zero = dpo_loss(pc, pr, pc, pr, beta, eps)
    assert torch.allclose(zero, torch.full((3,), math.log(2.0)))


def test_ipo_loss_and_gradient_direction():
    pc = torch.tensor([-1.0, -2.0], requires_grad=True)
    pr = torch.tensor([-1.5, -1.0], requires_grad=True)
    rc_, rr = torch.tensor([-1.2, -2.0]), torch.tensor([-1.2, -1.0])
    beta = 0.25
    got = dpo_loss(pc, pr, rc_, rr, beta, 0.0, "ipo")
    h = torch.tensor([(-1.0 + 1.2) - (-1.5 + 1.2), 0.0])
    assert torch.allclose(got, (h - 1 / (2 * beta)) ** 2)
    got.sum().backward()
    # below the target margin 1/(2 beta) = 2 the loss pushes chosen up and rejected down
    assert (pc.grad < 0).all() and (pr.grad > 0).all()


def test_config_validation():
    assert DPOConfig().beta == 0.1
    for bad, match in [
        ({"beta": 0}, "dpo.beta must be a positive"),
        ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
        ({"loss_type": "hinge"}, "loss_type must be one of sigmoid, ipo"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "applies to loss_type = .sigmoid. only"),
        ({"reference_batch_tokens": 0}, "reference_batch_tokens"),
    ]:
        with pytest.raises(ConfigError, match=match):
            DPOConfig(**bad)
    with pytest.raises(ConfigError, match="needs reference log-probs"):
        make_loss(DPOConfig())


# ---- sequence log-probs and the reference table -------------------------------------------------
def _pairs():
    # (chosen, rejected) x 2; loss_mask 0 marks prompt tokens
    return [
        TokenizedSeq([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]),
        TokenizedSeq([5, 6, 7, 20, 21, 22], [0, 0, 1, 1, 1, 1]),
        TokenizedSeq([30, 31, 32, 33], [0, 1, 1, 1]),
        TokenizedSeq([30, 31, 40], [0, 0, 1]),
    ]


def _direct_logps(model, seq: TokenizedSeq) -> float:
    """log p(target tokens | prefix) of one sequence alone, from the full logits."""
    from polyrl.models import AttnMetadata

    ids = torch.tensor(seq.input_ids)
    hidden = model(ids, torch.arange(len(ids)), AttnMetadata.from_seqlens([len(ids)], ids.device))
    logp = torch.log_softmax(model.compute_logits(hidden).double(), -1)
    return sum(logp[t - 1, seq.input_ids[t]].item() for t in range(1, len(ids)) if seq.loss_mask[t])


def test_sequence_logps_and_reference_equal_direct_computation(tiny_model):
    model = tiny_model("qwen3", seed=1)
    seqs = _pairs()
    batch = pack_sequences(seqs)
    with torch.no_grad():
        sums, counts = sequence_logps(model, batch)
    direct = [_direct_logps(model, s) for s in seqs]
    assert torch.allclose(sums.double(), torch.tensor(direct, dtype=torch.float64), atol=1e-4)
    assert counts.tolist() == [3.0, 4.0, 3.0, 1.0]

    table = ReferenceLogps()
    # a tiny packing budget: every sequence in its own batch, a different packing from training's
    assert table.compute(model, seqs, tokens_per_batch=4, device=torch.device("cpu")) == 4
    assert table.compute(model, seqs[:2], tokens_per_batch=4, device=torch.device("cpu")) == 0  # cached
    ref_sums, ref_counts = table.lookup(batch, torch.device("cpu"))
    assert torch.allclose(ref_sums.double(), torch.tensor(direct, dtype=torch.float64), atol=1e-4)
    assert ref_counts.tolist() == counts.tolist()
    # the keys depend on content only: the same sequences in another order find the same values
    reordered = pack_sequences([seqs[2], seqs[3], seqs[0], seqs[1]])
    assert batch_keys(reordered) == [batch_keys(batch)[i] for i in (2, 3, 0, 1)]
    assert table.lookup(reordered, torch.device("cpu"))[0].tolist() == [ref_sums[i].item() for i in (2, 3, 0, 1)]
    # same ids with another prompt mask is another sequence
    assert batch_keys(pack_sequences([TokenizedSeq([5, 6, 7, 8, 9], [0, 1, 1, 1, 1])])) != batch_keys(batch)[:1]


def test_loss_fn_at_the_reference_is_log2_and_metrics_are_pair_sums(tiny_model, tmp_path):
    model = tiny_model("qwen3", seed=2)
    seqs = _pairs()
    batch = pack_sequences(seqs)
    table = ReferenceLogps()
    table.compute(model, seqs, 64, torch.device("cpu"))
    cfg = DPOConfig(beta=0.5)
    loss, metrics = make_loss(cfg, table)(model, batch)
    assert loss.item() == pytest.approx(2 * math.log(2.0), rel=1e-5)
    assert metrics["rewards/margins"].item() == pytest.approx(0.0, abs=1e-5)
    assert normalizer(cfg, [batch, batch]) == 4.0
    # cache round trip
    path = table.save(tmp_path / CACHE_NAME)
    again = ReferenceLogps.load(path)
    assert again.entries == table.entries

    # shift the reference of chosen 0 by -2: h = 2 for pair 0 -> loss = -log sig(beta*2) + log 2
    key = batch_keys(batch)[0]
    s, c = table.entries[key]
    table.entries[key] = (s - 2.0, c)
    loss, metrics = make_loss(cfg, table)(model, batch)
    assert loss.item() == pytest.approx(-math.log(_sig(1.0)) + math.log(2.0), rel=1e-5)
    assert metrics["rewards/chosen"].item() == pytest.approx(1.0, rel=1e-5)
    assert metrics["rewards/accuracies"].item() == 1.0
    assert metrics["logps/chosen"].item() == pytest.approx(s + table.entries[batch_keys(batch)[2]][0], rel=1e-5)
    # a gradient step on that loss moves the policy's chosen log-prob of pair 0 up
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- runs ---------------------------------------------------------------------------------------
DATA = "builtin:arithmetic-pref?max=9&n=32"  # ~3 micro-batches of 13 pairs per epoch


def _cfg(model_dir, out, steps=15, **dpo):
    raw = {
        "algo": "dpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": DATA, "max_seq_len": 64},
        "engine": {"micro_batch_tokens": 512},
        "optim": {"lr": 2e-3, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 2, "decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100, "save_final_model": False},
        "checkpoint": {"every_n_steps": 100, "keep_last_k": 1},
        "dpo": {"beta": 0.5, **dpo},
    }
    return rc.build(raw)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_dpo_run_raises_margin_and_accuracy_then_resumes_from_cache(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, out)
    assert algorithms.get("dpo").prepare is not None  # the reference pass before the offline loop
    runner.run(cfg)
    recs = _records(out)
    assert len(recs) == 15
    assert recs[0]["loss"] == pytest.approx(math.log(2.0), abs=1e-4)  # step 1 sees the initial weights
    mean = lambda key, part: sum(r[key] for r in part) / len(part)  # noqa: E731
    first, last = recs[:3], recs[-3:]
    # measured on CPU: margins 0.03 -> 1.2 .. 1.9, accuracy 0.5 -> 0.9 .. 1.0, loss 0.69 -> 0.2 .. 0.35
    assert mean("rewards/margins", last) > mean("rewards/margins", first) + 0.5
    assert mean("rewards/accuracies", last) >= 0.85 > mean("rewards/accuracies", first)
    assert mean("loss", last) < 0.45
    assert (out / CACHE_NAME).is_file()
    printed = capsys.readouterr().out
    assert "dpo: reference log-probs of" in printed and "in " in printed

    # resume a longer run: the reference comes from the cache, steps 16.. continue
    more = _cfg(tiny_model_dir, out, steps=17)
    more.resume = "latest"
    runner.run(more)
    printed = capsys.readouterr().out
    assert "read from" in printed and "resumed from" in printed
    assert [r["step"] for r in _records(out)][-2:] == [16, 17]


def test_separate_reference_model_is_used(tiny_model_dir, tmp_path):
    from polyrl.models.checkpoint import load_model, save_model

    # a reference that differs from the policy: the first step's loss is no longer log 2
    ref = load_model(tiny_model_dir)
    with torch.no_grad():
        ref.model.norm.weight.mul_(1.5)
    ref_dir = save_model(ref, tmp_path / "ref", tokenizer=tiny_model_dir)
    out = tmp_path / "run"
    runner.run(_cfg(tiny_model_dir, out, steps=1, reference_model=str(ref_dir)))
    rec = _records(out)[0]
    assert abs(rec["loss"] - math.log(2.0)) > 1e-3 and abs(rec["rewards/margins"]) > 1e-3
    meta = json.loads((out / CACHE_NAME).read_text())["meta"]
    assert meta["reference_model"] == str(ref_dir)


def test_chat_message_pairs_through_the_pipeline(tiny_model_dir, tmp_path):
    from polyrl.algorithms.dpo import build_data
    from polyrl.data import DataConfig
    from polyrl.models.checkpoint import load_model, load_tokenizer

    user = {"role": "user", "content": "What is 2 + 2?"}
    rows = [
        # full conversations sharing a prefix (Anthropic HH style) and an explicit prompt with message lists
        {
            "chosen": [user, {"role": "assistant", "content": "4"}],
            "rejected": [user, {"role": "assistant", "content": "5"}],
        },
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "four"}], "rejected": "five"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = build_data(DataConfig(path=str(path), shuffle=False), load_tokenizer(tiny_model_dir), "train", 512)
    assert len(data.units) == 2 and all(len(u) == 2 for u in data.units)
    batch = next(data.iterator())
    assert batch.num_sequences == 4
    model = load_model(tiny_model_dir)
    table = ReferenceLogps()
    table.compute(model, [s for u in data.units for s in u], 512, torch.device("cpu"))
    loss, m = make_loss(DPOConfig(), table)(model, batch)
    assert loss.item() == pytest.approx(2 * math.log(2.0), rel=1e-5)
    # the prompt is masked: each sequence's target tokens are its answer (+ end-of-turn), not the question
    sums, counts = sequence_logps(model, batch)
    assert all(1 <= c <= 4 for c in counts.tolist())


@pytest.mark.gpu
def test_dpo_run_on_the_accelerator_bf16(tiny_model_dir, tmp_path):
    """On the GPU (bf16 compute): the reference pass and the first training forward agree (loss log 2), and a short
    run raises the margin."""
    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, out, steps=15)
    runner.run(cfg)
    recs = _records(out)
    assert json.loads((out / CACHE_NAME).read_text())["meta"]["dtype"] == "bfloat16"
    assert recs[0]["loss"] == pytest.approx(math.log(2.0), abs=2e-3)
    assert sum(r["rewards/margins"] for r in recs[-3:]) / 3 > 0.3


def test_held_out_eval_reports_margin_and_accuracy_per_pair(tiny_model_dir, tmp_path):
    """``eval_every``: eval_loss, eval_rewards/margins and eval_rewards/accuracies at the eval steps; at the last step
    they equal a direct computation over the eval pairs with the final weights (means over pairs, although the eval
    micro-batches hold different numbers of pairs)."""
    from polyrl.algorithms.dpo import build_data
    from polyrl.data import DataConfig
    from polyrl.models.checkpoint import load_model, load_tokenizer

    eval_spec = "builtin:arithmetic-pref?max=9&n=20&seed=5"
    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, out, steps=3)
    cfg.train.eval_every, cfg.train.eval_data, cfg.train.save_final_model = 2, eval_spec, True
    runner.run(cfg)
    recs = _records(out)
    assert [r["step"] for r in recs if "eval_rewards/margins" in r] == [2, 3]
    assert all("eval_loss" in r and 0.0 <= r["eval_rewards/accuracies"] <= 1.0 for r in recs if "eval_loss" in r)

    data = build_data(DataConfig(path=eval_spec, shuffle=False), load_tokenizer(tiny_model_dir), "train", 512)
    pairs_per_batch = [b.num_sequences // 2 for b in data.iterator(max_epochs=1)]
    assert sum(pairs_per_batch) == len(data.units) == 20 and len(set(pairs_per_batch)) > 1  # unequal batches
    policy, reference = load_model(out / "final", dtype=torch.float32), load_model(tiny_model_dir, dtype=torch.float32)
    margins, wins, losses = [], [], []
    with torch.no_grad():
        for chosen, rejected in data.units:
            r_c = 0.5 * (_direct_logps(policy, chosen) - _direct_logps(reference, chosen))
            r_r = 0.5 * (_direct_logps(policy, rejected) - _direct_logps(reference, rejected))
            margins.append(r_c - r_r)
            wins.append(float(r_c > r_r))
            losses.append(-math.log(_sig(r_c - r_r)))
    last = recs[-1]
    assert last["eval_rewards/margins"] == pytest.approx(sum(margins) / 20, abs=1e-4)
    assert last["eval_rewards/accuracies"] == pytest.approx(sum(wins) / 20)
    assert last["eval_loss"] == pytest.approx(sum(losses) / 20, abs=1e-4)
    assert abs(last["eval_rewards/margins"]) > 1e-3  # three steps moved the policy off the reference
