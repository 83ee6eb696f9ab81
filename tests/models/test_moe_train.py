"""MoE models in training on the CPU: the router aux loss in the engine's step (metric and loss term, HF's
coefficient semantics, the engine.moe_aux_loss_coef override), LoRA on attention of an MoE model (the router is
never a target), and `polyrl train --algo sft` on the tiny-moe preset from the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from polyrl import kernels
from polyrl.cli.main import main
from polyrl.data.batch import pack_sequences
from polyrl.data.examples import TokenizedSeq
from polyrl.errors import ConfigError
from polyrl.models import build_model, create_model_from_preset, preset_config
from polyrl.models.lora import LoraConfig, apply_lora
from polyrl.models.lora.layer import LoraLinear
from polyrl.models.moe import Routing, load_balancing_loss
from polyrl.train import OptimConfig, PrecisionConfig, StepConfig, TrainEngine
from polyrl.train.losses import attention_metadata


def _model(**cfg_overrides):
    cfg = preset_config("tiny-moe")
    for k, v in cfg_overrides.items():
        setattr(cfg, k, v)
    return build_model(cfg, seed=3)


def _batches(vocab: int) -> list:
    g = torch.Generator().manual_seed(11)
    out = []
    for lens in ([7, 12], [20]):
        seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
        out.append(pack_sequences([TokenizedSeq(s, [0] + [1] * (len(s) - 1)) for s in seqs]))
    return out


def _expected(model, batches) -> tuple[float, float]:
    """(summed CE / target tokens, token-weighted mean aux) of the model before the step."""
    ce, aux_w, tokens, targets = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for b in batches:
            routing = Routing()
            hidden = model(b.input_ids, b.position_ids, attention_metadata(b), routing=routing)
            ce += kernels.linear_cross_entropy(hidden, model.lm_head_weight, b.labels, reduction="sum").item()
            aux_w += load_balancing_loss(routing, model.config.num_experts).item() * b.input_ids.numel()
            tokens += b.input_ids.numel()
            targets += int(b.num_target_tokens)
    return ce / targets, aux_w / tokens


@pytest.mark.parametrize("override", [None, 0.0, 0.5])
def test_step_adds_and_reports_the_aux_loss(override):
    model = _model()
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.01
    batches = _batches(model.config.vocab_size)
    ce, aux = _expected(model, batches)
    engine = TrainEngine(
        model,
        OptimConfig(lr=1e-3),
        precision=PrecisionConfig(compute_dtype="fp32"),
        engine=StepConfig(moe_aux_loss_coef=override),
        total_steps=1,
    )
    stats = engine.step(batches)
    coef = 0.01 if override is None else override
    assert 1.9 < aux < 3.0  # k = 2 for a balanced router (HF's scaling), more when unbalanced
    assert stats.metrics["moe/aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert stats.metrics["moe/z_loss"] > 0
    assert stats.loss == pytest.approx(ce + coef * aux, rel=1e-5)


def test_output_router_logits_false_adds_nothing_but_reports():
    model = _model(output_router_logits=False)
    batches = _batches(model.config.vocab_size)
    ce, aux = _expected(model, batches)
    engine = TrainEngine(model, OptimConfig(lr=1e-3), precision=PrecisionConfig(compute_dtype="fp32"), total_steps=1)
    stats = engine.step(batches)
    assert stats.loss == pytest.approx(ce, rel=1e-6)
    assert stats.metrics["moe/aux_loss"] == pytest.approx(aux, rel=1e-5)


def test_fixed_shape_padding_does_not_count_in_the_aux_loss():
    """A fixed-shape batch's trailing padding routes through the experts but the step's aux metric and loss are
    those of the real tokens: equal to the unpadded batch's."""
    stats = []
    for pad_to in (None, 48):
        model = _model()
        seqs = [TokenizedSeq(list(range(3, 3 + n)), [0] + [1] * (n - 1)) for n in (7, 12)]
        batch = pack_sequences(seqs, pad_to=pad_to)
        engine = TrainEngine(
            model, OptimConfig(lr=1e-3), precision=PrecisionConfig(compute_dtype="fp32"), total_steps=1
        )
        stats.append(engine.step([batch]))
    assert stats[1].tokens == stats[0].tokens == 19
    assert stats[1].metrics["moe/aux_loss"] == pytest.approx(stats[0].metrics["moe/aux_loss"], rel=1e-6)
    assert stats[1].loss == pytest.approx(stats[0].loss, rel=1e-6)


def test_a_batch_routing_replay_forces_the_experts_in_the_step():
    """A micro-batch carrying ``routing_replay`` trains with those experts: its own record gives the plain step's
    loss, other experts another loss."""
    losses = {}
    for case in ("plain", "own", "other"):
        model = _model()
        b = _batches(model.config.vocab_size)[1]
        if case != "plain":
            rec = Routing()
            with torch.no_grad():
                model(b.input_ids, b.position_ids, attention_metadata(b), routing=rec)
            shift = 0 if case == "own" else 3
            b.routing_replay = {layer: (ids + shift) % 8 for layer, ids in rec.topk_ids.items()}
        engine = TrainEngine(
            model, OptimConfig(lr=1e-3), precision=PrecisionConfig(compute_dtype="fp32"), total_steps=1
        )
        losses[case] = engine.step([b]).loss
    assert losses["own"] == losses["plain"]
    assert abs(losses["other"] - losses["plain"]) > 1e-4


def test_aux_loss_gradient_reaches_the_router():
    """The aux loss backpropagates through the recorded router logits into the router weight."""
    model = _model()
    b = _batches(model.config.vocab_size)[1]
    routing = Routing()
    model(b.input_ids, b.position_ids, attention_metadata(b), routing=routing)
    load_balancing_loss(routing, 8).backward()
    g = model.model.layers[0].mlp.gate.weight.grad
    assert g is not None and g.abs().max() > 0


def test_bad_coefficient_is_a_config_error():
    with pytest.raises(ConfigError, match="moe_aux_loss_coef"):
        StepConfig(moe_aux_loss_coef=-1.0)


def test_lora_on_attention_of_an_moe_model():
    model = _model()
    apply_lora(model, LoraConfig(r=4, alpha=8))  # every default target: q/k/v/o and the (absent) dense MLP's
    layers = dict(model.named_modules())
    wrapped = sorted(n for n, m in layers.items() if isinstance(m, LoraLinear))
    assert wrapped == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("k_proj", "o_proj", "q_proj", "v_proj")
    ]
    gate = model.model.layers[0].mlp.gate
    assert type(gate) is nn.Linear and not gate.weight.requires_grad  # the router is never a gate_proj target
    assert not model.model.layers[0].mlp.experts.gate_up_proj.requires_grad
    b = _batches(model.config.vocab_size)[0]
    hidden = model(b.input_ids, b.position_ids, attention_metadata(b))
    kernels.linear_cross_entropy(hidden, model.lm_head_weight, b.labels, reduction="sum").backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all(".lora_" in n for n in trained)
    with pytest.raises(ConfigError, match="matched no linear layer"):
        apply_lora(_model(), LoraConfig(r=4, targets=["gate_proj"]))


def test_sft_cli_on_tiny_moe_reduces_loss_and_reports_aux(tmp_path):
    model_dir = create_model_from_preset("tiny-moe", tmp_path / "tiny-moe", seed=0)
    out = tmp_path / "run"
    argv = ["train", "--algo", "sft", "--model", str(model_dir), "--data", "builtin:arithmetic?n=48", "--out", str(out)]
    argv += [
        "--max-steps",
        "6",
        "--micro-batch-tokens",
        "256",
        "--max-seq-len",
        "64",
        "--lr",
        "3e-3",
        "--log-every",
        "1",
    ]
    argv += ["--set", "train.report_to=none", "--set", "engine.moe_aux_loss_coef=0.02"]
    assert main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "moe/aux_loss" in r]
    assert len(steps) == 6
    assert all(0.9 < r["moe/aux_loss"] < 8.0 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["engine"]["moe_aux_loss_coef"] == 0.02
    final = json.loads((out / "final" / "config.json").read_text())
    assert final["model_type"] == "qwen3_moe" and final["num_experts"] == 8


def test_peft_loads_our_qwen2_moe_adapter_with_our_logits(tmp_path):
    """An adapter on every default target of a Qwen2-MoE (attention, the dense layers' MLP and the shared expert,
    which PEFT matches by name too) loads in PEFT on transformers' own model with our logits."""
    peft = pytest.importorskip("peft")
    import transformers
    from model_helpers import hf_logits, logits, packed, randomize_
    from test_moe_model import hf_dict

    from polyrl.models import load_model
    from polyrl.models.lora import adapter_parameters, save_adapter

    hf = randomize_(transformers.Qwen2MoeForCausalLM(transformers.AutoConfig.for_model(**hf_dict("qwen2_moe"))))
    hf.save_pretrained(str(tmp_path / "base"))
    ours = load_model(tmp_path / "base", dtype=torch.float32)
    apply_lora(ours, LoraConfig(r=4, alpha=8))
    names = {n for n, m in ours.named_modules() if isinstance(m, LoraLinear)}
    assert "model.layers.1.mlp.shared_expert.gate_proj" in names and "model.layers.0.mlp.gate_proj" in names
    assert not any(n.endswith("mlp.gate") for n in names)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_parameters(ours).values():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    save_adapter(ours, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    lens = [6, 9]
    ids, pos, meta = packed(lens, ours.config.vocab_size, seed=1)
    got = logits(ours.eval(), ids, pos, meta)
    assert (got - hf_logits(theirs, ids, lens)).abs().max().item() <= 1e-4
