"""``infer.scoring.score_prompts`` feeds prompts' shared prefixes once (lm-eval's choices of one document: one context,
several short continuations) and still gives every prompt what a cache-free forward of that prompt alone gives: the
log-prob of each token 1 .. n - 1 and the argmax (id exactly, log-prob within 1e-5) after each of its n positions,
their sum and the greedy flag. Prompt sets: four choices after a context of several blocks, a prompt that is a prefix
of another, identical prompts, prompts shorter than a block, one-token prompts, nested sharing (a few-shot prefix
common to two documents), loners, shuffled, in one batch and spilling over several. CPU, fp32, a few seconds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from polyrl.infer import LLM, RolloutConfig
from polyrl.infer.scoring import _plan_prompts, _prompt_arrays, score_prompts
from polyrl.models.attention_metadata import AttnMetadata


def _reference(model, prompt: list[int]) -> tuple[list[float], list[int], list[float]]:
    """(log-probs of tokens 1 .. n - 1, argmax id and its log-prob after each position) of one cache-free forward."""
    ids = torch.tensor(prompt, device=model.lm_head_weight.device)
    with torch.inference_mode():
        pos = torch.arange(len(ids), device=ids.device)
        hidden = model(ids, pos, AttnMetadata.from_seqlens([len(ids)], ids.device))
        lp = torch.log_softmax(model.compute_logits(hidden).float(), -1)  # [n, V]
    best, arg = lp.max(-1)
    own = lp[:-1].gather(-1, ids[1:, None])[:, 0]
    return own.tolist(), arg.tolist(), best.tolist()


def _check(model, llm, prompts: list[list[int]], tol: float = 1e-5) -> dict:
    free = llm.block_manager.num_free_blocks
    res = score_prompts(llm, prompts)
    assert llm.block_manager.num_free_blocks == free  # every borrowed block given back
    assert len(res.logprobs) == len(res.greedy) == len(res.top_ids) == len(prompts)
    for i, p in enumerate(prompts):
        lps, ids, tops = _reference(model, p)
        assert res.top_ids[i] == ids, i
        assert res.token_logprobs[i] == pytest.approx(lps, abs=tol), i
        assert res.top_logprobs[i] == pytest.approx(tops, abs=tol), i
        assert res.logprobs[i] == pytest.approx(sum(lps), abs=10 * tol), i
        assert res.greedy[i] == (ids[:-1] == p[1:]), i
    return res.stats


def _mixed(vocab: int, bs: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(k)]

    ctx = toks(3 * bs + 2)
    few = toks(5 * bs)  # a few-shot prefix common to two documents of four choices each
    prompts = [ctx + toks(k) for k in (1, 2, 3, 7)]  # four choices of different lengths
    prompts += [few + doc + toks(rng.randint(1, 3)) for doc in (toks(2 * bs + 1), toks(bs + 3)) for _ in range(4)]
    prompts += [ctx[: bs + 1], ctx, ctx + [5] * 9]  # prefixes of each other and of the choices
    prompts += [ctx[:3], ctx[:3], ctx[1:bs], [7], [7], [9], [4, 4]]  # shorter than a block, one token, duplicates
    prompts += [ctx[:-1] + [1], ctx[: 3 * bs] + [1, 1]]  # leaving ctx at its last token, at its last block's end
    prompts += [toks(2 * bs + 3), toks(bs)]  # loners
    prompts += [list(prompts[4]), list(prompts[0])]  # duplicates of group members
    rng.shuffle(prompts)
    return prompts


@pytest.mark.parametrize("budget", [1024, 40])
def test_shared_prefixes_give_each_prompts_own_numbers(tiny_model, budget):
    bs = 4
    llm = LLM(tiny_model, None, RolloutConfig(block_size=bs, num_blocks=256, max_num_batched_tokens=budget))
    prompts = _mixed(tiny_model.config.vocab_size, bs, seed=0)
    stats = _check(tiny_model, llm, prompts)
    assert stats["requests"] == len(prompts) and stats["distinct_prompts"] == len(prompts) - 4
    assert stats["shared_prefixes"] >= 4  # ctx, the few-shot prefix, its two documents
    assert stats["fed_tokens"] < 0.6 * stats["unshared_tokens"]
    if budget == 40:  # spilled: prompts whose shared prefixes were scored in an earlier batch feed them again
        assert stats["batches"] > 4 and stats["fed_tokens"] > stats["scored_tokens"]
    else:
        assert stats["batches"] == 1 and stats["fed_tokens"] == stats["scored_tokens"]


def test_random_prompt_sets_with_many_shared_prefixes(tiny_model):
    """Prompts cut from a few bases over a 3-token vocabulary (deep, nested shared prefixes) at block sizes 1 to 16
    and budgets that spill: each prompt's numbers equal its own forward, and the batches' block tables equal
    building each sequence's table as its parent's leading blocks + its own."""
    rng = random.Random(3)
    for trial in range(8):
        bs = (1, 2, 4, 8, 16, 4, 2, 16)[trial]
        budget = (48, 64, 4096, 96, 4096, 48, 4096, 64)[trial]
        cfg = RolloutConfig(block_size=bs, num_blocks=max(2048 // bs, 64), max_num_batched_tokens=budget)
        llm = LLM(tiny_model, None, cfg)
        bases = [[rng.randrange(3) for _ in range(rng.randint(1, 40))] for _ in range(3)]
        prompts = []
        for _ in range(rng.randint(8, 16)):
            b = rng.choice(bases)
            p = b[: rng.randint(0, len(b))] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
            prompts.append(p or [2])
        prompts += [list(rng.choice(prompts)) for _ in range(2)]
        stats = _check(tiny_model, llm, prompts)
        assert stats["fed_tokens"] <= stats["unshared_tokens"]
        lens = np.array([0] + [len(p) for p in prompts])
        off = np.cumsum(lens)
        flat = np.array([t for p in prompts for t in p], dtype=np.int64)
        pool = np.array(rng.sample(range(4000), 2000), dtype=np.int64)
        for batch in _plan_prompts(flat, off, bs, budget, 10**6).batches:
            arrays, _ = _prompt_arrays(batch, flat, pool, bs)
            tables, first = [], 0
            for n, start, parent in zip(batch.seq_len, batch.seq_start, batch.seq_parent):
                assert start % bs == 0 and (parent >= 0) == (start > 0)
                own = pool[first : first + -(-n // bs)].tolist()
                first += len(own)
                tables.append((tables[parent][: start // bs] if parent >= 0 else []) + own)
            want = [t + [0] * (arrays["block_tables"].shape[1] - len(t)) for t in tables]
            assert arrays["block_tables"].tolist() == want


def test_a_shared_context_is_fed_once(tiny_model):
    """The fed and scored token counts of lm-eval's shapes: four choices after a 14-token context (block 4) feed
    its 12 whole-block tokens once; an identical prompt adds nothing; a few-shot prefix shared by two documents is
    fed once, each document's context once."""
    bs = 4
    llm = LLM(tiny_model, None, RolloutConfig(block_size=bs, num_blocks=256, max_num_batched_tokens=1024))
    ctx = list(range(10, 24))
    prompts = [ctx + [30 + k] + [50] * (k - 1) for k in (1, 2, 3, 7)]  # each choice its own first token
    stats = _check(tiny_model, llm, prompts + [list(prompts[2])])
    assert stats["unshared_tokens"] == 4 * 14 + 13 + 17
    # 12 shared tokens once, each choice its 2 context tokens + its own; the duplicate scored with its twin
    assert stats["fed_tokens"] == stats["scored_tokens"] == 12 + (3 + 4 + 5 + 9) == 33
    assert stats["distinct_prompts"] == 4 and stats["shared_prefixes"] == 1
    few = list(range(40, 48))  # two blocks, then two documents of 6 tokens and two one-token choices each
    docs = [few + list(range(d, d + 6)) + [c] for d in (50, 60) for c in (70, 71)]
    stats = _check(tiny_model, llm, docs)
    assert stats["unshared_tokens"] == 60
    # nodes: the first block (all four share 8 tokens: one whole block and a token), then each document's 12
    assert stats["shared_prefixes"] == 3 and stats["fed_tokens"] == 4 + 2 * 8 + 4 * 3 == 32
    loners = _check(tiny_model, llm, [[5, 6, 7], [8, 9, 10, 11, 12, 13], [5, 6, 8]])  # shared prefix < a block
    assert loners["shared_prefixes"] == 0 and loners["fed_tokens"] == loners["unshared_tokens"] == 12


@pytest.mark.gpu
def test_shared_prefixes_cuda(tiny_model):
    """The same on CUDA (Triton paged attention, block 16; fp32 against the cache-free reference within 1e-3)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import copy

    model = copy.deepcopy(tiny_model).cuda()
    for budget in (4096, 160):
        llm = LLM(model, None, RolloutConfig(block_size=16, num_blocks=256, max_num_batched_tokens=budget))
        stats = _check(model, llm, _mixed(model.config.vocab_size, 16, seed=1), 1e-3)
        assert stats["fed_tokens"] < 0.6 * stats["unshared_tokens"]
