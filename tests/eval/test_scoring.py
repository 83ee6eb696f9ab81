"""``infer.scoring.score_continuations`` (the ``polyrl`` lm-eval model's log-likelihood path) equals a plain
cache-free forward of each whole ``context + continuation``: per-request sums of the continuation's log-probs (fp32,
1e-4) and greedy flags, with contexts shared by 1-5 continuations, contexts of 1 token, of exactly a block and just
past one, a continuation of one token, and a batch budget small enough that one context's continuations fall into
several batches. The engine's blocks are all given back and it still generates afterwards. CPU, < 5 s; the same
on CUDA (Triton paged attention) under ``gpu``."""

from __future__ import annotations

import random

import pytest
import torch

from polyrl.errors import UserError
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.infer.scoring import score_continuations
from polyrl.models.attention_metadata import AttnMetadata


def _reference(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of log p(cont | ctx) and greedy flag from one cache-free forward of ``ctx + cont[:-1]``."""
    ids = torch.tensor(ctx + cont[:-1], device=model.lm_head_weight.device)
    pos = torch.arange(len(ids), device=ids.device)
    with torch.inference_mode():
        hidden = model(ids, pos, AttnMetadata.from_seqlens([len(ids)], ids.device))
        logits = model.compute_logits(hidden[len(ctx) - 1 :])  # [L, V] fp32
    lp = torch.log_softmax(logits, -1)
    target = torch.tensor(cont, device=ids.device)
    total = lp.gather(-1, target[:, None]).sum().item()
    return total, bool((logits.argmax(-1) == target).all())


def _workload(vocab: int, bs: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = [1, bs, bs + 1, 2 * bs + 1, 4 * bs, 6 * bs - 1, 3, 2 * bs]  # one token, exactly one block, one past, ...
    contexts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    conts, owner = [], []
    for u in range(len(contexts)):
        for _ in range(rng.randint(1, 5)):
            conts.append([rng.randrange(vocab) for _ in range(rng.randint(1, 3))])
            owner.append(u)
    order = list(range(len(conts)))
    rng.shuffle(order)  # requests of one context need not be adjacent
    return contexts, [conts[i] for i in order], [owner[i] for i in order]


def _check(dev: str, tiny_model, bs: int, tol: float = 1e-4) -> None:
    model = tiny_model().to(device=dev).eval()
    cfg = RolloutConfig(
        block_size=bs, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=10 * bs, max_model_len=16 * bs
    )
    llm = LLM(model, None, cfg)
    contexts, conts, owner = _workload(model.config.vocab_size, bs)
    free = llm.block_manager.num_free_blocks
    res = score_continuations(llm, contexts, conts, owner)
    assert llm.block_manager.num_free_blocks == free  # every borrowed block given back
    assert res.stats["batches"] > 2 and res.stats["fed_tokens"] < res.stats["unshared_tokens"]
    for r, cont in enumerate(conts):
        want, greedy = _reference(model, contexts[owner[r]], cont)
        assert res.logprobs[r] == pytest.approx(want, abs=tol), r
        assert res.greedy[r] == greedy, r
    # one token greedy everywhere: a continuation made of the argmax tokens is greedy
    ctx = contexts[3]
    best, _ = _reference(model, ctx, [0])
    ids = torch.tensor(ctx, device=dev)
    with torch.inference_mode():
        h = model(ids, torch.arange(len(ids), device=dev), AttnMetadata.from_seqlens([len(ids)], dev))
        top = int(model.compute_logits(h[-1:]).argmax())
    assert score_continuations(llm, [ctx], [[top], [(top + 1) % 7]], [0, 0]).greedy == [True, False]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))  # the engine still runs
    assert len(out[0].outputs[0].token_ids) == 3


def test_scoring_equals_a_plain_forward(tiny_model):
    torch.manual_seed(0)
    _check("cpu", tiny_model, 4)


def test_scoring_refuses_what_it_cannot_do(tiny_model):
    llm = LLM(tiny_model().eval(), None, RolloutConfig(block_size=4, num_blocks=32, max_model_len=32))
    with pytest.raises(UserError, match="non-empty"):
        score_continuations(llm, [[1, 2]], [[]], [0])
    with pytest.raises(UserError, match="context"):
        score_continuations(llm, [list(range(30))], [[1, 2, 3, 4]], [0])
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(UserError, match="idle"):
        score_continuations(llm, [[1, 2]], [[3]], [0])


@pytest.mark.gpu
def test_scoring_equals_a_plain_forward_cuda(tiny_model):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda", tiny_model, 16, 1e-3)  # fp32: the Triton paged attention against the cache-free reference


def test_harness_sends_long_requests_through_the_engine(tiny_model_dir, monkeypatch):
    """``PolyrlLM._score``: requests longer than one forward's token budget take the request path (chunked prefill),
    the rest the direct path; both give what the request path alone gives."""
    pytest.importorskip("lm_eval")
    import polyrl.eval.harness as harness
    from polyrl.eval.loading import eval_engine, load_eval_model

    torch.set_num_threads(1)
    model, tok = load_eval_model(str(tiny_model_dir), "float32", "cpu")
    lm = harness.PolyrlLM(
        llm=eval_engine(model, tok, max_model_len=128, max_num_batched_tokens=32), show_progress=False
    )
    rng = random.Random(1)
    ctx_long, ctx_short = [rng.randrange(2000) for _ in range(60)], [rng.randrange(2000) for _ in range(20)]
    pairs = [(ctx_long, [5, 6]), (ctx_short, [7]), (ctx_short, [8, 9, 10]), (ctx_long, [11])]
    mixed = lm._score(pairs, "test")
    assert lm.last_score_stats["requests"] == 2  # the two short ones went the direct way
    monkeypatch.setattr(harness, "supports_scoring", lambda llm: False)
    alone = lm._score(pairs, "test")
    assert [g for _, g in mixed] == [g for _, g in alone]
    assert [lp for lp, _ in mixed] == pytest.approx([lp for lp, _ in alone], abs=1e-4)


def test_score_prompts_equals_the_engines_prompt_logprobs(tiny_model):
    """``score_prompts`` (every position: echo + logprobs) gives the engine's prompt log-probs, its top-1 alternatives
    and, after the last position, the token greedy generation draws, for prompts of 1 to 40 tokens."""
    from polyrl.infer.scoring import score_prompts

    torch.set_num_threads(1)
    llm = LLM(tiny_model().eval(), None, RolloutConfig(block_size=4, num_blocks=256, max_num_batched_tokens=64))
    rng = random.Random(2)
    prompts = [[rng.randrange(100) for _ in range(n)] for n in (1, 2, 4, 5, 17, 40, 9)]
    res = score_prompts(llm, prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    for i, out in enumerate(llm.generate(prompts, sp)):
        pl = out.prompt_logprobs
        assert res.token_logprobs[i] == pytest.approx(pl.logprobs[1:], abs=1e-5)
        want_top = [max(t, key=t.get) for t in pl.top_logprobs[1:]]
        assert res.top_ids[i][:-1] == want_top
        assert res.top_ids[i][-1] == out.outputs[0].token_ids[0]  # greedy: the argmax after the prompt
        assert res.top_logprobs[i][-1] == pytest.approx(out.outputs[0].logprobs[0], abs=1e-5)
        assert res.logprobs[i] == pytest.approx(sum(pl.logprobs[1:]), abs=1e-4)


def test_scoring_between_steps_of_running_requests(tiny_model):
    """``require_idle=False`` (the server's engine thread): scoring between the steps of running generations gives the
    idle numbers and leaves those generations exactly as they would have been."""
    from polyrl.infer.scoring import score_prompts

    torch.set_num_threads(1)
    model = tiny_model().eval()
    cfg = RolloutConfig(block_size=4, num_blocks=128, max_num_batched_tokens=64)
    prompts = [[5, 17, 42, 9, 77, 3, 64], [8, 8, 100, 23], list(range(1, 30))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model, None, cfg).generate([[3, 4, 5], [6, 7]], sp)]
    idle = score_prompts(LLM(model, None, cfg), prompts)
    llm = LLM(model, None, cfg)
    for p in ([3, 4, 5], [6, 7]):
        llm.add_request(p, sp)
    outs, busy = {}, []
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o.outputs[0].token_ids
        if llm.has_unfinished_requests() and len(busy) < 3:
            busy.append(score_prompts(llm, prompts, require_idle=False))
    assert [outs["req-0"], outs["req-1"]] == want
    for res in busy:
        assert res.logprobs == pytest.approx(idle.logprobs, abs=1e-5) and res.top_ids == idle.top_ids


def _arrays_per_sequence(batch, pool, bs, conts):
    """The index arrays built one sequence at a time (the reference for ``scoring._arrays``)."""
    import numpy as np

    tables, positions, slots, rows, targets, req, first, cu = [], [], [], [], [], [], 0, [0]
    for toks, start, shared in zip(batch.seq_tokens, batch.seq_start, batch.seq_shared):
        mine = [int(b) for b in pool[first : first + -(-len(toks) // bs)]]
        first += len(mine)
        tables.append((tables[shared][: start // bs] if shared >= 0 else []) + mine)
        positions += range(start, start + len(toks))
        slots += [mine[j // bs] * bs + j % bs for j in range(len(toks))]
        cu.append(cu[-1] + len(toks))
    for i, local, r in batch.rows:
        rows += range(cu[i] + local, cu[i] + local + len(conts[r]))
        targets += conts[r]
        req += [r] * len(conts[r])
    width = max(map(len, tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return [np.array(x) for x in (padded, positions, slots, rows, targets, req)]


def test_batch_index_arrays_equal_a_per_sequence_build():
    """``_arrays`` builds a batch's block tables, positions, slots and scored rows at once (numpy, no step per
    sequence): equal to building them one sequence at a time, for branches sharing a context's blocks, contexts
    scored once, several batches and block sizes."""
    import numpy as np

    from polyrl.infer.scoring import _arrays, _plan

    rng = random.Random(0)
    checked = 0
    for bs in (1, 4, 16):
        for _ in range(20):
            contexts = [[rng.randrange(50) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 8))]
            owner = [u for u in range(len(contexts)) for _ in range(rng.randint(1, 4))]
            conts = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in owner]
            pool = np.array(rng.sample(range(4000), 2000), dtype=np.int64)
            for batch in _plan(contexts, conts, owner, bs, rng.choice([64, 100000]), 10**6):
                arrays, rows = _arrays(batch, pool, bs, conts)
                want = _arrays_per_sequence(batch, pool, bs, conts)
                got = [arrays[k] for k in ("block_tables", "positions", "slot_mapping", "sample_rows")]
                for a, b in zip(got + [rows["targets"], rows["requests"]], want):
                    assert a.dtype == np.int64 and np.array_equal(a, b)
                checked += 1
    assert checked > 60
