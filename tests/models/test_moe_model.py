"""MoE families against transformers, fp32 on the CPU: logits parity of Qwen3-MoE / Qwen2-MoE / OLMoE / Mixtral both
ways through HF checkpoint folders (per-expert and fused layouts), packing, dense layers, the auxiliary losses against
transformers' ``load_balancing_loss_func``, routing record / replay, active-parameter FLOPs and config errors."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import hf_logits, logits, packed, randomize_
from safetensors import safe_open
from safetensors.torch import save_file

from polyrl.errors import CheckpointError, ConfigError
from polyrl.models import load_model, save_model
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import build_model
from polyrl.models.moe import Routing, load_balancing_loss, route, router_z_loss

transformers = pytest.importorskip("transformers")

LENS = [5, 13, 1, 9]
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
FAMILIES = {
    # layer 1 dense through mlp_only_layers; top-k renormalised
    "qwen3_moe": dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]
    ),  # fmt: skip
    # layers 0 and 2 dense through decoder_sparse_step=2; shared expert; q/k/v bias (qkv_bias defaults to true)
    "qwen2_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=2,
    ),  # fmt: skip
    # q/k norm over the projection; experts sized by intermediate_size; no renormalisation
    "olmoe": dict(num_experts=6, num_experts_per_tok=2, head_dim=None),
    # softmax -> top-k -> renormalised, fp32 weights; a sliding window shorter than the longest sequence
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, sliding_window=4),
}
ARCH = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def hf_dict(family: str, **overrides) -> dict:
    d = dict(BASE, model_type=family, **FAMILIES[family])
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not None}


def hf_model(family: str, seed: int = 1, **overrides):
    """transformers' own model class (eager attention, fp32), every tensor randomised."""
    hcfg = transformers.AutoConfig.for_model(**hf_dict(family, **overrides))
    model = getattr(transformers, ARCH[family])(hcfg)
    model.config._attn_implementation = "eager"
    return randomize_(model, seed).eval()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Each family: transformers' random model and the folder its ``save_pretrained`` wrote."""
    out = {}
    for family in FAMILIES:
        hf = hf_model(family)
        folder = tmp_path_factory.mktemp(family)
        hf.save_pretrained(str(folder))
        out[family] = (hf, folder)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_checkpoint_loads_with_logits_parity(hf_folders, family):
    hf, folder = hf_folders[family]
    ours = load_model(folder, dtype=torch.float32).eval()
    assert ours.config.model_type == family and ours.config.num_experts == 6
    ids, pos, meta = packed(LENS, BASE["vocab_size"])
    ref = hf_logits(hf, ids, LENS)
    got = logits(ours, ids, pos, meta)
    assert ref.abs().max() > 0.1
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_save_loads_in_transformers(hf_folders, tmp_path, family):
    _, folder = hf_folders[family]
    ours = load_model(folder, dtype=torch.float32).eval()
    save_model(ours, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == [ARCH[family]]
    keys = set(safe_open(str(tmp_path / "out" / "model.safetensors"), "pt").keys())
    gate, down = ("w1", "w2") if family == "mixtral" else ("gate_proj", "down_proj")
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    moe_layer = ours.config.moe_layers[0]
    assert f"model.layers.{moe_layer}.{block}.experts.5.{gate}.weight" in keys  # the hub's per-expert layout
    assert f"model.layers.{moe_layer}.{block}.experts.0.{down}.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager")
    assert type(back).__name__ == ARCH[family]
    ids, pos, meta = packed(LENS, BASE["vocab_size"], seed=4)
    ref = hf_logits(back.eval(), ids, LENS)
    assert (logits(ours, ids, pos, meta) - ref).abs().max().item() <= 1e-4
    # and our save round-trips into ourselves bit for bit
    again = load_model(tmp_path / "out", dtype=torch.float32)
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_fused_layout_and_sharded_index_load(hf_folders, tmp_path):
    """A folder in the fused (transformers 5 in-memory) layout, split over two shards with an index, loads too."""
    hf, _ = hf_folders["qwen3_moe"]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    names = sorted(state)
    half = len(names) // 2
    folder = tmp_path / "fused"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        fname = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(folder / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf_dict("qwen3_moe")))
    ours = load_model(folder, dtype=torch.float32).eval()
    ids, pos, meta = packed(LENS, BASE["vocab_size"])
    assert (logits(ours, ids, pos, meta) - hf_logits(hf, ids, LENS)).abs().max().item() <= 1e-4


def test_missing_expert_is_named(hf_folders, tmp_path):
    _, folder = hf_folders["mixtral"]
    f = safe_open(str(folder / "model.safetensors"), "pt")
    state = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.block_sparse_moe.experts.3.w3.weight"}
    out = tmp_path / "broken"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight"):
        load_model(out)


def _ours(family: str, seed: int = 1, **overrides):
    cfg = ModelConfig.from_hf_dict(hf_dict(family, **overrides))
    model = build_model(cfg, init=False)
    return randomize_(model, seed).eval()


def test_config_round_trips_through_hf_dict():
    for family in FAMILIES:
        cfg = ModelConfig.from_hf_dict(hf_dict(family, router_aux_loss_coef=0.02, output_router_logits=True))
        again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
        assert again == cfg, family
        hcfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
        assert hcfg.num_experts_per_tok == 2 and hcfg.router_aux_loss_coef == 0.02 and hcfg.output_router_logits
    q2 = ModelConfig.from_hf_dict(hf_dict("qwen2_moe"))
    assert q2.attention_bias and not q2.o_bias and q2.moe_layers == [1] and q2.shared_expert_intermediate_size == 24
    assert ModelConfig.from_hf_dict(hf_dict("qwen2_moe", qkv_bias=False)).attention_bias is False
    mx = ModelConfig.from_hf_dict(hf_dict("mixtral"))
    assert mx.norm_topk_prob and mx.moe_intermediate_size == 48 and mx.to_hf_dict()["num_local_experts"] == 6
    assert ModelConfig.from_hf_dict(hf_dict("qwen3_moe")).moe_layers == [0, 2]


@pytest.mark.parametrize(
    "family,overrides,match",
    [
        ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("qwen3_moe", dict(num_experts_per_tok=7), "num_experts_per_tok"),
        ("qwen3_moe", dict(mlp_only_layers=[5]), "mlp_only_layers"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
        # 0 was read as 1 (every layer sparse); transformers divides by it (ZeroDivisionError when it builds the model)
        ("qwen3_moe", dict(decoder_sparse_step=0), r"decoder_sparse_step must be an integer >= 1, got 0"),
    ],
)
def test_unsupported_options_raise_clear_errors(family, overrides, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(hf_dict(family, **overrides))


def test_packed_equals_per_sequence():
    model = _ours("qwen2_moe", seed=3)
    ids, pos, meta = packed(LENS, BASE["vocab_size"], seed=2)
    together = logits(model, ids, pos, meta)
    start = 0
    for n in LENS:
        alone = logits(model, ids[start : start + n], pos[start : start + n], AttnMetadata.from_seqlens([n]))
        torch.testing.assert_close(together[start : start + n], alone, rtol=0, atol=1e-5)
        start += n


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_aux_loss_equals_transformers(family):
    """Our record -> load_balancing_loss equals transformers' on its own router logits (same weights), and
    HF's loss with labels adds router_aux_loss_coef * aux."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = hf_model(family, output_router_logits=True)
    ours = build_model(ModelConfig.from_hf_dict(hf_dict(family)), init=False)
    ours.load_state_dict(hf.state_dict())
    ids, pos, meta = packed([11], BASE["vocab_size"], seed=5)
    routing = Routing()
    with torch.no_grad():
        ours(ids, pos, meta, routing=routing)
        out = hf(ids[None], output_router_logits=True)
    layers = ours.config.moe_layers
    assert routing.layers == layers
    ref = load_balancing_loss_func(out.router_logits, 6, 2)
    got = load_balancing_loss(routing, 6)
    assert ref > 0.5 and abs(got.item() - ref.item()) <= 1e-5
    for i, layer in enumerate(layers):  # the same logits as HF's, layer by layer
        torch.testing.assert_close(routing.router_logits[layer], out.router_logits[i], rtol=0, atol=1e-5)
    z = router_z_loss(routing)
    manual = torch.cat([torch.logsumexp(out.router_logits[i], -1) ** 2 for i in range(len(layers))]).mean()
    assert abs(z.item() - manual.item()) <= 1e-5


def test_replay_of_own_routing_is_identical_and_other_routing_is_not():
    model = _ours("qwen3_moe", seed=2)
    ids, pos, meta = packed(LENS, BASE["vocab_size"], seed=6)
    rec = Routing(record=True)
    with torch.no_grad():
        h = model(ids, pos, meta, routing=rec)
        same = model(ids, pos, meta, routing=Routing(replay=dict(rec.topk_ids)))
        other = {layer: (t + 1) % 6 for layer, t in rec.topk_ids.items()}
        changed = model(ids, pos, meta, routing=Routing(replay=other))
    assert set(rec.topk_ids) == {0, 2} and rec.topk_ids[0].shape == (sum(LENS), 2)
    assert torch.equal(h, same)
    assert (changed - h).abs().max() > 1e-3


def test_replay_weights_renormalise_over_forced_experts():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, 2, True, False)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w.sum(-1), torch.ones(1))
    w2, ids2 = route(logits, 2, True, False, replay_ids=torch.tensor([[3, 2]]))
    p = torch.softmax(logits, -1)[0]
    assert ids2.tolist() == [[3, 2]]
    torch.testing.assert_close(w2[0], torch.stack([p[3], p[2]]) / (p[3] + p[2]))
    w3, _ = route(logits, 2, False, False, replay_ids=torch.tensor([[3, 2]]))  # no renormalisation: raw probs
    torch.testing.assert_close(w3[0], torch.stack([p[3], p[2]]))


def test_replay_of_wrong_length_is_a_clear_error():
    model = _ours("qwen3_moe")
    ids, pos, meta = packed([4], BASE["vocab_size"])
    with pytest.raises(Exception, match="tokens"):
        model(ids, pos, meta, routing=Routing(replay={0: torch.zeros(3, 2, dtype=torch.long), 2: None}))


def test_checkpointing_records_once_with_equal_gradients():
    """Activation checkpointing recomputes MoE layers in backward; the record holds each layer once, and the
    gradients (loss + aux loss through the recorded logits) equal the plain forward's."""
    grads = []
    for ckpt in (False, True):
        model = _ours("qwen3_moe", seed=4).train()
        model.gradient_checkpointing = ckpt
        ids, pos, meta = packed(LENS, BASE["vocab_size"], seed=7)
        routing = Routing()
        h = model(ids, pos, meta, routing=routing)
        loss = model.compute_logits(h).logsumexp(-1).mean() + 0.1 * load_balancing_loss(routing, 6)
        loss.backward()
        assert {k: v.shape[0] for k, v in routing.router_logits.items()} == {0: sum(LENS), 2: sum(LENS)}
        assert {k: v.shape[0] for k, v in routing.topk_ids.items()} == {0: sum(LENS), 2: sum(LENS)}
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0]["model.layers.0.mlp.gate.weight"].abs().max() > 0
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_active_parameters_and_flops_count_k_experts():
    model = _ours("qwen2_moe")
    cfg = model.config
    total = model.num_parameters()
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert model.active_parameters() == total - len(cfg.moe_layers) * (6 - 2) * per_expert
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == len(cfg.moe_layers) * 6 * per_expert
    embed = cfg.vocab_size * cfg.hidden_size  # untied: the input embedding is a lookup, no FLOPs
    assert model.flops_per_token(10) == 6.0 * (model.active_parameters() - embed) + 6.0 * 3 * 10 * 4 * 8
    dense = build_model(ModelConfig.from_hf_dict(dict(BASE, model_type="qwen3")), init=False)
    assert dense.active_parameters() == dense.num_parameters()


def test_mfu_matches_the_issue_baseline_numbers():
    """Issue 32 measured transformers at qwen3-30b-a3b-L8, 4 x 4096 tokens on an H200 (989 TFLOP/s): eager 8.0k
    tokens/s = 4.4% MFU, grouped_mm 43.4k = 23.7%, + Liger 60.1k = 32.8%, counting q/k/v/o, router, 8 routed
    experts, LM head and causal attention. Our flops_per_token gives the same percentages."""
    from polyrl.models import preset_config
    from polyrl.models.decoder import DecoderLM

    cfg = preset_config("qwen3-30b-a3b-L8")
    with torch.device("meta"):
        model = DecoderLM(cfg)
    assert round(model.num_parameters() / 1e9, 2) == 5.61 and round(model.active_parameters() / 1e9, 2) == 1.08
    fpt = model.flops_per_token(4096)
    for tokens_per_s, mfu in ((8.0e3, 4.4), (43.4e3, 23.7), (60.1e3, 32.8)):
        assert round(100 * fpt * tokens_per_s / 989e12, 1) == mfu
    full = preset_config("qwen3-30b-a3b")
    with torch.device("meta"):
        full_model = DecoderLM(full)
    assert round(full_model.num_parameters() / 1e9, 1) == 30.5 and round(full_model.active_parameters() / 1e9, 1) == 3.4


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
def test_paged_decode_steps_match_varlen(family):
    """The rollout engine's path (paged KV, chunked prefill + decode steps; Qwen3-MoE's fused q/k-norm + RoPE under
    no_grad) gives the packed forward's logits: routing is per token, so a token routes alike in both."""
    from test_paged_decode import BLOCK_TABLES, STEPS, _caches, _step_inputs

    model = _ours(family, seed=5, sliding_window=5 if family == "mixtral" else None)
    total = [sum(s[b] for s in STEPS) for b in range(2)]
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, BASE["vocab_size"], (n,), generator=gen) for n in total]
    full = [logits(model, t, torch.arange(len(t)), AttnMetadata.from_seqlens([len(t)])) for t in tokens]
    caches = _caches(model.config, num_blocks=int(BLOCK_TABLES.max()) + 1)
    done = [0, 0]
    for new in STEPS:
        ids, pos, meta = _step_inputs(tokens, done, new, caches)
        want = torch.cat([full[b][done[b] : done[b] + new[b]] for b in range(2)])
        torch.testing.assert_close(logits(model, ids, pos, meta), want, rtol=0, atol=1e-5)
        done = [d + n for d, n in zip(done, new)]


# config.json of released MoE checkpoints (Qwen3-30B-A3B, Mixtral-8x7B-v0.1, OLMoE-1B-7B-0924, Qwen1.5-MoE-A2.7B) ->
# (total, active) parameters in billions as their model cards give them.
HUB_CONFIGS = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "olmoe": {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "eos_token_id": 50279,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 50304,
    },
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "model_type": "qwen2_moe",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
}
PUBLISHED = {"qwen3_moe": (30.5, 3.3), "mixtral": (46.7, 12.9), "olmoe": (6.9, 1.3), "qwen2_moe": (14.3, 2.7)}


@pytest.mark.parametrize("family", list(HUB_CONFIGS))
def test_released_configs_parse_with_published_parameter_counts(family):
    from polyrl.models.decoder import DecoderLM

    cfg = ModelConfig.from_hf_dict(HUB_CONFIGS[family])
    with torch.device("meta"):
        model = DecoderLM(cfg)
    total, active = PUBLISHED[family]
    assert abs(model.num_parameters() / 1e9 - total) < 0.06  # model cards round (or cut: "3.3B" for 3.35B)
    assert abs(model.active_parameters() / 1e9 - active) < 0.06
    assert cfg.sliding_window is None and not cfg.extra.get("num_experts")
    back = cfg.to_hf_dict()
    for key in ("num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"):
        assert back[key] == HUB_CONFIGS[family][key], key
