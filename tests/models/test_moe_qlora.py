"""QLoRA on MoE models with the routed experts in NF4 (``polyrl/models/lora/nf4_experts.py``), on the CPU with the
tiny-moe preset: the NF4 experts' forward equals the op on the dequantized stack and stays within the NF4 error of
the full-precision model, the recomputing backward gives the plain op's gradients (and activation checkpointing the
same ones), training moves the adapters only and lowers the loss (in process and through ``polyrl train --qlora``),
the adapter round-trips, merged state dicts / unwrap dequantize, a colocated rollout runs on the NF4 experts, the
expert bytes shrink 3.56x; plus one GPU test at Qwen3-30B-A3B's expert shape through the fast op."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from model_helpers import logits, packed

from polyrl import kernels
from polyrl.models import build_model, create_model_from_preset, preset_config
from polyrl.models.lora import (
    LoraConfig,
    LoraExperts,
    adapters_disabled,
    apply_lora,
    load_lora_model,
    merge_lora,
    merged_state_dict,
    save_adapter,
    unwrap_lora,
)
from polyrl.models.lora.nf4_experts import NF4Experts, _direct, expert_param_bytes
from polyrl.models.moe import Experts

LENS = [6, 9, 3]
QLORA = dict(r=4, alpha=8, targets=["q", "k", "v", "o"], target_parameters=["experts"], quantize_base="nf4")


def _model(seed: int = 3, **overrides):
    cfg = preset_config("tiny-moe")
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    return build_model(cfg, seed=seed)


def _randomize_adapters(model, seed: int = 5, scale: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_qlora_puts_every_routed_expert_on_nf4():
    """Adapted experts keep their adapters on NF4 buffers; with attention-only targets the experts become
    ``NF4Experts``; nothing routed stays in full precision, the router does."""
    model = apply_lora(_model(), LoraConfig(**QLORA))
    for layer in model.model.layers:
        ex = layer.mlp.experts
        assert isinstance(ex, LoraExperts) and ex.quant_shape == {"gate_up_proj": (8, 64, 64), "down_proj": (8, 64, 32)}
        assert not hasattr(ex, "gate_up_proj") and ex.gate_up_proj_nf4.dtype == torch.uint8
        assert ex.gate_up_proj_nf4.shape == (8, 64, 32) and ex.down_proj_absmax.shape == (8, 64, 1)
        assert layer.mlp.gate.weight.dtype == torch.float32
    plain = apply_lora(_model(), LoraConfig(r=4, targets=["q", "v"], quantize_base="nf4"))
    assert all(isinstance(layer.mlp.experts, NF4Experts) for layer in plain.model.layers)
    dense = apply_lora(_model(), LoraConfig(r=4, targets=["q", "v"]))  # plain LoRA: experts untouched
    assert all(type(layer.mlp.experts) is Experts for layer in dense.model.layers)


@pytest.mark.parametrize("tokens", [3, 40])  # 3 x top-2 < 8 experts: the per-slot subset; 40: the whole stack
def test_nf4_experts_equal_the_op_on_the_dequantized_stack(tokens):
    base = _model().model.layers[0].mlp.experts
    nf4 = NF4Experts(base)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 64, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=gen)
    gu, dn = nf4.dequantized("gate_up_proj", torch.float32), nf4.dequantized("down_proj", torch.float32)
    want = kernels.moe_experts(x, ids, w, gu, dn)
    assert (nf4(x, ids, w) - want).abs().max().item() <= 1e-6
    # the dequantized stack is within NF4's bound of the original: |err| <= 0.1519 * block absmax (< max |w|)
    err = (gu - base.gate_up_proj).abs().max().item()
    assert 0 < err <= 0.1519 * base.gate_up_proj.abs().max().item()


def test_nf4_expert_logits_within_the_quantization_error():
    """Whole-model relative logit error against the full-precision model on the same data (fp32, tiny-moe), measured:
    NF4 attention only (the dense QLoRA base) 0.137 (the q/k norms amplify it), NF4 experts only 0.008, both 0.137.
    Asserted: the experts' error below 0.02 and below the dense QLoRA's, both together within the sum; and the QLoRA
    model equals the plain model on its dequantized (and merged) state dict exactly."""
    ref = _model()
    ids, pos, meta = packed(LENS, ref.config.vocab_size, seed=1)
    want = logits(ref.eval(), ids, pos, meta)
    attn_only = apply_lora(copy.deepcopy(ref), LoraConfig(r=4, targets=["q", "k", "v", "o"]))
    for layer in attn_only.model.layers:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, proj).quantize_nf4()
    err_dense = _rel(logits(attn_only.eval(), ids, pos, meta), want)
    experts_only = apply_lora(copy.deepcopy(ref), LoraConfig(r=4, targets=["experts"]))
    for layer in experts_only.model.layers:
        layer.mlp.experts.quantize_nf4()
    err_experts = _rel(logits(experts_only.eval(), ids, pos, meta), want)
    model = apply_lora(copy.deepcopy(ref), LoraConfig(**QLORA))
    fresh = logits(model.eval(), ids, pos, meta)  # B = 0: the NF4 base alone
    err_all = _rel(fresh, want)
    assert 0.001 < err_experts < min(0.02, err_dense), (err_experts, err_dense)
    assert err_all <= err_dense + err_experts, (err_all, err_dense, err_experts)
    _randomize_adapters(model)
    got = logits(model, ids, pos, meta)
    assert (got - fresh).abs().max().item() > 1e-3
    with adapters_disabled(model):  # the KL / DPO reference of a LoRA run: the NF4 base again
        assert torch.equal(logits(model, ids, pos, meta), fresh)
    plain = _model(seed=0)
    plain.load_state_dict(merged_state_dict(model, torch.float32))
    assert (logits(plain.eval(), ids, pos, meta) - got).abs().max().item() <= 1e-5


def test_recomputing_backward_matches_the_plain_op():
    """The NF4 experts' backward (forward without a graph, recomputed in backward) gives the gradients of the op
    run with autograd on the same dequantized, adapted weights: x, routing weights, A and B."""
    model = apply_lora(_model(), LoraConfig(**QLORA))
    _randomize_adapters(model)
    ex = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 64, generator=gen, requires_grad=True)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(20)])
    w = torch.rand(20, 2, generator=gen, requires_grad=True)
    dy = torch.randn(20, 64, generator=gen)
    params = [x, w, *ex.adapter_tensors()]
    y = ex(x, ids, w)
    # what lives until backward: x, ids, weights and the adapters, never an [E, N, K] stack or [T * k, 2I] rows
    saved = [tuple(t.shape) for t in y.grad_fn.saved_tensors]
    assert saved == [(20, 64), (20, 2), (20, 2), (32, 64), (64, 32), (32, 32), (64, 32)], saved
    got = torch.autograd.grad(y, params, dy)
    want = torch.autograd.grad(_direct(ex, x, ids, w), params, dy)
    for g, r in zip(got, want, strict=True):
        assert (g - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item())
    assert all(g.abs().sum() > 0 for g in got)


def test_activation_checkpointing_runs_the_plain_op_with_equal_gradients():
    """Under activation checkpointing (an outer saved-tensor hook) the experts run the plain op inside the layer's
    checkpoint instead of recomputing themselves; loss and adapter gradients equal the uncheckpointed run."""
    model = apply_lora(_model(), LoraConfig(**QLORA)).train()
    _randomize_adapters(model)
    ids, pos, meta = packed([7, 11], model.config.vocab_size, seed=5)

    def loss_and_grads():
        model.zero_grad()
        loss = model.compute_logits(model(ids, pos, meta)).logsumexp(-1).mean()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss0, g0 = loss_and_grads()
    model.gradient_checkpointing = True
    loss1, g1 = loss_and_grads()
    assert loss1 == pytest.approx(loss0, abs=1e-6) and sorted(g1) == sorted(g0)
    assert any("experts.lora_B" in n for n in g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-6, msg=name)


def test_qlora_moe_trains_the_adapters_only():
    """Ten AdamW steps on one batch of 44 tokens: the mean loss falls by at least 0.4 nat per token (measured 7.83 ->
    7.13), the gradients reach only ``lora_`` parameters (attention and experts' A and B), the NF4 buffers stay
    bit-equal."""
    model = apply_lora(_model(), LoraConfig(**QLORA)).train()
    ids, pos, meta = packed([24, 20], model.config.vocab_size, seed=2)
    labels = torch.roll(ids, -1)
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("_nf4", "_absmax"))}
    assert len(before) == 2 * 4 + 2 * 4 * 2  # per layer: q/k/v/o (nf4 + absmax) and the two expert tensors
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        hidden = model(ids, pos, meta)
        loss = kernels.linear_cross_entropy(hidden, model.lm_head_weight, labels) / labels.numel()
        loss.backward()
        if not losses:
            trained = sorted(n for n, p in model.named_parameters() if p.grad is not None)
            assert trained and all(".lora_" in n for n in trained)
            assert any("mlp.experts.lora_A.down_proj" in n for n in trained), trained
            assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "experts.lora_B" in n)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.4, losses
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers() if n in before)


def test_sft_cli_with_qlora_on_tiny_moe(tmp_path):
    """``polyrl train --algo sft --lora ...,experts --qlora`` on tiny-moe: 10 steps, the loss falls by at least 0.5
    (measured on the CPU: 7.65 -> 7.03), checkpoints and the final folder hold the adapter only, and a resume
    repeats the losses exactly."""
    from polyrl.cli.main import main

    model_dir = create_model_from_preset("tiny-moe", tmp_path / "tiny-moe", seed=0)
    out = tmp_path / "run"
    argv = ["train", "--algo", "sft", "--model", str(model_dir), "--data", "builtin:arithmetic?n=64", "--out", str(out)]
    argv += ["--max-steps", "10", "--micro-batch-tokens", "256", "--max-seq-len", "64", "--lr", "1e-2", "--qlora"]
    argv += ["--log-every", "1", "--lora", "r=4,alpha=8,targets=q,k,v,o,experts", "--set", "train.report_to=none"]
    argv += ["--save-every", "5", "--keep-last", "0", "--deterministic"]
    assert main(argv) == 0

    def losses(run):
        return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]

    first = losses(out)
    assert len(first) == 10 and first[-1] < first[0] - 0.5, first
    for folder in (out / "final", out / "checkpoints" / "step-00000005" / "model"):
        names = sorted(p.name for p in folder.iterdir())
        assert "adapter_model.safetensors" in names and "model.safetensors" not in names, names
    # resuming from step 5 re-quantizes the base the same way and repeats the losses bit for bit
    again = tmp_path / "again"
    shutil.copytree(out, again)
    ckpt = again / "checkpoints" / "step-00000005"
    assert main(["train", "--config", str(out / "run_config.json"), "--out", str(again), "--resume", str(ckpt)]) == 0
    assert losses(again) == first


def test_adapter_saves_and_reloads_with_equal_logits(tmp_path):
    """The saved folder holds adapters only (PEFT names, no NF4 tensor); loading it with ``quantize_base="nf4"``
    re-quantizes the same base the same way: logits bit-equal. ``merge`` refuses the NF4 base; unwrap dequantizes."""
    base_dir = create_model_from_preset("tiny-moe", tmp_path / "base", seed=0)
    model = load_lora_model(base_dir, LoraConfig(**QLORA), torch.float32)
    _randomize_adapters(model)
    ids, pos, meta = packed(LENS, model.config.vocab_size, seed=4)
    want = logits(model.eval(), ids, pos, meta)
    out = save_adapter(model, tmp_path / "adapter")
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in names
    again = load_lora_model(out, LoraConfig(r=4, quantize_base="nf4"), torch.float32)
    assert again.model.layers[0].mlp.experts.quant_shape is not None
    assert torch.equal(logits(again.eval(), ids, pos, meta), want)
    with pytest.raises(Exception, match="NF4"):
        merge_lora(again)
    unwrap_lora(again)
    ex = again.model.layers[0].mlp.experts
    assert type(ex) is Experts and ex.gate_up_proj.dtype == torch.bfloat16
    assert (logits(again.float(), ids, pos, meta) - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_expert_bytes_shrink_about_3_6x():
    """Per-expert-tensor bytes: bf16 2 per element, NF4 0.5 + 4/64 (absmax per 64-block) = 3.56x smaller when the
    contraction dim is a multiple of 64 (tiny-moe scaled to moe_intermediate_size=64; the preset's 32 pads).
    Qwen3-30B-A3B-L2 shape (computed): 2 MoE layers of 128 experts, H=2048, I=768."""
    model = _model(moe_intermediate_size=64).to(torch.bfloat16)
    bf16 = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    apply_lora(model, LoraConfig(r=4, targets=["q"], quantize_base="nf4"))
    nf4 = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".experts." in n)
    assert nf4 == 2 * expert_param_bytes(8, 64, 64, nf4=True) and bf16 == 2 * expert_param_bytes(8, 64, 64, nf4=False)
    assert bf16 / nf4 == pytest.approx(2 / 0.5625)
    # the FLOP count (MFU) sees the same active parameters whether the experts are Parameters or NF4 buffers
    plain = apply_lora(_model(), LoraConfig(r=4, targets=["experts"]))
    nf4_experts = apply_lora(_model(), LoraConfig(r=4, targets=["experts"], quantize_base="nf4"))
    assert nf4_experts.num_parameters() < plain.num_parameters()
    assert nf4_experts.active_parameters() == plain.active_parameters() > 0
    assert nf4_experts.flops_per_token(128) == plain.flops_per_token(128)
    layer_bf16, layer_nf4 = expert_param_bytes(128, 2048, 768, False), expert_param_bytes(128, 2048, 768, True)
    assert layer_bf16 == 1_207_959_552 and layer_nf4 == 339_738_624  # per layer: 1.125 GiB -> 0.316 GiB


def test_colocated_rollout_runs_on_the_nf4_experts(tmp_path):
    """Colocated RL as for a dense QLoRA model: the rollout engine samples from the very module being trained (NF4
    base + adapters, unmerged; ``merge_for_rollout`` is refused on an NF4 base as for dense layers), its greedy tokens
    equal those of a plain model holding the dequantized, merged weights, and a step moves only the adapters."""
    from polyrl.algorithms.rl_batch import completion_logprobs, pack_samples
    from polyrl.infer import SamplingParams
    from polyrl.models.checkpoint import load_model, load_tokenizer
    from polyrl.run.colocated import ColocatedPolicy
    from polyrl.train import OptimConfig

    base_dir = create_model_from_preset("tiny-moe", tmp_path / "base", seed=0)
    tok = load_tokenizer(base_dir)
    model = load_lora_model(base_dir, LoraConfig(**QLORA), torch.float32)
    _randomize_adapters(model, scale=0.05)
    plain = load_model(base_dir)
    plain.load_state_dict(merged_state_dict(model, torch.float32))
    greedy = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = [s.completion_ids for s in ColocatedPolicy(plain, tok, OptimConfig(lr=1e-2)).rollout(prompts, 1, greedy)]
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("_nf4", "_absmax"))}
    pol = ColocatedPolicy(model, tok, OptimConfig(lr=1e-2))
    samples = pol.rollout(prompts, n=1, sampling=greedy)
    assert [s.completion_ids for s in samples] == want

    def loss_fn(m, b):
        tl, _ = completion_logprobs(m, b, 1.0, False)
        return -(tl * b.mask).sum(), {}

    b0 = model.model.layers[0].mlp.experts.lora_B["down_proj"].detach().clone()
    pol.step(pack_samples(samples, max_tokens=256), loss_fn, normalizer=1.0)
    assert not torch.equal(model.model.layers[0].mlp.experts.lora_B["down_proj"], b0)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers() if n in before)


@pytest.mark.gpu
def test_nf4_experts_at_a_real_shape_on_the_accelerator():
    """H200: Qwen3-30B-A3B's expert shape (E=128, H=2048, I=768, top-8), 512 tokens in bf16, through the selected
    fast op (Triton) and the Triton dequantizer: forward equals the op on the dequantized adapted stack, decode-sized
    batches (per-slot subset) too, and the recomputing backward matches autograd through the op."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    e, h, i, k = 128, 2048, 768, 8
    base = Experts(e, h, i).to(dev, torch.bfloat16)
    base.reset_parameters(0.02, gen)
    lora = LoraExperts(base, ["gate_up_proj", "down_proj"], r=16, scaling=2.0)
    lora.reset_adapter(gen)
    with torch.no_grad():
        for p in lora.adapter_tensors():
            p.normal_(0, 0.01, generator=gen)
    lora.quantize_nf4()
    for p in lora.adapter_tensors():
        p.data = p.data.to(torch.bfloat16)
    for t in (512, 2):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=True)
        ids = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=-1).indices
        w = torch.rand(t, k, device=dev, generator=gen).softmax(-1).to(torch.bfloat16)
        gu, dn = lora.expert_weights(torch.bfloat16)
        want = kernels.moe_experts(x, ids, w, gu, dn)
        got = lora(x, ids, w)
        assert _rel(got.float(), want.float()) < 1e-2
        dy = torch.randn_like(got)
        params = [x, *lora.adapter_tensors()]
        g1 = torch.autograd.grad(got, params, dy)
        g2 = torch.autograd.grad(_direct(lora, x, ids, w), params, dy)
        for a, b in zip(g1, g2, strict=True):
            assert _rel(a.float(), b.float()) < 2e-2
