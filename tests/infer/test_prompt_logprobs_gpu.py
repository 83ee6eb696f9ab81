"""On an accelerator: prompt log-probs equal the training forward's (fp32 tight, bf16 within the rollout/trainer
mismatch range), and a long prompt with top-k alternatives never holds its ``[T, V]`` logits."""

from __future__ import annotations

import pytest
import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.decoder import build_model, init_weights

from .conftest import tiny_config
from .test_prompt_logprobs import trainer_logprobs

pytestmark = pytest.mark.gpu


def _model(dtype, **over):
    from polyrl.platform import device

    cfg = tiny_config(max_position_embeddings=16384, head_dim=16, **over)
    model = build_model(cfg, dtype=dtype, device=device.torch_device(), seed=0)
    return init_weights(model, seed=0, std=0.2).eval()


@pytest.mark.parametrize("k", [1, 2])  # k = 1: the row maximum instead of topk (its own path)
@pytest.mark.parametrize("dtype,mean_tol,max_tol", [(torch.float32, 1e-4, 1e-3), (torch.bfloat16, 2e-2, 0.3)])
def test_prompt_logprobs_equal_training_forward(dtype, mean_tol, max_tol, k):
    model = _model(dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 300, (24,), generator=g)]
    llm = LLM(model, None, RolloutConfig(block_size=16, num_blocks=1024, max_num_batched_tokens=512))
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=k))
    diffs = []
    for p, o in zip(prompts, outs):
        ref = trainer_logprobs(model, p).float().cpu()
        pl = o.prompt_logprobs
        diffs.append((torch.tensor(pl.logprobs[1:]) - ref).abs())
        for i in range(1, len(p)):  # k alternatives, the best first; rank 1 exactly when the token is the best
            top = pl.top_logprobs[i]
            assert len(top) == k and pl.ranks[i] >= 1
            assert (pl.ranks[i] == 1) == (pl.logprobs[i] >= max(top.values()))  # ties: rank 1 too
    d = torch.cat(diffs)
    assert d.mean().item() <= mean_tol and d.max().item() <= max_tol, (d.mean().item(), d.max().item())


def test_long_prompt_top_k_never_holds_full_logits():
    from polyrl.platform import device

    vocab, t = 65536, 8192
    model = _model(torch.bfloat16, vocab_size=vocab)
    prompt = torch.randint(2, vocab, (t,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(model, None, RolloutConfig(block_size=16, num_blocks=1024, max_num_batched_tokens=t))
    llm.generate([prompt[:64]], SamplingParams(max_tokens=1, prompt_logprobs=5))  # warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5))
    peak = torch.cuda.max_memory_allocated() - before
    assert len(out.prompt_logprobs.logprobs) == t
    full = t * vocab * 4  # the [T, V] fp32 logits a naive implementation holds
    assert peak < full / 4, (peak, full, device.torch_device())
