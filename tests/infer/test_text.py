"""Text paths with a real (tiny, locally trained) byte-level BPE tokenizer: stop strings, streaming deltas,
the chat template, and text prompts."""

from __future__ import annotations

import pytest
import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.infer.detokenizer import IncrementalDetokenizer
from polyrl.models.decoder import build_model, init_weights

from .conftest import tiny_config


@pytest.fixture(scope="module")
def text_llm():
    from polyrl.models.tokenizer import build_tokenizer

    tok = build_tokenizer(320, trained_vocab=300)
    model = build_model(tiny_config(vocab_size=320, eos_token_id=tok.eos_token_id), seed=1)
    init_weights(model, seed=1, std=0.2)
    return LLM(model.eval(), tok, RolloutConfig(block_size=4, num_blocks=256, max_num_batched_tokens=32))


GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


def test_incremental_detokenizer_matches_full_decode(text_llm):
    tok = text_llm.tokenizer
    ids = tok.encode("Héllo wörld, 1 + 2 = 3. Thanks! 日本") + list(range(250, 300))
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(t) for t in ids]
    assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_strings_cut_text_but_keep_tokens(text_llm):
    prompt = "What is 12 + 7? The answer is"
    full = text_llm.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0]
    text = full.text
    assert len(text) >= 8
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    cut = text.index(stop)
    c = text_llm.generate([prompt], SamplingParams(**GREEDY, stop=[stop, "never-seen"]))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:cut]
    # Token ids (and log-probs) run up to the token that completed the stop string, and no further.
    n = len(c.token_ids)
    assert c.token_ids == full.token_ids[:n] and len(c.logprobs) == n
    assert stop in text_llm.tokenizer.decode(c.token_ids) and stop not in text_llm.tokenizer.decode(c.token_ids[:-1])


def test_stop_strings_wait_for_min_tokens(text_llm):
    prompt = "Hello"
    full = text_llm.generate([prompt], SamplingParams(**GREEDY)).pop().outputs[0]
    stop = full.text[:1]
    c = text_llm.generate([prompt], SamplingParams(**GREEDY, stop=[stop], min_tokens=10)).pop().outputs[0]
    assert len(c.token_ids) >= 10


def test_streaming_deltas_add_up(text_llm):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, n=2, stop=["xyz-not-there"])
    rid = text_llm.add_request("The answer is", params, stream=True)
    texts, ids, final = ["", ""], [[], []], None
    while text_llm.has_unfinished_requests():
        for out in text_llm.step():
            assert out.request_id == rid
            for c in out.outputs:
                texts[c.index] += c.new_text
                ids[c.index] += c.new_token_ids
            if out.finished:
                final = out
    assert final is not None
    for c in final.outputs:
        assert ids[c.index] == c.token_ids and texts[c.index] == c.text and len(c.token_ids) == 20
    # The same seed without streaming gives the same tokens and text.
    again = text_llm.generate(["The answer is"], params)[0]
    assert [c.token_ids for c in again.outputs] == ids and [c.text for c in again.outputs] == texts


def test_chat_uses_the_template_and_text_prompts_tokenize(text_llm):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    (out,) = text_llm.chat([msgs], SamplingParams(**GREEDY))
    tok = text_llm.tokenizer
    want = tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert out.prompt_token_ids == want
    by_ids = text_llm.generate([want], SamplingParams(**GREEDY))[0]
    assert by_ids.outputs[0].token_ids == out.outputs[0].token_ids
    (t,) = text_llm.generate("Hello there", SamplingParams(**GREEDY, logprobs=3))
    assert t.prompt == "Hello there" and t.prompt_token_ids == tok.encode("Hello there")
    tops = t.outputs[0].top_logprobs
    assert len(tops) == 24 and all(len(d) == 3 for d in tops)
    # Greedy: the sampled token is the top alternative, with the same log-prob.
    for tok_id, lp, top in zip(t.outputs[0].token_ids, t.outputs[0].logprobs, tops):
        best = max(top, key=top.get)
        assert best == tok_id and abs(top[best] - lp) < 1e-6
    assert torch.isfinite(torch.tensor(t.outputs[0].logprobs)).all()
