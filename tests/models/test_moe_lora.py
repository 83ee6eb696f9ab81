"""LoRA on the routed experts of MoE models (``LoraConfig.target_parameters``, PEFT's ``target_parameters``), fp32 on
the CPU: PEFT loads our adapter on transformers' own model with our logits and we load PEFT's with its logits (names,
shapes and nesting of PEFT's ``ParamWrapper``), merge / unmerge / merged state dict / unwrap / disabled adapters,
gradients only on A and B (checked against an explicit per-expert ``W_e + s B_e A_e``), QLoRA on an MoE model
(NF4 attention and experts), config errors, multi-adapter serving refusing expert adapters, and
``polyrl train --algo sft --lora ...,experts`` on the tiny-moe preset."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import hf_logits, logits, packed, randomize_
from safetensors import safe_open
from test_moe_model import ARCH, hf_dict

from polyrl import kernels
from polyrl.errors import CheckpointError, ConfigError
from polyrl.models import build_model, create_model_from_preset, load_model, preset_config
from polyrl.models.decoder import DecoderLM
from polyrl.models.lora import (
    LoraConfig,
    LoraExperts,
    LoraLinear,
    adapter_parameters,
    adapters_disabled,
    apply_lora,
    load_adapter,
    load_lora_model,
    make_lora_config,
    merge_lora,
    merged,
    merged_state_dict,
    read_adapter_config,
    save_adapter,
    unmerge_lora,
    unwrap_lora,
)
from polyrl.models.lora.multi import attach_adapters
from polyrl.models.moe import Experts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
LENS = [6, 9, 3]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _hf_folder(family: str, folder, seed: int = 1):
    hf = getattr(transformers, ARCH[family])(transformers.AutoConfig.for_model(**hf_dict(family)))
    randomize_(hf, seed).save_pretrained(str(folder))
    return folder


def _hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _randomize_adapters(model, seed: int = 3, scale: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(scale * torch.randn(p.shape, generator=gen))


def _tiny_moe(**lora) -> DecoderLM:
    model = build_model(preset_config("tiny-moe"), seed=3)
    if lora:
        apply_lora(model, LoraConfig(**lora))
        _randomize_adapters(model)
    return model


@pytest.mark.parametrize(
    ("family", "targets", "params"),
    [
        ("qwen3_moe", ["q", "v"], EXPERTS),
        ("qwen3_moe", ["k"], ["down"]),
        ("qwen2_moe", ["q", "gate", "up", "down"], ["experts"]),  # + the shared expert's and dense layers' MLPs
        ("mixtral", ["v"], EXPERTS),
    ],
)
def test_peft_loads_our_expert_adapter_with_our_logits(tmp_path, family, targets, params):
    base = _hf_folder(family, tmp_path / "base")
    ours = load_model(base, dtype=torch.float32)
    apply_lora(ours, LoraConfig(r=4, alpha=12, targets=targets, target_parameters=params))
    _randomize_adapters(ours)
    out = save_adapter(ours, tmp_path / "adapter", base_model=str(base))
    cfg = json.loads((out / "adapter_config.json").read_text())
    want = LoraConfig(target_parameters=params).target_parameters
    assert cfg["target_parameters"] == want and cfg["lora_dropout"] == 0.0
    hf = _hf(base)
    ids, pos, meta = packed(LENS, ours.config.vocab_size, seed=1)
    base_logits = hf_logits(hf, ids, LENS)
    theirs = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    got = logits(ours.eval(), ids, pos, meta)
    want_logits = hf_logits(theirs, ids, LENS)
    assert (want_logits - base_logits).abs().max().item() > 1e-2  # the adapter changes the output
    assert (got - want_logits).abs().max().item() <= 1e-4
    assert sum(isinstance(m, LoraExperts) for m in ours.modules()) == len(ours.config.moe_layers)


def test_expert_tensor_names_and_shapes_are_peft_s(tmp_path):
    """Both tensors targeted: PEFT nests ``down_proj``'s wrapper around ``gate_up_proj``'s, so gate_up's adapter is
    ``experts.base_layer.lora_*`` and down's ``experts.lora_*``; A is ``[E * r, in]``, B ``[out, E * r]``."""
    model = _tiny_moe()
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q"], target_parameters=["experts"]))
    out = save_adapter(model, tmp_path / "a")
    c = model.config
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    pre = "base_model.model.model.layers.0.mlp.experts."
    assert shapes[pre + "base_layer.lora_A.weight"] == (e * 4, h)
    assert shapes[pre + "base_layer.lora_B.weight"] == (2 * i, e * 4)
    assert shapes[pre + "lora_A.weight"] == (e * 4, i)
    assert shapes[pre + "lora_B.weight"] == (h, e * 4)
    assert len(shapes) == c.num_layers * 6  # q_proj + two expert tensors, A and B each, per layer
    # a single targeted tensor is the outermost (and only) wrapper
    one = _tiny_moe()
    apply_lora(one, LoraConfig(r=2, targets=["q"], target_parameters=["down"]))
    assert {n for n in adapter_parameters(one) if "experts" in n} == {
        f"model.layers.{li}.mlp.experts.lora_{ab}.weight" for li in range(c.num_layers) for ab in "AB"
    }


def test_adapter_saved_by_peft_loads_into_ours(tmp_path):
    base = _hf_folder("qwen3_moe", tmp_path / "base")
    hf = _hf(base)
    pcfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS, task_type="CAUSAL_LM"
    )
    pm = peft.get_peft_model(hf, pcfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(str(tmp_path / "peft_adapter"))
    pm.eval()
    cfg, saved_base = read_adapter_config(tmp_path / "peft_adapter")
    assert cfg.target_parameters == EXPERTS and cfg.targets == ["q_proj"] and cfg.scaling == 2.0
    model = load_lora_model(tmp_path / "peft_adapter", None, torch.float32)
    assert saved_base == str(base)
    ids, pos, meta = packed(LENS, model.config.vocab_size, seed=2)
    want = hf_logits(pm, ids, LENS)
    assert (logits(model.eval(), ids, pos, meta) - want).abs().max().item() <= 1e-4
    # and back out: our save of what we loaded is the same tensors under the same names
    again = save_adapter(model, tmp_path / "again")
    with safe_open(str(again / "adapter_model.safetensors"), "pt") as a:
        with safe_open(str(tmp_path / "peft_adapter" / "adapter_model.safetensors"), "pt") as b:
            assert set(a.keys()) == set(b.keys())
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_expert_adapter_math_and_gradients_only_on_a_and_b():
    """The layer's output equals the reference op on explicitly built per-expert weights ``W_e + s B_e A_e``, and
    its gradients are those of that explicit construction; base tensors get none."""
    model = _tiny_moe(r=3, alpha=6, targets=["q"], target_parameters=["experts"])
    layer = model.model.layers[0].mlp.experts
    assert isinstance(layer, LoraExperts) and layer.scaling == 2.0
    e, r = layer.num_experts, 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, model.config.hidden_size, generator=gen)
    ids = torch.randint(0, e, (10, 2), generator=gen)
    w = torch.rand(10, 2, generator=gen)
    out = layer(x, ids, w)
    ref_params = {n: p.detach().clone().requires_grad_() for n, p in layer.lora_A.items()}
    ref_params.update({n + ".B": p.detach().clone().requires_grad_() for n, p in layer.lora_B.items()})

    def explicit(name):
        base = getattr(layer, name).detach()
        a, b = ref_params[name], ref_params[name + ".B"]
        return torch.stack([base[k] + 2.0 * b.view(b.shape[0], r, e)[:, :, k] @ a.view(e, r, -1)[k] for k in range(e)])

    ref = kernels.moe.reference.moe_experts(x, ids, w, explicit("gate_up_proj"), explicit("down_proj"))
    assert (out - ref).abs().max().item() < 1e-5
    g = torch.randn(out.shape, generator=gen)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for name in ("gate_up_proj", "down_proj"):
        assert getattr(layer, name).grad is None and not getattr(layer, name).requires_grad
        assert (layer.lora_A[name].grad - ref_params[name].grad).abs().max().item() < 1e-5
        assert (layer.lora_B[name].grad - ref_params[name + ".B"].grad).abs().max().item() < 1e-5
        assert layer.lora_B[name].grad.abs().max().item() > 0
    # through the whole model: only adapter tensors are trainable and receive gradients
    b = _batch(model.config.vocab_size)
    model.zero_grad()
    hidden = model(*b[:2], b[3])
    kernels.linear_cross_entropy(hidden, model.lm_head_weight, b[2], reduction="sum").backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in n for n in trained) and any("experts.lora_B" in n for n in trained)


def _batch(vocab: int):
    ids, pos, meta = packed([7, 12], vocab, seed=4)
    labels = torch.roll(ids, -1)
    return ids, pos, labels, meta


def test_merge_unmerge_merged_state_dict_unwrap_and_disabled():
    base = _tiny_moe()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    model = _tiny_moe(r=4, alpha=8, targets=["q", "o"], target_parameters=["experts"])
    ids, pos, meta = packed(LENS, model.config.vocab_size, seed=6)
    plain = logits(base, ids, pos, meta)
    adapted = logits(model, ids, pos, meta)
    assert (adapted - plain).abs().max().item() > 1e-2
    with adapters_disabled(model):
        assert (logits(model, ids, pos, meta) - plain).abs().max().item() <= 1e-6
    experts = model.model.layers[1].mlp.experts
    w0 = experts.gate_up_proj.detach().clone()
    with merged(model):  # exact: bit-for-bit restore
        assert experts.merged and (experts.gate_up_proj - w0).abs().max().item() > 1e-3
        assert (logits(model, ids, pos, meta) - adapted).abs().max().item() <= 1e-5
        with pytest.raises(ConfigError, match="merged"):
            with adapters_disabled(model):
                pass
    assert torch.equal(experts.gate_up_proj, w0) and not experts.merged
    merge_lora(model)  # in place, subtracting back
    unmerge_lora(model)
    assert (experts.gate_up_proj - w0).abs().max().item() <= 1e-6
    w0 = experts.gate_up_proj.detach().clone()
    state = merged_state_dict(model)
    assert not any("lora" in k for k in state) and set(state) == set(base_state)
    fresh = _tiny_moe()
    fresh.load_state_dict(state)
    assert (logits(fresh, ids, pos, meta) - adapted).abs().max().item() <= 1e-5
    assert torch.equal(experts.gate_up_proj, w0)  # the model is unchanged
    unwrap_lora(model)
    assert type(model.model.layers[0].mlp.experts) is Experts and not any(
        isinstance(m, (LoraExperts, LoraLinear)) for m in model.modules()
    )
    assert (logits(model, ids, pos, meta) - adapted).abs().max().item() <= 1e-5


def test_qlora_on_an_moe_model_quantizes_experts_and_trains():
    """``quantize_base="nf4"``: attention bases and the routed experts become NF4 (more in test_moe_qlora.py)."""
    model = _tiny_moe(r=4, alpha=8, targets=["q", "k", "v", "o"], target_parameters=["experts"], quantize_base="nf4")
    attn = model.model.layers[0].self_attn.q_proj
    assert attn.quant_shape is not None and not hasattr(attn, "weight")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_nf4.dtype == torch.uint8 and experts.quant_shape is not None
    b = _batch(model.config.vocab_size)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        hidden = model(*b[:2], b[3])
        loss = kernels.linear_cross_entropy(hidden, model.lm_head_weight, b[2])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(".lora_" in n for n, p in model.named_parameters() if p.grad is not None)
    with pytest.raises(Exception, match="NF4"):
        merge_lora(model)  # the NF4 attention bases cannot take a merge in place (export --merge instead)
    unmerge_lora(model)
    state = merged_state_dict(model)
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # dequantized NF4
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16  # dequantized NF4


def test_config_spellings_and_errors(tmp_path):
    cfg = make_lora_config("r=8,alpha=16,targets=q,k,v,o,experts")
    assert cfg.targets == ["q_proj", "k_proj", "v_proj", "o_proj"] and cfg.target_parameters == EXPERTS
    cfg = make_lora_config("r=8,target_parameters=mlp.experts.down_proj,gate_up")
    assert len(cfg.targets) == 7 and cfg.target_parameters == EXPERTS
    assert make_lora_config({"targets": ["experts.down"]}).targets == []
    with pytest.raises(ConfigError, match="dropout"):
        make_lora_config("dropout=0.05,targets=q,experts")
    with pytest.raises(ConfigError, match="unknown lora target parameter"):
        LoraConfig(target_parameters=["mlp.experts.up_proj"])
    dense = build_model(preset_config("tiny"), seed=0)
    with pytest.raises(ConfigError, match="no MoE layer"):
        apply_lora(dense, LoraConfig(targets=["q"], target_parameters=["experts"]))
    # a PEFT adapter that targets one layer's experts only is refused by name
    model = _tiny_moe(r=2, targets=["q"], target_parameters=["experts"])
    out = save_adapter(model, tmp_path / "a")
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["model.layers.0.mlp.experts.gate_up_proj"]
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown lora target parameter"):
        read_adapter_config(out)


def test_mlp_targets_that_match_nothing_on_an_moe_model_are_said():
    """targets=q,gate,up,down on tiny-moe (every layer sparse) adapted q_proj only, without a word: the MLP names
    match no module there (the MLPs are routed experts). A warning says so and names the fix; with the experts
    targeted too, or on a dense model, nothing is said."""
    moe = build_model(preset_config("tiny-moe"), seed=0)
    with pytest.warns(RuntimeWarning, match=r"gate_proj, up_proj, down_proj match no layer .* add experts"):
        apply_lora(moe, LoraConfig(targets=["q", "gate", "up", "down"]))
    assert len(lora_layers_of(moe)) == 2  # q_proj of the two layers
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_lora(build_model(preset_config("tiny-moe"), seed=0), LoraConfig(targets=["q", "down", "experts"]))
        apply_lora(build_model(preset_config("tiny"), seed=0), LoraConfig(targets=["q", "gate", "up", "down"]))


def test_expert_adapter_on_a_dense_base_says_the_base_is_wrong(tmp_path):
    """An expert adapter loaded over a dense base (``--base`` pointing at the wrong model) said "drop experts from the
    LoRA targets", advice for a training config; loading an adapter, it is the base that is wrong. Loading an adapter
    also does not warn about its MLP targets (PEFT's all-linear adapters name them on MoE models)."""
    import warnings

    out = save_adapter(_tiny_moe(r=2, targets=["q"], target_parameters=["experts"]), tmp_path / "a", base_model="m")
    dense = build_model(preset_config("tiny"), seed=0)
    with pytest.raises(CheckpointError, match=r"adapter .* does not fit this model: .*no MoE layer.*another base"):
        load_adapter(dense, out)
    with pytest.warns(RuntimeWarning, match="match no layer"):  # training with these targets does warn
        full = save_adapter(_tiny_moe(r=2, targets=["q", "gate", "up", "down"]), tmp_path / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_adapter(build_model(preset_config("tiny-moe"), seed=3), full)


def lora_layers_of(model: DecoderLM) -> list[str]:
    from polyrl.models.lora.apply import lora_layers

    return [name for name, _ in lora_layers(model)]


def test_multi_adapter_serving_refuses_expert_adapters(tmp_path):
    model = _tiny_moe(r=2, targets=["q"], target_parameters=["experts"])
    out = save_adapter(model, tmp_path / "a")
    with pytest.raises(ConfigError, match="routed experts.*export"):
        attach_adapters(_tiny_moe(), {"a": out})


@pytest.mark.parametrize("qlora", [False, pytest.param(True, marks=pytest.mark.slow)])  # NF4 reference: ~3x slower
def test_sft_cli_trains_expert_adapters_on_tiny_moe(tmp_path, qlora):
    # lazy: the CLI pulls in the whole training stack; only this test needs it
    from polyrl.cli.main import main

    model_dir = create_model_from_preset("tiny-moe", tmp_path / "tiny-moe", seed=0)
    out = tmp_path / "run"
    argv = ["train", "--algo", "sft", "--model", str(model_dir), "--data", "builtin:arithmetic?n=48", "--out", str(out)]
    argv += ["--max-steps", "6", "--micro-batch-tokens", "256", "--max-seq-len", "64", "--lr", "1e-2"]
    argv += ["--log-every", "1", "--lora", "r=4,alpha=8,targets=q,v,experts", "--set", "train.report_to=none"]
    argv += ["--qlora"] if qlora else []
    assert main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    # measured on the CPU: 7.68 -> 7.27 over 6 steps (QLoRA 7.69 -> 7.27)
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"] - 0.3, [r["loss"] for r in steps]
    run_cfg = json.loads((out / "run_config.json").read_text())
    assert run_cfg["lora"]["target_parameters"] == EXPERTS
    assert run_cfg["lora"]["quantize_base"] == ("nf4" if qlora else None)
    final = out / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == EXPERTS and cfg["target_modules"] == ["q_proj", "v_proj"]
    with safe_open(str(final / "adapter_model.safetensors"), "pt") as f:
        b = f.get_tensor("base_model.model.model.layers.0.mlp.experts.lora_B.weight")
    assert b.abs().max().item() > 0  # the experts' adapter trained (B starts at zero)
    # the base is untouched and the trained adapter gives PEFT's logits on transformers' model
    ours = load_lora_model(final, None, torch.float32)
    ref = load_model(model_dir, dtype=torch.float32)
    assert torch.equal(ours.model.layers[0].mlp.experts.gate_up_proj, ref.model.layers[0].mlp.experts.gate_up_proj)
    theirs = peft.PeftModel.from_pretrained(_hf(model_dir), str(final)).eval()
    ids, pos, meta = packed([5, 8], ours.config.vocab_size, seed=7)
    want = logits(ours.eval(), ids, pos, meta)
    assert (want - hf_logits(theirs, ids, [5, 8])).abs().max().item() <= 1e-4
    if not qlora:  # polyrl export --merge: a plain HF folder (per-expert layout) that transformers loads
        merged_dir = tmp_path / "merged"
        argv = ["export", "--adapter", str(final), "--merge", "--out", str(merged_dir), "--dtype", "float32"]
        assert main(argv) == 0
        assert (hf_logits(_hf(merged_dir), ids, [5, 8]) - want).abs().max().item() <= 1e-4


@pytest.mark.gpu
def test_bf16_expert_adapters_train_on_the_accelerator(tmp_path):
    """On the device (H200: the Triton grouped GEMM): a bf16 tiny-moe base with expert + attention adapters, fp32
    masters; the layer's output matches the reference op on the same adapted weights, loss falls, the base is
    untouched. Run: ``.venv/bin/python -m pytest tests/models/test_moe_lora.py -m gpu -q``."""
    from polyrl.data import TokenizedSeq, pack_sequences
    from polyrl.kernels.moe.reference import moe_experts as reference_experts
    from polyrl.platform import device
    from polyrl.train import OptimConfig, PrecisionConfig, TrainEngine

    if not device.is_accelerator():
        pytest.skip("needs an accelerator")
    dev = device.torch_device()
    model_dir = create_model_from_preset("tiny-moe", tmp_path / "tiny-moe", seed=0)
    cfg = LoraConfig(r=8, alpha=16, targets=["q", "k", "v", "o"], target_parameters=["experts"])
    model = load_lora_model(model_dir, cfg, torch.bfloat16, dev)
    _randomize_adapters(model, scale=0.05)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    layer = model.model.layers[0].mlp.experts
    assert layer.gate_up_proj.dtype == torch.bfloat16 and layer.gate_up_proj.is_cuda == (dev.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, model.config.hidden_size, generator=gen).to(dev, torch.bfloat16)
    ids = torch.randint(0, layer.num_experts, (300, 2), generator=gen).to(dev)
    w = torch.rand(300, 2, generator=gen).to(dev, torch.bfloat16)
    with torch.no_grad():
        got = layer(x, ids, w).float()
        want = reference_experts(x, ids, w, layer.adapted("gate_up_proj"), layer.adapted("down_proj")).float()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item() + 1e-3
    engine = TrainEngine(model, OptimConfig(lr=1e-3), precision=PrecisionConfig("bf16"), total_steps=4)
    assert all(m.dtype == torch.float32 for m in engine.optimizer.masters)
    assert any("experts.lora_B" in n for n in engine.optimizer.names)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    seqs = [TokenizedSeq(torch.randint(0, vocab, (n,), generator=g).tolist(), [1] * n) for n in (200, 57, 300)]
    batch = pack_sequences(seqs).to(dev)
    losses = [engine.step([batch]).loss for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
