"""The algorithm registry, RunConfig resolution (file + overrides, validation order), the SFT losses, and
the offline runner's step accounting and eval loss, on tiny models (no CLI: see tests/cli)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from polyrl import algorithms
from polyrl.algorithms import AlgorithmSpec, NoConfig
from polyrl.algorithms.sft import SFTConfig, make_loss, normalizer, sequence_mean_loss
from polyrl.data import TokenizedSeq, pack_sequences
from polyrl.errors import ConfigError
from polyrl.run import config as rc


# ---- registry -----------------------------------------------------------------------------------
def test_registry_lists_and_loads_sft():
    assert "sft" in algorithms.names()
    spec = algorithms.get("sft")
    assert spec.name == "sft" and spec.config_cls is SFTConfig and spec.loop == "offline"
    with pytest.raises(ConfigError, match=r"unknown algorithm 'dpo-x'; choose one of: .*sft"):
        algorithms.get("dpo-x")


def test_register_is_one_call_and_validates_the_spec(monkeypatch):
    monkeypatch.setattr(algorithms, "_REGISTERED", dict(algorithms._REGISTERED))
    calls = []
    spec = algorithms.register(
        AlgorithmSpec("echo", "test algorithm", build_data=calls.append, make_loss=lambda cfg: calls.append)
    )
    assert algorithms.get("echo") is spec and "echo" in algorithms.names()
    assert spec.make_config({}) == NoConfig()
    with pytest.raises(ConfigError, match="echo has no settings"):
        spec.make_config({"beta": 1})
    with pytest.raises(ValueError, match="the offline loop needs build_data and make_loss"):
        AlgorithmSpec("broken", "no way to train")
    with pytest.raises(ValueError, match="the online loop needs hooks"):
        AlgorithmSpec("broken", "no hooks", loop="online")


# ---- run config ---------------------------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _raw(model_dir, **top):
    return {"model": str(model_dir), "out": "runs/x", "data": {"path": "builtin:arithmetic"}, **top}


def test_decoder_table_reaches_the_policy(tiny_model_dir, tmp_path):
    """``[decoder]`` (``DecoderOptions``) is a run setting: built, saved with the run, and set on the loaded model."""
    from polyrl.models import DecoderOptions
    from polyrl.run.offline import load_policy

    raw = {"model": str(tiny_model_dir), "out": str(tmp_path), "data": {"path": "builtin:arithmetic"}}
    assert rc.build(raw).decoder == DecoderOptions()
    cfg = rc.build({**raw, "decoder": {"fused_qk_norm_rope": False}})
    assert (
        cfg.decoder == DecoderOptions(fused_qk_norm_rope=False)
        and cfg.to_dict()["decoder"]["fused_qk_norm_rope"] is False
    )
    assert load_policy(cfg, torch.device("cpu")).options == cfg.decoder
    with pytest.raises(ConfigError, match=r"unknown decoder setting\(s\) \['fused'\]"):
        rc.build({**raw, "decoder": {"fused": True}})


def test_build_defaults_seed_and_token_budget(model_dir):
    cfg = rc.build(_raw(model_dir, seed=7, engine={"micro_batch_tokens": 1024}))
    assert cfg.algo == "sft" and cfg.spec is algorithms.get("sft")
    assert cfg.data.seed == cfg.engine.seed == 7
    assert cfg.engine.micro_batch_tokens == 1024 and not hasattr(cfg.data, "tokens_per_batch")  # one owner
    cfg = rc.build(_raw(model_dir, data={"path": "builtin:arithmetic", "seed": 1}, engine={"micro_batch_tokens": 512}))
    assert cfg.engine.micro_batch_tokens == 512 and cfg.data.seed == 1 and cfg.engine.seed == 0
    assert rc.build(_raw(model_dir)).engine.micro_batch_tokens == cfg.engine.__class__().micro_batch_tokens == 8192
    with pytest.raises(ConfigError, match="data.tokens_per_batch is now engine.micro_batch_tokens"):
        rc.build(_raw(model_dir, data={"path": "builtin:arithmetic", "tokens_per_batch": 512}))


def test_to_dict_round_trips_through_json(model_dir, tmp_path):
    cfg = rc.build(_raw(model_dir, optim={"lr": 3e-4, "betas": [0.8, 0.9]}, sft={"normalize": "sequences"}))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg.to_dict()))
    again = rc.resolve(str(path), [])
    assert again.to_dict() == cfg.to_dict()
    assert again.algo_config == SFTConfig(normalize="sequences") and again.optim.betas == (0.8, 0.9)
    assert rc.differences(cfg.to_dict(), rc.build(_raw(model_dir, optim={"lr": 1e-4})).to_dict()) == [
        "optim.betas",
        "optim.lr",
        "sft.normalize",
    ]


def test_toml_file_with_overrides_in_order(model_dir, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(f'model = "{model_dir}"\nout = "o"\n[data]\npath = "builtin:copy"\n[optim]\nlr = 1e-3\n')
    cfg = rc.resolve(str(toml), [("optim.lr", 2e-3), *rc.parse_set(["optim.lr=5e-4", "train.max_steps=3"])])
    assert cfg.optim.lr == 5e-4 and cfg.train.max_steps == 3 and cfg.data.path == "builtin:copy"


@pytest.mark.parametrize(
    "text, value",
    [("1e-4", 1e-4), ("3", 3), ("true", True), ("[0.9, 0.95]", [0.9, 0.95]), ("builtin:x?n=3", "builtin:x?n=3")],
)
def test_parse_value(text, value):
    assert rc.parse_value(text) == value


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"bogus": 1}, r"unknown setting\(s\) \['bogus'\]"),
        ({"dpo": {}}, r"unknown setting\(s\) \['dpo'\]"),
        ({"optim": 3}, r"\[optim\] must be a table"),
        ({"train": {"max_steps": 0}}, "train.max_steps must be a positive integer"),
        ({"train": {"epochs": -1}}, "train.epochs must be a positive number"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"out": ""}, "no out given"),
        ({"algo": 3}, "algo must be a name"),
    ],
)
def test_build_errors(model_dir, raw, message):
    with pytest.raises(ConfigError, match=message):
        rc.build({**_raw(model_dir), **raw})


def test_value_errors_come_before_the_model_path_check(tmp_path):
    raw = {"model": str(tmp_path / "absent"), "out": "o", "data": {"path": "builtin:copy"}, "optim": {"lr": 0}}
    with pytest.raises(ConfigError, match="optim.lr"):
        rc.build(raw)
    raw["optim"] = {}
    with pytest.raises(ConfigError, match="absent' does not exist; give a Hugging Face model folder, or create"):
        rc.build(raw)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        rc.parse_set(["optim.lr"])
    with pytest.raises(ConfigError, match="too many parts"):
        rc.apply_overrides({}, [("a.b.c", 1)])


# ---- SFT losses ---------------------------------------------------------------------------------
def _batch(lengths, masks_from, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n, k in zip(lengths, masks_from):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        seqs.append(TokenizedSeq(ids, [0] * k + [1] * (n - k)))
    return seqs


def test_sequence_mean_loss_matches_per_sequence_means(tiny_model):
    from polyrl.train.losses import causal_lm_loss

    model = tiny_model()
    seqs = _batch([9, 5, 12, 3], [4, 1, 6, 3], model.config.vocab_size)  # the last one has no target token
    packed = pack_sequences(seqs)
    total, _ = sequence_mean_loss(model, packed)
    want = 0.0
    for s in seqs:
        one = pack_sequences([s])
        if one.num_target_tokens:
            loss_sum, _ = causal_lm_loss(model, one)
            want += float(loss_sum.detach()) / one.num_target_tokens
    assert float(total.detach()) == pytest.approx(want, rel=1e-5)
    assert normalizer(SFTConfig(normalize="sequences"), [packed, pack_sequences(seqs[:1])]) == 4.0
    assert normalizer(SFTConfig(), [packed]) is None
    assert make_loss(SFTConfig()) is causal_lm_loss and make_loss(SFTConfig("sequences")) is sequence_mean_loss


def test_sequence_mean_loss_gradient_flows(tiny_model):
    model = tiny_model()
    packed = pack_sequences(_batch([6, 8], [2, 3], model.config.vocab_size, seed=1))
    loss, _ = sequence_mean_loss(model, packed)
    loss.backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


# ---- runner pieces ------------------------------------------------------------------------------
def test_total_steps_from_epochs_and_accumulation(model_dir):
    from polyrl.run.offline import total_steps

    base = _raw(model_dir, engine={"micro_batch_tokens": 256, "step_tokens": 1024})
    assert total_steps(rc.build(base), batches_per_epoch=10) == 3  # 10 micro-batches / 4 per step, rounded up
    assert total_steps(rc.build({**base, "train": {"epochs": 2.0}}), 10) == 5
    assert total_steps(rc.build({**base, "train": {"epochs": 2.0, "max_steps": 7}}), 10) == 7


def test_resume_point_rules(model_dir, tmp_path):
    from polyrl.errors import CheckpointError
    from polyrl.run.offline import resume_point

    out = tmp_path / "run"
    cfg = rc.build({**_raw(model_dir), "out": str(out)})
    assert resume_point(cfg) is None
    ck = out / "checkpoints" / "step-00000003"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a run"):
        resume_point(cfg)
    assert resume_point(dataclasses.replace(cfg, resume="latest")) == ck
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resume_point(dataclasses.replace(cfg, resume=str(tmp_path)))


def test_eval_loss_is_the_token_mean(tiny_model):
    from polyrl.data import DataConfig
    from polyrl.data.dataset import DataStats, TokenizedData
    from polyrl.run.offline import evaluate_loss
    from polyrl.train.losses import causal_lm_loss

    model = tiny_model()
    seqs = _batch([7, 9, 5, 11], [2, 2, 1, 3], model.config.vocab_size, seed=2)
    data = TokenizedData([(s,) for s in seqs], DataStats(), DataConfig(shuffle=False), 16)
    spec = algorithms.get("sft")
    got = evaluate_loss(model, data, causal_lm_loss, spec, SFTConfig(), torch.device("cpu"))
    packed = pack_sequences(seqs)
    with torch.no_grad():
        want = float(causal_lm_loss(model, packed)[0]) / packed.num_target_tokens
    assert got == pytest.approx(want, rel=1e-5)
    assert model.training
