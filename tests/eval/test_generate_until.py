"""``PolyrlLM.generate_until``: every request in one engine call whatever its ``gen_kwargs``; ``until`` strings stop a
sequence in the engine at the token that completes one, giving exactly the text lm-eval's ``hf`` backend gets by
cutting a full generation afterwards, with fewer tokens generated; ``last_generate_stats`` adds up (steps, tokens,
the time split the bench prints). The engine's stop checks decode through the tokenizer's Rust backend where that
is the same text. Tiny fp32 model, CPU, a few seconds."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("lm_eval")


class _Req:
    def __init__(self, context: str, gen_kwargs: dict) -> None:
        self.args = (context, gen_kwargs)


CONTEXTS = ["Question: 2 + 3 = ? Answer:", "the river mill", "What is 7 times 8?", "hello world, the cat"]


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    from polyrl.eval.harness import PolyrlLM
    from polyrl.eval.loading import eval_engine, load_eval_model

    model, tok = load_eval_model(str(tiny_model_dir), "float32", "cpu")
    return PolyrlLM(llm=eval_engine(model, tok, max_model_len=256, num_blocks=128), show_progress=False)


def _greedy(until: list[str], n: int = 16) -> dict:
    return {"until": list(until), "do_sample": False, "max_gen_toks": n}


def test_until_stops_in_the_engine_with_hfs_text(lm):
    full = lm.generate_until([_Req(c, _greedy([])) for c in CONTEXTS])
    full_tokens = lm.last_generate_stats["generated_tokens"]
    assert full_tokens == 16 * len(CONTEXTS)  # nothing stops them (the tiny model emits no EOS here)
    # a stop string taken from the middle of the first text: it occurs, so that sequence must stop early
    text = full[0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    cut = lm.generate_until([_Req(c, _greedy([stop])) for c in CONTEXTS])
    assert cut == [t.split(stop)[0] for t in full]  # what lm-eval's hf backend does after generating everything
    assert lm.last_generate_stats["generated_tokens"] < full_tokens  # stopped early, not truncated afterwards


def test_mixed_gen_kwargs_share_one_engine_call(lm):
    reqs = [_Req(c, _greedy([], n)) for c, n in zip(CONTEXTS, (3, 9, 1, 6))]
    texts = lm.generate_until(reqs)
    s = lm.last_generate_stats
    assert s["engine_calls"] == 1 and s["requests"] == 4
    assert s["generated_tokens"] == 3 + 9 + 1 + 6  # each request its own max_gen_toks
    alone = [lm.generate_until([r])[0] for r in reqs]  # one engine call each: the same texts
    assert texts == alone


def test_generate_stats_add_up(lm):
    llm = lm.llm
    before = llm.config.overlap_decode
    llm.config.overlap_decode = True  # the device's path on the CPU: decode steps launched ahead of their reading
    try:
        reqs = [_Req(c, _greedy(["<never-stop>"], 12)) for c in CONTEXTS * 3]
        lm.generate_until(reqs)
    finally:
        llm.config.overlap_decode = before
    s = lm.last_generate_stats
    assert s["requests"] == 12 and s["generated_tokens"] == s["engine_tokens"] == 12 * 12
    assert s["prompt_tokens"] == sum(len(lm.tok_encode(c)) for c in CONTEXTS) * 3
    assert s["steps"] == s["sync_steps"] + s["launches"] + 1  # the last step is counted apart
    # the prompt step is queued ahead too (its draws feed the first decode launch), then decode launches
    assert s["sync_steps"] == 0 and s["launches"] >= 3
    assert llm.num_mixed_ahead >= 1
    assert s["sync_s"] + s["launch_s"] + s["final_s"] == pytest.approx(s["generate_s"], rel=1e-6)
    assert 0 < s["first_step_s"] <= s["slowest_step_s"] <= s["generate_s"] and s["prepare_s"] > 0


def test_stop_checks_decode_through_the_backend_with_the_same_text(tiny_model_dir):
    from polyrl.infer.detokenizer import IncrementalDetokenizer, backend_decoder
    from polyrl.models.checkpoint import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    fast = backend_decoder(tok)
    assert fast is tok._tokenizer  # a plain fast tokenizer, no clean-up of spaces
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    for skip in (True, False):
        for _ in range(40):
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(24)]
            a, b = IncrementalDetokenizer(tok, skip), IncrementalDetokenizer(fast, skip)
            assert [a.add(t) for t in ids] == [b.add(t) for t in ids]
            assert a.text == b.text  # (an incomplete UTF-8 tail is held back by both, as the detokenizer does)
            assert fast.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True  # transformers would change the backend's text: keep its decode
    assert backend_decoder(tok) is tok
