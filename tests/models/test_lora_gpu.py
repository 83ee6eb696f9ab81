"""LoRA on an accelerator (run on the H200): the frozen base stays bf16 with no optimizer state while adapters get
fp32 masters; rollouts with CUDA graphs run base + adapter (unmerged) and, with ``merge_for_rollout``, on merged
weights, and in both cases the graph-replayed log-probs agree with an eager recompute; QLoRA trains on the device."""

from __future__ import annotations

import pytest
import torch

from polyrl.models.checkpoint import load_tokenizer
from polyrl.models.lora import LoraConfig, adapter_parameters, adapters_disabled, load_lora_model

pytestmark = pytest.mark.gpu


def _batch(vocab, lens, dev, seed=0):
    from polyrl.data import TokenizedSeq, pack_sequences

    g = torch.Generator().manual_seed(seed)
    seqs = [TokenizedSeq(torch.randint(0, vocab, (n,), generator=g).tolist(), [1] * n) for n in lens]
    return pack_sequences(seqs).to(dev)


def _randomize(model, scale=0.05):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_((scale * torch.randn(p.shape, generator=g)).to(p.device, p.dtype))


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_bf16_base_frozen_adapters_mastered(tiny_model_dir, quantize):
    from polyrl.platform import device
    from polyrl.train import OptimConfig, PrecisionConfig, TrainEngine

    dev = device.torch_device()
    model = load_lora_model(tiny_model_dir, LoraConfig(r=8, alpha=16, quantize_base=quantize), torch.bfloat16, dev)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen.values())
    engine = TrainEngine(model, OptimConfig(lr=1e-3), precision=PrecisionConfig("bf16"), total_steps=3)
    assert engine.compute_dtype == torch.bfloat16
    assert set(engine.optimizer.names) == set(adapter_parameters(model))
    assert all(m.dtype == torch.float32 for m in engine.optimizer.masters)
    assert all(p.dtype == torch.bfloat16 for p in adapter_parameters(model).values())
    batch = _batch(model.config.vocab_size, [200, 57, 300], dev)
    losses = [engine.step([batch]).loss for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


@pytest.mark.parametrize("merge", [False, True])
def test_rollout_with_cuda_graphs_unmerged_and_merged(tiny_model_dir, merge):
    from polyrl.infer import RolloutConfig, SamplingParams
    from polyrl.platform import device
    from polyrl.run.colocated import ColocatedPolicy
    from polyrl.train import OptimConfig

    if not device.supports_graphs():
        pytest.skip("this accelerator has no CUDA graphs")
    dev = device.torch_device()
    model = load_lora_model(tiny_model_dir, LoraConfig(r=8, alpha=16, merge_for_rollout=merge), torch.bfloat16, dev)
    _randomize(model)
    tok = load_tokenizer(tiny_model_dir)
    rollout = RolloutConfig(block_size=16, num_blocks=256, max_num_seqs=16, cuda_graphs=True)
    pol = ColocatedPolicy(model, tok, OptimConfig(lr=1e-3), rollout=rollout, total_steps=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]] * 4
    samples = pol.rollout(prompts, n=2, sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=0))
    assert pol.llm.runner.graph_capture_s > 0  # decode steps ran in captured graphs
    lp, _ = pol.logprobs(samples)  # eager, unmerged
    with adapters_disabled(model):
        lp_base, _ = pol.logprobs(samples)
    gap = max((torch.tensor(s.logprobs) - a).abs().max().item() for s, a in zip(samples, lp))
    adapter_effect = max((a - b).abs().max().item() for a, b in zip(lp, lp_base))
    # the graphs computed base + adapter once (not twice, not zero times): bf16 noise only
    assert gap < 0.1 < adapter_effect, (gap, adapter_effect)
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n  # merged rollouts restore the base bit for bit
