"""The official openai client (sync, async, streaming) against a real uvicorn server: exact response
schemas, usage arithmetic, logprob shapes, greedy output equal to the engine's own, n, stop strings, seeds."""

from __future__ import annotations

import asyncio
import time

import pytest

from polyrl.infer import SamplingParams

from .conftest import API_KEY, MODEL

CHAT_KEYS = {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens"}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def same_text(streamed: str, whole: str) -> bool:
    """Streamed text equals the non-streamed text, except that the engine's incremental detokenizer never
    flushes a trailing incomplete UTF-8 sequence (which a full decode renders as U+FFFD)."""
    return streamed.rstrip("\ufffd") == whole.rstrip("\ufffd") and whole.startswith(streamed)


def check_usage(usage: dict, prompt: int, completion: int) -> None:
    assert set(usage) == USAGE_KEYS
    assert usage == {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def test_chat_schema_and_greedy_equals_engine(client, reference_llm):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    assert raw.http_response.status_code == 200
    body = raw.http_response.json()
    assert set(body) == CHAT_KEYS
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > 12
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body["system_fingerprint"].startswith("polyrl-")
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    assert set(choice["message"]) == {"role", "content", "refusal"} and choice["message"]["role"] == "assistant"

    ref = reference_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
    want = ref.outputs[0]
    assert choice["message"]["content"] == want.text
    assert choice["finish_reason"] == want.finish_reason
    check_usage(body["usage"], ref.num_prompt_tokens, len(want.token_ids))

    content = choice["logprobs"]["content"]
    assert len(content) == len(want.token_ids)
    for entry, tid, lp, tops in zip(content, want.token_ids, want.logprobs, want.top_logprobs):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == reference_llm.tokenizer.decode([tid], skip_special_tokens=False)
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert entry["logprob"] == pytest.approx(lp, abs=1e-5)
        assert len(entry["top_logprobs"]) == 3
        got = [t["logprob"] for t in entry["top_logprobs"]]
        assert got == sorted(got, reverse=True)
        assert got == pytest.approx(sorted(tops.values(), reverse=True)[:3], abs=1e-5)
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(lp, abs=1e-5)  # greedy: the top choice

    parsed = raw.parse()  # the client's own model accepts it
    assert parsed.choices[0].message.content == want.text


def test_completion_schema_greedy_and_logprobs(client, reference_llm):
    prompt = "The quick brown fox"
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=5, logprobs=2, extra_body={"ignore_eos": True}
    )
    body = raw.http_response.json()
    assert set(body) == CHAT_KEYS
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    ref = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True))
    want = ref[0].outputs[0]
    assert choice["text"] == want.text and choice["finish_reason"] == "length"
    check_usage(body["usage"], ref[0].num_prompt_tokens, 5)
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert lp["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert tok in top and 1 <= len(top) <= 3

    # Token-id prompts, several of them, with echo: choice i*n+j is sample j of prompt i.
    ids = reference_llm.tokenizer.encode(prompt)
    body = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], temperature=0, max_tokens=3, n=2, echo=True)
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    assert body.choices[0].text.startswith(reference_llm.tokenizer.decode(ids))
    assert body.usage.prompt_tokens == len(ids) + 2 and body.usage.completion_tokens == 12


def test_n_samples_and_seed_reproducibility(client):
    kw = dict(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(n=3, seed=1234, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert a.usage.completion_tokens == 24
    assert len({c.message.content for c in a.choices}) > 1  # three independent samples
    b = client.chat.completions.create(n=3, seed=1234, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    c = client.chat.completions.create(n=3, seed=99, **kw)
    assert [x.message.content for x in c.choices] != [x.message.content for x in a.choices]


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=1.0, seed=7, max_tokens=16)
    full = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    assert len(full) >= 8
    stop = next(full[i : i + 2] for i in range(len(full) // 2, len(full) - 1) if full[i : i + 2].strip())
    cut = full.index(stop)
    for stops in (stop, [stop, "never-appears-xyz"]):
        got = client.completions.create(stop=stops, extra_body={"ignore_eos": True}, **kw).choices[0]
        assert got.finish_reason == "stop"
        assert got.text == full[:cut]


def test_streaming_chat_chunks(client, http):
    kw = dict(model=MODEL, messages=MESSAGES, temperature=1.0, seed=5, max_tokens=7)
    whole = client.chat.completions.create(extra_body={"ignore_eos": True}, **kw)
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, logprobs=True, extra_body={"ignore_eos": True}, **kw
    )
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content)
    assert same_text(text, whole.choices[0].message.content)
    tokens = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(tokens) == 7 and len(content) <= 7
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])

    # The raw SSE framing: data lines, exact chunk keys, [DONE] at the end.
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    import json

    first = json.loads(events[0][6:])
    assert set(first) == {"id", "object", "created", "model", "system_fingerprint", "choices"}
    assert set(first["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}


def test_streaming_completion_n2(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=4,
            n=2,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.text
    assert sorted(c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 8
    whole = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert all(same_text(texts[i], c.text) for i, c in enumerate(whole.choices))


def test_async_client_and_models(served):
    import openai

    async def go():
        async with openai.AsyncOpenAI(base_url=served[0].base_url, api_key=API_KEY, max_retries=0) as ac:
            models = await ac.models.list()
            assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
            assert (await ac.models.retrieve(MODEL)).owned_by == "polyrl"
            r = await ac.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
            assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 4
            return r

    r = asyncio.run(go())
    assert r.object == "chat.completion"
