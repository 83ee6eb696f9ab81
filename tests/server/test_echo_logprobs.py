"""Prompt log-probs through the real openai client against a real server: ``echo`` + ``logprobs`` in OpenAI's legacy
shape (what lm-eval-harness's ``local-completions`` sends), ``max_tokens: 0`` scoring, vLLM's ``prompt_logprobs`` on
completions and chat, token-id prompts; numbers equal to a full forward of the served weights."""

from __future__ import annotations

import pytest
import torch

from polyrl.models.attention_metadata import AttnMetadata

from .conftest import MODEL

IGNORE_EOS = {"ignore_eos": True}
PROMPTS = [[5, 17, 42, 9, 77, 3, 64], [8, 8, 100, 23]]


@torch.no_grad()
def full_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain full forward of the served weights: ``[len(ids) - 1, V]``, row i predicts ids[i + 1]."""
    model = llm.model
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), AttnMetadata.from_seqlens([len(ids)]))
    return torch.log_softmax(model.compute_logits(hidden), -1)[:-1]


def test_echo_logprobs_is_what_lm_eval_reads(client, reference_llm):
    # lm-eval's loglikelihood request: token-id prompts (a list of lists), echo, logprobs 1, max_tokens 1, greedy.
    out = client.completions.create(model=MODEL, prompt=PROMPTS, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    for ids, choice in zip(PROMPTS, out.choices):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        text_of = reference_llm.tokenizer.decode
        assert lp.tokens[: len(ids)] == [text_of([t], skip_special_tokens=False) for t in ids]
        full = full_logprobs(reference_llm, ids)
        want = full.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want.tolist(), abs=1e-4)
        for i in range(1, len(ids)):
            top = lp.top_logprobs[i]
            best = int(full[i - 1].argmax())
            assert top[text_of([best], skip_special_tokens=False)] == pytest.approx(full[i - 1, best].item(), abs=1e-4)
            # lm-eval's greedy test: the token's log-prob equals the best alternative exactly when it is the argmax
            assert (lp.token_logprobs[i] == max(top.values())) == (ids[i] == best)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert lp.token_logprobs[-1] is not None  # the generated token
    assert out.usage.prompt_tokens == sum(map(len, PROMPTS)) and out.usage.completion_tokens == 2


def test_max_tokens_zero_scores_only(client, reference_llm):
    prompt = "The quick brown fox jumps"
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    (choice,) = out.choices
    ids = reference_llm.tokenizer.encode(prompt)
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    full = full_logprobs(reference_llm, ids)
    want = full.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-4)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])  # k = 0: the token itself only


def test_vllm_prompt_logprobs_on_completions_and_chat(client, reference_llm):
    ids = PROMPTS[0]
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    (choice,) = raw.http_response.json()["choices"]
    assert choice["logprobs"] is None  # only the prompt's were asked for
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    full = full_logprobs(reference_llm, ids)
    for i in range(1, len(ids)):
        entry = pl[i]
        assert str(ids[i]) in entry and 3 <= len(entry) <= 4
        own = entry[str(ids[i])]
        assert set(own) == {"logprob", "rank", "decoded_token"}
        assert own["logprob"] == pytest.approx(full[i - 1, ids[i]].item(), abs=1e-4)
        assert own["rank"] == int((full[i - 1] > full[i - 1, ids[i]]).sum()) + 1
        assert {int(t) for t, v in entry.items() if v["rank"] <= 3} == set(full[i - 1].topk(3).indices.tolist())

    messages = [{"role": "user", "content": "Say something."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    body = raw.http_response.json()
    chat_ids = reference_llm.apply_chat_template(messages)
    assert len(body["prompt_logprobs"]) == len(chat_ids) == body["usage"]["prompt_tokens"]
    full = full_logprobs(reference_llm, chat_ids)
    got = [next(iter(e.values()))["logprob"] for e in body["prompt_logprobs"][1:]]
    assert [int(next(iter(e))) for e in body["prompt_logprobs"][1:]] == chat_ids[1:]
    assert got == pytest.approx(full.gather(-1, torch.tensor(chat_ids[1:])[:, None])[:, 0].tolist(), abs=1e-4)


def test_echo_with_n_and_generation_keeps_prompt_block(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], echo=True, logprobs=2, max_tokens=3, n=2, seed=1, extra_body=IGNORE_EOS
    )
    first = out.choices[0].logprobs
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(PROMPTS[1]) + 3
        assert lp.token_logprobs[: len(PROMPTS[1])] == first.token_logprobs[: len(PROMPTS[1])]  # one scoring, shared
        assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
