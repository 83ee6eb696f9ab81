"""Fused q/k/v and gate/up projections (``polyrl/infer/fused_projections.py``, ``RolloutConfig.fuse_projections``) on
the CPU in fp32: the engine's greedy tokens and log-probs equal the unfused engine's across the decoder families
(biases, no q/k norm, OLMoE's projection-wide q/k norm, a Qwen2-MoE shared expert), the copies follow weight updates
(the RL sync signal), release / reallocate, batch-1 stays on the decoder's own path, LoRA-wrapped modules and MoE
routed experts are left alone, and the copies' bytes. The Triton consumers' strided-view cases are in
tests/kernels (rope, swiglu, qk_norm_rope, write_kv_cache); the GPU test at the end runs them in a graph-captured
bf16 decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from polyrl.errors import ConfigError
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.infer.fused_projections import FusedProjections
from polyrl.models import build_model, preset_config
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import MLP, Attention, init_weights

from .conftest import tiny_config

# HF config dicts of the families whose projections differ (tests/models/test_moe_model.py builds the same ones)
HF_BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6,
    rope_theta=10000.0,
)  # fmt: skip
FAMILIES = {
    "qwen3": lambda: tiny_config(),
    "qwen2-bias": lambda: tiny_config("qwen2", attention_bias=True),  # q/k/v biases
    "llama": lambda: tiny_config("llama"),  # no q/k norm: apply_rope on the slices
    # q/k norm over the whole projection (rmsnorm on strided rows); MoE layers
    "olmoe": lambda: ModelConfig.from_hf_dict(
        dict(HF_BASE, model_type="olmoe", num_experts=4, num_experts_per_tok=2, head_dim=None)
    ),
    # a shared expert (a dense MLP inside the MoE block) and q/k/v biases; layer 0 dense
    "qwen2_moe": lambda: ModelConfig.from_hf_dict(
        dict(
            HF_BASE,
            model_type="qwen2_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            decoder_sparse_step=2,
        )
    ),
}


def _model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    return init_weights(build_model(cfg, dtype=torch.float32, seed=seed), seed=seed, std=0.2).eval()


def _prompts(count: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 14, (count,), generator=g)]


def _engine(model, fuse: bool, **over) -> LLM:
    return LLM(model, None, RolloutConfig(num_blocks=128, block_size=4, fuse_projections=fuse, **over))


def _greedy(llm: LLM, prompts, n: int = 12):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


def _assert_same(a, b) -> None:
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    diff = max((torch.tensor(la) - torch.tensor(lb)).abs().max().item() for (_, la), (_, lb) in zip(a, b))
    assert diff <= 1e-5, diff


class _Counting:
    """Counts the override's answers on a ``FusedProjections``: fused outputs and Nones, with the row counts."""

    def __init__(self, monkeypatch) -> None:
        self.fused_rows: list[int] = []
        self.declined_rows: list[int] = []
        inner = FusedProjections.project

        def project(copies, linears, x):
            out = inner(copies, linears, x)
            (self.declined_rows if out is None else self.fused_rows).append(x.shape[0])
            return out

        monkeypatch.setattr(FusedProjections, "project", project)


def test_config_is_validated_and_fp8_takes_precedence(monkeypatch):
    assert RolloutConfig().fuse_projections is False
    assert RolloutConfig(fuse_projections=True).fuse_projections is True
    with pytest.raises(ConfigError, match="fuse_projections"):
        RolloutConfig(fuse_projections="yes")
    cfg = RolloutConfig(num_blocks=64, block_size=4, fuse_projections=True, weight_precision="fp8")
    monkeypatch.setenv("POLYRL_KERNELS", "fp8_weight_linear:reference")
    llm = LLM(_model(tiny_config(hidden_size=64, intermediate_size=128, head_dim=16)), None, cfg)
    # no bf16 copies under FP8 weights: the FP8 copies fuse their own groups (tests/infer/test_fp8_weights.py)
    assert llm.runner.fp8 is not None and llm.runner.fused is None and llm.runner.fp8.groups
    assert llm.runner.weight_copies is llm.runner.fp8


def test_copies_are_the_concatenated_weights_and_their_bytes_are_reported():
    model = _model(tiny_config("qwen2", attention_bias=True))  # q/k/v with biases
    llm = _engine(model, True)
    fused = llm.runner.fused
    layers = model.model.layers
    assert list(fused.entries) == [
        g
        for layer in layers
        for g in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                  (layer.mlp.gate_proj, layer.mlp.up_proj))
    ]  # fmt: skip
    attn = layers[0].self_attn
    w, b = fused.entries[(attn.q_proj, attn.k_proj, attn.v_proj)]
    assert w.shape == (32 + 16 + 16, 32) and torch.equal(w, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                                        attn.v_proj.weight]))  # fmt: skip
    assert torch.equal(b, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    mlp = layers[0].mlp
    assert fused.entries[(mlp.gate_proj, mlp.up_proj)][1] is None  # no MLP biases
    # per layer: q/k/v weights (64 x 32) + biases (64) and gate/up (2 x 64 x 32), fp32
    assert fused.nbytes == 2 * (64 * 32 + 64 + 128 * 32) * 4
    assert _engine(model, False).runner.fused is None


def test_copies_exist_before_the_kv_cache_is_sized(monkeypatch):
    """On an accelerator the cache takes what is free when it is sized: the copies must already hold their memory."""
    from polyrl.infer import llm as llm_mod

    order: list[str] = []
    made, sized = FusedProjections.__init__, llm_mod.KVCache._size
    monkeypatch.setattr(FusedProjections, "__init__", lambda s, m: order.append("copies") or made(s, m))
    monkeypatch.setattr(llm_mod.KVCache, "_size", lambda s, *a: order.append("kv sized") or sized(s, *a))
    _engine(_model(tiny_config()), True)
    assert order == ["copies", "kv sized"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_and_logprobs_equal_the_unfused_engine(family, monkeypatch):
    model = _model(FAMILIES[family]())
    prompts = _prompts()
    plain = _greedy(_engine(model, False), prompts)
    count = _Counting(monkeypatch)
    llm = _engine(model, True)
    fused = _greedy(llm, prompts)
    _assert_same(plain, fused)
    groups = llm.runner.fused.entries
    attn = sum(isinstance(m, Attention) for m in model.modules())
    mlps = sum(isinstance(m, MLP) for m in model.modules())  # dense MLPs, a shared expert included
    assert len(groups) == attn + mlps
    assert len(count.fused_rows) >= len(groups) * 4  # several multi-row steps really ran fused
    assert all(rows > 1 for rows in count.fused_rows)


def test_unfused_qk_norm_path_takes_the_slices_too(monkeypatch):
    """With DecoderOptions.fused_qk_norm_rope off the per-head rmsnorm reads the q/k slices (and copies them)."""
    model = _model(tiny_config())
    model.options = dataclasses.replace(model.options, fused_qk_norm_rope=False)
    prompts = _prompts(4)
    _assert_same(_greedy(_engine(model, False), prompts), _greedy(_engine(model, True), prompts))


def test_batch1_decode_stays_on_the_decoders_path(monkeypatch):
    model = _model(tiny_config())
    llm = _engine(model, True)
    count = _Counting(monkeypatch)
    n = 6
    plain = _greedy(_engine(model, False), _prompts(1), n)
    got = _greedy(llm, _prompts(1), n)
    _assert_same(plain, got)
    groups = len(llm.runner.fused.entries)
    # the prompt's prefill (several rows) is fused; every one-row decode step declines, back to the decoder's own
    # path (kernels.skinny_linear on the GPU)
    assert count.fused_rows == [len(_prompts(1)[0])] * groups
    assert count.declined_rows.count(1) >= (n - 1) * groups
    group = next(iter(llm.runner.fused.entries))
    with torch.no_grad():
        assert llm.runner.fused.project(group, torch.randn(1, 32)) is None
        q, k, v = llm.runner.fused.project(group, torch.randn(3, 32))
        assert q.shape == (3, 32) and k.shape == v.shape == (3, 16) and q.stride() == (64, 1)  # column-slice views
        assert llm.runner.fused.project(group[:2], torch.randn(3, 32)) is None  # not a fused group
    assert llm.runner.fused.project(group, torch.randn(3, 32)) is None  # autograd on: the modules' own path


def test_copies_follow_a_weight_update_after_the_sync_signal():
    model = _model(tiny_config())
    llm = _engine(model, True)
    prompts = _prompts(4)
    before = _greedy(llm, prompts)
    group = next(iter(llm.runner.fused.entries))
    w = llm.runner.fused.entries[group][0]
    with torch.no_grad():  # an optimizer step: in place, as the colocated trainer updates the shared tensors
        for lin in (lin for g in llm.runner.fused.entries for lin in g):  # the fused weights only
            lin.weight.add_(torch.randn_like(lin.weight), alpha=0.2)
    _assert_same(_greedy(llm, prompts), before)  # no signal yet: the old copies (and the prefix cache)
    assert llm.runner.fused.refreshes == 0
    llm.reset_prefix_cache()  # what ColocatedPolicy.step / sync_rollout_weights / load call after every update
    after = _greedy(llm, prompts)
    _assert_same(after, _greedy(_engine(model, False), prompts))
    assert [ids for ids, _ in after] != [ids for ids, _ in before]  # the update changed the tokens
    assert llm.runner.fused.entries[group][0] is w  # rewritten in place: captured graphs keep their addresses
    assert torch.equal(w, torch.cat([lin.weight for lin in group]))
    assert llm.runner.fused.refreshes == 1


def test_release_frees_the_copies_and_the_next_rollout_remakes_them():
    model = _model(tiny_config())
    llm = _engine(model, True)
    held = llm.runner.fused.nbytes
    prompts = _prompts(3)
    before = _greedy(llm, prompts)
    llm.release()
    assert llm.runner.fused.nbytes == 0
    llm.reallocate()
    after = _greedy(llm, prompts)
    _assert_same(after, before)
    assert llm.runner.fused.nbytes == held
    assert not any(w.is_inference() for w, _ in llm.runner.fused.entries.values())  # remade inside generate()


def test_lora_wrapped_groups_are_left_alone():
    from polyrl.models.lora import LoraConfig, apply_lora

    model = apply_lora(_model(tiny_config()), LoraConfig(r=4, alpha=8.0, targets=["q", "v"]), seed=0).eval()
    llm = _engine(model, True)
    groups = llm.runner.fused.entries
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)  # only the MLPs' gate/up: q and v are wrapped
    assert all(type(lin) is nn.Linear for g in groups for lin in g)
    prompts = _prompts(4)
    _assert_same(_greedy(_engine(model, False), prompts), _greedy(llm, prompts))


def test_adapters_attached_later_drop_their_groups():
    model = _model(tiny_config())
    fused = FusedProjections(model)
    assert len(fused.entries) == 4
    attn = model.model.layers[0].self_attn
    attn.k_proj = _Wrapper(attn.k_proj)  # as attach_adapters swaps a module for its wrapper (LLM.load_adapters prunes)
    assert fused.prune(model) == 1 and len(fused.entries) == 3
    assert all(attn.q_proj not in g for g in fused.entries)


class _Wrapper(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias, self.out_features = base.weight, base.bias, base.out_features


def test_moe_routed_experts_are_left_alone():
    model = build_model(preset_config("tiny-moe"), seed=3).eval()
    llm = _engine(model, True)
    groups = llm.runner.fused.entries
    n_layers = model.config.num_layers
    assert len(groups) == n_layers and all(len(g) == 3 for g in groups)  # attention only: every layer's MLP is MoE
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 2000, (int(n),), generator=g).tolist() for n in (5, 9, 3, 12)]
    _assert_same(_greedy(_engine(model, False), prompts), _greedy(llm, prompts))


@pytest.mark.gpu
def test_graph_captured_fused_decode_agrees_with_unfused_on_the_gpu():
    """bf16 with CUDA graphs (the Triton rope / qk-norm / KV-write / SwiGLU kernels on the slices): fused and unfused
    greedy decode of a random model agree but for bf16 near-ties (a wider GEMM may sum in another order): up to a
    sequence's first differing token, and at it, the two engines' log-probs are within tests/infer/test_gpu.py's bf16
    bound (a differing token had a log-prob as high as the other's: a near-tie), and most sequences are equal."""
    from polyrl.platform import device

    if not device.supports_graphs():
        pytest.skip("this accelerator has no CUDA graphs")
    model = build_model(
        tiny_config(hidden_size=256, intermediate_size=512, num_heads=4, head_dim=64, max_position_embeddings=512),
        dtype=torch.bfloat16, device=device.torch_device(), seed=0,
    ).eval()  # fmt: skip
    init_weights(model, seed=0, std=0.05)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 100, (37,), generator=g)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for fuse in (False, True):
        llm = LLM(model, None, RolloutConfig(block_size=16, num_blocks=512, max_num_seqs=64, fuse_projections=fuse))
        outs[fuse] = llm.generate(prompts, params)
        graphs = llm.runner.graphs
        assert llm.runner.use_graphs and graphs is not None and (graphs.graphs or graphs.launch_graphs)
        assert (llm.runner.fused is not None) == fuse
    same_seq = 0
    for a, b in zip(outs[False], outs[True]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta) - 1)  # the first differing token
        same_seq += ta == tb
        diff = (torch.tensor(a.outputs[0].logprobs[: k + 1]) - torch.tensor(b.outputs[0].logprobs[: k + 1])).abs()
        assert diff.max().item() <= 2e-2, (k, diff)
    assert same_seq >= 0.5 * len(prompts)
