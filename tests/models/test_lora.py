"""LoRA core: config and --lora parsing, applying adapters in place, merged == unmerged forward, switches,
the optimizer touching adapters only, and the merged state dict."""

from __future__ import annotations

import pytest
import torch
from model_helpers import logits, packed

from polyrl.errors import ConfigError
from polyrl.models.lora import (
    AdapterDisabled,
    LoraConfig,
    LoraLinear,
    adapter_parameters,
    adapters_disabled,
    apply_lora,
    lora_layers,
    make_lora_config,
    merge_lora,
    merged,
    merged_state_dict,
    parse_lora_spec,
    unmerge_lora,
)


def _randomize_adapters(model, seed=1, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(scale * torch.randn(p.shape, generator=gen))


def test_parse_spec_and_config():
    d = parse_lora_spec("r=8,alpha=16,dropout=0.05,targets=q,k,v,o,gate,up,down")
    assert d == {"r": 8, "alpha": 16, "dropout": 0.05, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
    cfg = make_lora_config(d)
    assert cfg.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert cfg.scaling == 2.0
    assert make_lora_config("r=16,rslora=true").scaling == pytest.approx(32 / 4)
    assert make_lora_config("targets=v,q").targets == ["q_proj", "v_proj"]
    assert make_lora_config("").r == 16
    # PEFT's spelling for every projection (not the LM head), alone or beside other names
    assert make_lora_config("targets=all-linear").targets == cfg.targets
    assert make_lora_config("targets=q,all-linear").targets == cfg.targets


@pytest.mark.parametrize(
    "spec, words",
    [
        ("r=0", "lora.r must be a positive integer"),
        ("r=4,alpha=-1", "lora.alpha"),
        ("dropout=1.5", "lora.dropout"),
        ("targets=q,lm_head", "unknown lora target 'lm_head'"),
        ("targets=q,v_porj", r"unknown lora target 'v_porj' \(did you mean v_proj\?\)"),
        ("targets=q,expert", r"\(did you mean experts\?\)"),
        ("r=4,targets=", "lora.targets has an empty name"),
        ("rank=4", "unknown --lora key 'rank'"),
        ("r=4,q", "has no '='"),
        ("quantize_base=int8", "quantize_base"),
    ],
)
def test_bad_config_says_what_to_change(spec, words):
    with pytest.raises(ConfigError, match=words):
        make_lora_config(spec)


def test_a_rank_no_targeted_layer_can_use_is_refused(tiny_model):
    """r above min(out, in) of every targeted weight adds no capacity, only memory (r=100000 on the tiny model was
    killed by the OOM killer without a word); a rank above some layers' (k_proj [32, 64]) but not all is taken, and
    an adapter loaded from a folder is never refused for its rank."""
    model = tiny_model("qwen3")
    q = model.model.layers[0].self_attn.q_proj
    widest = min(q.out_features, q.in_features)
    k = model.model.layers[0].self_attn.k_proj
    assert min(k.out_features, k.in_features) < widest
    too_big = rf"lora.r={widest + 1} is larger than any targeted layer can use.*r <= {widest}"
    with pytest.raises(ConfigError, match=too_big):
        apply_lora(model, LoraConfig(r=widest + 1, targets=["q", "k"]))
    assert not any(True for _ in lora_layers(model))  # refused before any adapter was built
    apply_lora(model, LoraConfig(r=widest, targets=["q", "k"]))  # k_proj's rank is below r: taken, as PEFT does
    narrow = tiny_model("qwen3")
    with pytest.raises(ConfigError, match=rf"at most {min(k.out_features, k.in_features)} \(k_proj"):
        apply_lora(narrow, LoraConfig(r=widest, targets=["k"]))
    apply_lora(narrow, LoraConfig(r=widest, targets=["k"]), warn_unmatched=False)  # a saved adapter's own rank


def test_apply_keeps_base_parameters_and_names(tiny_model):
    model = tiny_model("qwen3")
    q = model.model.layers[0].self_attn.q_proj
    w_before = q.weight
    names_before = set(dict(model.named_parameters()))
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q", "v", "down"]))
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoraLinear) and layer.weight is w_before  # same Parameter object
    assert isinstance(model.model.layers[0].self_attn.k_proj, torch.nn.Linear)
    names_after = set(dict(model.named_parameters()))
    assert names_before <= names_after
    added = names_after - names_before
    assert len(added) == 2 * 3 * model.config.num_layers
    assert "model.layers.1.mlp.down_proj.lora_B.weight" in added
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == added
    assert all(float(p.detach().abs().max()) == 0.0 for n, p in model.named_parameters() if n.endswith("lora_B.weight"))


def test_fresh_adapter_changes_nothing_and_merge_matches(tiny_model):
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids, pos, meta = packed([5, 9, 3], model.config.vocab_size)
    base = logits(model, ids, pos, meta)
    apply_lora(model, LoraConfig(r=4, alpha=8))
    assert torch.equal(logits(model, ids, pos, meta), base)  # B = 0
    _randomize_adapters(model)
    unmerged = logits(model, ids, pos, meta)
    assert (unmerged - base).abs().max() > 1e-3  # the adapter does something
    with adapters_disabled(model):
        assert torch.equal(logits(model, ids, pos, meta), base)
    assert torch.equal(logits(AdapterDisabled(model), ids, pos, meta), base)
    w0 = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    merge_lora(model)
    merged_logits = logits(model, ids, pos, meta)
    assert (merged_logits - unmerged).abs().max().item() < 1e-5
    unmerge_lora(model)
    assert (model.model.layers[0].mlp.up_proj.weight - w0).abs().max().item() < 1e-6
    w1 = model.model.layers[1].self_attn.o_proj.weight.detach().clone()
    with merged(model):  # exact: restored from backups
        assert all(layer.merged for _, layer in lora_layers(model))
        assert (model.model.layers[1].self_attn.o_proj.weight - w1).abs().max() > 0
    assert not any(layer.merged for _, layer in lora_layers(model))
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight, w1)
    # the plain HF state dict of base + adapter, loaded into a fresh model, gives the LoRA model's logits
    plain = tiny_model("llama")
    plain.load_state_dict(merged_state_dict(model))
    assert (logits(plain, ids, pos, meta) - unmerged).abs().max().item() < 1e-5


def test_optimizer_state_only_for_adapters(tiny_model):
    from polyrl.train import OptimConfig, TrainEngine

    model = tiny_model("qwen3")
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q", "v"]))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = TrainEngine(model, OptimConfig(lr=1e-2, weight_decay=0.1), total_steps=2)
    assert set(engine.optimizer.names) == set(adapter_parameters(model))
    ids, pos, _ = packed([6, 6], model.config.vocab_size)
    batch = _batch(ids, pos, [6, 6])
    for _ in range(2):
        engine.step([batch])
    state = engine.optimizer.state_dict()
    assert state and all(".lora_" in k for k in state)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert all(float(p.detach().abs().max()) > 0 for n, p in adapter_parameters(model).items() if "lora_B" in n)


def _batch(ids, pos, lens):
    from polyrl.data.batch import PackedBatch

    labels = ids.clone()
    labels[:-1] = ids[1:]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    labels[(cu[1:] - 1).long()] = -100
    return PackedBatch(
        input_ids=ids, labels=labels, position_ids=pos, cu_seqlens=cu, max_seqlen=max(lens),
        num_target_tokens=int((labels != -100).sum()),
    )  # fmt: skip


def test_apply_twice_or_to_wrong_model_is_refused(tiny_model):
    model = tiny_model("qwen3")
    apply_lora(model, LoraConfig(r=2))
    with pytest.raises(ConfigError, match="already has LoRA"):
        apply_lora(model, LoraConfig(r=2))
    with pytest.raises(ConfigError, match="model.layers"):
        apply_lora(torch.nn.Linear(3, 3), LoraConfig(r=2))


def test_qlora_base_is_nf4_and_matches_the_dequantized_model(tiny_model):
    from polyrl.errors import UserError
    from polyrl.kernels.nf4.reference import dequantize_nf4

    torch.manual_seed(0)
    model = tiny_model("qwen2")  # qkv biases: the bias stays beside the NF4 weight
    ids, pos, meta = packed([7, 5], model.config.vocab_size)
    apply_lora(model, LoraConfig(r=4, alpha=8, quantize_base="nf4"))
    _randomize_adapters(model)
    layer = model.model.layers[0].self_attn.q_proj
    assert "weight" not in dict(layer.named_parameters(recurse=False)) and layer.bias is not None
    assert layer.weight_nf4.dtype == torch.uint8 and layer.weight_nf4.shape == (64, 32)
    assert not any(".lora_" not in n for n, p in model.named_parameters() if p.requires_grad)
    got = logits(model, ids, pos, meta)
    # the same network with each targeted weight replaced by its dequantized NF4 value (dense fp32 LoRA layers)
    dense = tiny_model("qwen2")
    state = merged_state_dict(model, torch.float32)
    dense.load_state_dict(state)
    assert (logits(dense, ids, pos, meta) - got).abs().max().item() < 1e-5
    w = dequantize_nf4(layer.weight_nf4, layer.weight_absmax, layer.quant_shape)
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], w + layer.delta())
    with pytest.raises(UserError, match="4-bit"):
        merge_lora(model)
    hidden = model(ids, pos, meta)
    hidden.square().mean().backward()
    assert layer.lora_A.weight.grad is not None and layer.lora_A.weight.grad.abs().max() > 0
