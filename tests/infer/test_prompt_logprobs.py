"""Prompt log-probs in the engine's prefill: equal to the training forward's log-probs (fp32 CPU, 1e-4) through
chunked prefill, paged KV, the prefix cache and preemption; top-k alternatives equal to a full log-softmax."""

from __future__ import annotations

import pytest
import torch

from polyrl.algorithms.rl_batch import Sample, completion_logprobs, pack_samples
from polyrl.errors import UserError
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.infer.prompt_logprobs import top_logprobs

from .test_engine import prompts


@torch.no_grad()
def trainer_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """The training forward's log-probs of prompt[1:] (a Sample whose completion is the rest of the prompt)."""
    (batch,) = pack_samples([Sample(prompt[:1], prompt[1:], [0.0] * (len(prompt) - 1), "length", "")])
    batch = batch.to(model.lm_head_weight.device)
    full, _ = completion_logprobs(model, batch)
    return full[batch.mask > 0]


def engine(model, **kw) -> LLM:
    cfg = dict(block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=16)
    cfg.update(kw)
    return LLM(model, None, RolloutConfig(**cfg))


def check_against_trainer(model, ps, outs, start: int = 1) -> float:
    worst = 0.0
    for p, o in zip(ps, outs):
        pl = o.prompt_logprobs
        assert pl is not None and len(pl.logprobs) == len(p) == len(pl.top_logprobs)
        assert all(x is None for x in pl.logprobs[:start]) and all(x is not None for x in pl.logprobs[start:])
        if len(p) > start:
            ref = trainer_logprobs(model, p)[start - 1 :]
            worst = max(worst, (torch.tensor(pl.logprobs[start:]) - ref).abs().max().item())
    return worst


def test_chunked_prefill_equals_training_forward(tiny_model):
    # 16 tokens per step, 4-token blocks: prompts of up to 60 tokens prefill over several chunks, in mixed batches
    # with requests that ask for nothing.
    llm = engine(tiny_model)
    ps = prompts(10, seed=11, lo=1, hi=60)
    params = [SamplingParams(max_tokens=3, prompt_logprobs=0 if i % 3 else None) for i in range(len(ps))]
    outs = llm.generate(ps, params)
    asked = [i for i in range(len(ps)) if i % 3]
    assert all(outs[i].prompt_logprobs is None for i in range(len(ps)) if i not in asked)
    worst = check_against_trainer(tiny_model, [ps[i] for i in asked], [outs[i] for i in asked])
    assert worst <= 1e-4, worst
    assert all(top == {} for i in asked for top in outs[i].prompt_logprobs.top_logprobs[1:])  # k = 0: no alternatives


@pytest.mark.parametrize("k", [1, 5])  # k = 1 takes the row maximum and builds one dict per row (its own path)
def test_top_k_alternatives_equal_full_log_softmax(tiny_model, k):
    llm = engine(tiny_model)
    (p,) = prompts(1, seed=12, lo=30, hi=31)
    (out,) = llm.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=k))
    ids = torch.tensor(p)
    from polyrl.models.attention_metadata import AttnMetadata

    with torch.no_grad():
        hidden = tiny_model(ids, torch.arange(len(p)), AttnMetadata.from_seqlens([len(p)]))
        full = torch.log_softmax(tiny_model.compute_logits(hidden), -1)  # [T, V]
    pl = out.prompt_logprobs
    assert pl.top_logprobs[0] is None
    for i in range(1, len(p)):
        top = pl.top_logprobs[i]
        assert len(top) == k
        want_v, want_i = full[i - 1].topk(k)
        assert sorted(top) == sorted(want_i.tolist())
        for tid, lp in top.items():
            assert lp == pytest.approx(full[i - 1, tid].item(), abs=1e-4)
        if p[i] in top:  # the token's own entry is the very number reported as its log-prob
            assert top[p[i]] == pl.logprobs[i]
        assert pl.ranks[i] == int((full[i - 1] > full[i - 1, p[i]]).sum()) + 1
        assert (pl.ranks[i] == 1) == (pl.logprobs[i] >= max(top.values()))  # an exact greedy test


def test_row_chunks_of_top_k_equal_one_shot(tiny_model, monkeypatch):
    from polyrl.infer import prompt_logprobs as mod

    h = torch.randn(37, tiny_model.config.hidden_size)
    w = tiny_model.lm_head_weight.detach()
    v1, i1, _, _ = top_logprobs(h, w, 3)
    monkeypatch.setattr(mod, "ROW_CHUNK_ELEMS", w.shape[0] * 5)  # 5 rows per chunk, a ragged last chunk
    v2, i2, _, _ = mod.top_logprobs(h, w, 3)
    assert torch.equal(i1, i2) and torch.allclose(v1, v2, atol=1e-6)
    full = torch.log_softmax(h @ w.t(), -1).topk(3)
    assert torch.allclose(v1, full.values, atol=1e-5)
    # the whole path in 5-row chunks (chosen tokens and top-k alike) still equals the training forward
    ps = prompts(3, seed=15, lo=20, hi=40)
    outs = engine(tiny_model, max_num_batched_tokens=64).generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert check_against_trainer(tiny_model, ps, outs) <= 1e-4


def test_prefix_cache_is_recomputed_for_scored_positions_only(tiny_model):
    llm = engine(tiny_model, max_num_batched_tokens=64)
    context = prompts(1, seed=13, lo=24, hi=25)[0]  # 6 full blocks
    ps = [context + c for c in prompts(4, seed=14, lo=2, hi=6)]
    llm.generate([context], SamplingParams(max_tokens=1))  # the context is now cached
    before = llm.block_manager.hit_tokens
    outs = llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=0))
    # every position is scored, so no cached block may be taken
    assert llm.block_manager.hit_tokens == before
    assert check_against_trainer(tiny_model, ps, outs) <= 1e-4
    # scoring only the continuation (a multiple-choice scorer): the context's blocks below it come from the cache
    start = len(context)
    before = llm.block_manager.hit_tokens
    outs = llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprobs_from=start))
    assert llm.block_manager.hit_tokens - before == 4 * 20  # blocks below position 23 (5 of 4 tokens), per prompt
    assert check_against_trainer(tiny_model, ps, outs, start=start) <= 1e-4


def test_preemption_keeps_prompt_logprobs_exact(tiny_model):
    # 24 blocks x 4 slots for up to 8 sequences of up to 60 tokens: preemption is forced mid-request.
    llm = engine(tiny_model, num_blocks=24, max_num_batched_tokens=32)
    ps = prompts(10, seed=2, lo=8, hi=40)
    outs = llm.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2))
    assert llm.stats()["num_preemptions"] > 0
    assert check_against_trainer(tiny_model, ps, outs) <= 1e-4


def test_n_samples_share_one_scoring_and_one_token_prompts(tiny_model):
    llm = engine(tiny_model)
    outs = llm.generate([[5], [5, 6, 7]], SamplingParams(n=3, max_tokens=2, prompt_logprobs=1, seed=0))
    assert outs[0].prompt_logprobs.logprobs == [None] and outs[0].prompt_logprobs.top_logprobs == [None]
    assert len(outs[1].prompt_logprobs.logprobs) == 3 and len(outs[1].outputs) == 3
    assert check_against_trainer(tiny_model, [[5, 6, 7]], outs[1:]) <= 1e-4


@pytest.mark.parametrize("bad", [dict(prompt_logprobs=-1), dict(prompt_logprobs=21), dict(prompt_logprobs_from=0)])
def test_bad_prompt_logprob_params_say_what_to_fix(bad):
    with pytest.raises(UserError, match="prompt_logprobs"):
        SamplingParams(**bad)
