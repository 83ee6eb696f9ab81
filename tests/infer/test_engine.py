"""The engine end to end on a tiny fp32 model: exact greedy parity with transformers (chunked prefill,
prefix sharing, forced preemption), log-probs equal to a full forward, seeds, streaming, release."""

from __future__ import annotations

import pytest
import torch

from polyrl.errors import UserError
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.attention_metadata import AttnMetadata

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts(count: int, seed: int, lo: int = 1, hi: int = 48, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(lo, hi, (1,), generator=g))
        out.append((prefix or []) + torch.randint(2, 96, (n,), generator=g).tolist())
    return out


def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def check_parity(hf, llm: LLM, ps: list[list[int]], n: int = 1) -> None:
    outs = llm.generate(ps, GREEDY.clone(n=n))
    for p, o in zip(ps, outs):
        want = hf_greedy(hf, p, GREEDY.max_tokens)
        assert o.num_prompt_tokens == len(p)
        assert len(o.outputs) == n
        for c in o.outputs:
            assert c.token_ids == want, (p, c.token_ids, want)
            assert c.finish_reason == "length"


@torch.no_grad()
def full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor(prompt + completion)
    hidden = model(ids, torch.arange(len(ids)), AttnMetadata.from_seqlens([len(ids)]))
    logits = model.compute_logits(hidden)[len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_greedy_matches_transformers_with_chunked_prefill(tiny_model, hf_model):
    # Budget 24 tokens/step: long prompts prefill in chunks beside other sequences' decodes.
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=24))
    check_parity(hf_model, llm, prompts(32, seed=0, hi=40))
    assert llm.stats()["num_preemptions"] == 0


def test_greedy_matches_transformers_with_prefix_sharing(tiny_model, hf_model):
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=64))
    system = prompts(1, seed=5, lo=20, hi=21)[0]
    ps = prompts(8, seed=1, lo=1, hi=12, prefix=system)
    check_parity(hf_model, llm, ps, n=3)
    stats = llm.stats()
    # 8 prompts x 3 samples share a 20-token system prompt (5 blocks): most prompt tokens are cache hits.
    assert stats["prefix_cache_hit_rate"] > 0.5, stats


def test_greedy_matches_transformers_under_forced_preemption(tiny_model, hf_model):
    # 24 blocks x 4 slots = 96 token slots for up to 8 sequences of up to 58 tokens: preemption is forced.
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=32))
    check_parity(hf_model, llm, prompts(10, seed=2, lo=8, hi=40))
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(tiny_model, temperature):
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=256, max_num_batched_tokens=16))
    ps = prompts(6, seed=3)
    outs = llm.generate(ps, SamplingParams(temperature=temperature, max_tokens=12, n=2, seed=7, ignore_eos=True))
    worst = 0.0
    for p, o in zip(ps, outs):
        for c in o.outputs:
            ref = full_forward_logprobs(tiny_model, p, c.token_ids, temperature)
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
            assert abs(c.cumulative_logprob - sum(c.logprobs)) < 1e-6
    assert worst <= 1e-4, worst


def test_seeded_requests_reproduce_regardless_of_batch(tiny_model):
    cfg = RolloutConfig(block_size=4, num_blocks=256, max_num_batched_tokens=16)
    p = prompts(1, seed=4)[0]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=11, n=2, ignore_eos=True)
    alone = LLM(tiny_model, None, cfg).generate([p], params)[0]
    crowd = LLM(tiny_model, None, cfg).generate(prompts(5, seed=9) + [p], [SamplingParams(max_tokens=7)] * 5 + [params])
    assert [c.token_ids for c in crowd[-1].outputs] == [c.token_ids for c in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # the n samples differ


def test_eos_stop_token_ids_min_tokens_ignore_eos(tiny_model):
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=256))
    p = prompts(1, seed=6, hi=20)[0]
    greedy = dict(temperature=0, max_tokens=20)
    full = llm.generate([p], SamplingParams(**greedy, ignore_eos=True))[0].outputs[0].token_ids
    eos, stop_tok = full[6], full[3]
    k_eos, k_stop = full.index(eos), full.index(stop_tok)
    llm.eos_token_ids = frozenset({eos})  # make a token greedy decoding reaches the model's EOS

    c = llm.generate([p], SamplingParams(**greedy))[0].outputs[0]
    assert c.token_ids == full[: k_eos + 1] and c.finish_reason == "stop" and c.stop_reason is None
    c = llm.generate([p], SamplingParams(**greedy, ignore_eos=True))[0].outputs[0]
    assert c.token_ids == full and c.finish_reason == "length"
    c = llm.generate([p], SamplingParams(**greedy, ignore_eos=True, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert c.token_ids == full[: k_stop + 1] and c.stop_reason == stop_tok
    # min_tokens: EOS is masked before the minimum (greedy then picks another token) and allowed after.
    m = k_eos + 2
    c = llm.generate([p], SamplingParams(**greedy, min_tokens=m))[0].outputs[0]
    assert len(c.token_ids) >= m and eos not in c.token_ids[:m]
    assert c.token_ids[:k_eos] == full[:k_eos] and c.token_ids[k_eos] != eos
    assert c.finish_reason == "length" or (c.token_ids[-1] == eos and c.finish_reason == "stop")
    # max_tokens
    c = llm.generate([p], SamplingParams(temperature=1.0, seed=1, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


def test_context_length_and_bad_prompts(tiny_model):
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=64, max_model_len=20))
    (o,) = llm.generate([[5] * 15], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"
    with pytest.raises(UserError, match="context holds 20"):
        llm.add_request([5] * 20)
    with pytest.raises(UserError, match="empty"):
        llm.add_request([])
    with pytest.raises(UserError, match="outside the vocabulary"):
        llm.add_request([5, 1000])
    with pytest.raises(UserError, match="tokenizer"):
        llm.add_request("text without a tokenizer")


def test_release_and_reallocate(tiny_model):
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=64))
    ps = prompts(3, seed=8)
    before = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    llm.release()
    assert llm.kv.caches is None
    with pytest.raises(UserError, match="reallocate"):
        llm.generate(ps, GREEDY)
    for rid in ("req-3", "req-4", "req-5"):  # queued by the refused generate
        llm.abort_request(rid)
    llm.reallocate()
    while llm.has_unfinished_requests():
        llm.step()
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == before
    assert llm.stats()["kv_cache_usage"] == 0.0


def test_abort_reports_and_frees(tiny_model):
    llm = LLM(tiny_model, None, RolloutConfig(block_size=4, num_blocks=64))
    rid = llm.add_request([3, 4, 5], SamplingParams(max_tokens=100, ignore_eos=True))
    llm.step()
    llm.abort_request(rid)
    (out,) = llm.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not llm.has_unfinished_requests() and llm.block_manager.usage() == 0.0


@pytest.mark.parametrize("pause", [True, False])
def test_generate_pauses_the_garbage_collector_and_restores_it(tiny_model, pause):
    """RolloutConfig.pause_gc: automatic cyclic GC is off for the whole generate() loop and back on after it,
    with the same outputs either way."""
    import gc

    llm = LLM(tiny_model, None, RolloutConfig(num_blocks=64, pause_gc=pause))
    seen = []
    step = llm.step

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return step(*args, **kwargs)

    llm.step = spy
    outs = llm.generate(prompts(3, seed=1), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert seen and set(seen) == {not pause} and gc.isenabled()
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
