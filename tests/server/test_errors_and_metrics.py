"""Bad requests get OpenAI error bodies with the right status (400, never 422/500; 404 model; 401 key),
and /metrics shows counters that move by the exact amounts of the requests made."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import API_KEY, MODEL, metric

MSG = [{"role": "user", "content": "hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}


def chat(**kw):
    body = {"model": MODEL, "messages": MSG}
    body.update(kw)
    return body


def completion(**kw):
    body = {"model": MODEL, "prompt": "hello"}
    body.update(kw)
    return body


BAD_REQUESTS = [
    # (path, body, param)
    ("chat", chat(max_tokens="ten"), "max_tokens"),
    ("chat", chat(temperature="hot"), "temperature"),
    ("chat", chat(n=True), "n"),
    ("chat", chat(stop=[1, 2]), "stop"),
    ("chat", {"model": MODEL}, "messages"),
    ("chat", chat(messages=[]), "messages"),
    ("chat", chat(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
    ("chat", chat(max_tokens=0), "max_tokens"),
    ("chat", chat(max_completion_tokens=-3), "max_completion_tokens"),
    ("chat", chat(max_tokens=10_000), "max_tokens"),
    ("chat", chat(n=0), "n"),
    ("chat", chat(n=129), "n"),
    ("chat", chat(top_p=0), "top_p"),
    ("chat", chat(temperature=-1), "temperature"),
    ("chat", chat(top_logprobs=2), "top_logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", chat(presence_penalty=0.5), "presence_penalty"),
    ("chat", chat(messages=[{"role": "user", "content": "x " * 300}], max_tokens=8), "messages"),
    ("completions", completion(prompt=list(range(2, 250)), max_tokens=16), "prompt"),
    ("completions", completion(prompt=[5, 999_999]), "prompt"),
    ("completions", completion(prompt=[]), "prompt"),
    ("completions", completion(logprobs=21), "logprobs"),
    ("completions", completion(echo=True, logprobs=1, stream=True), "stream"),
    ("completions", completion(prompt_logprobs=21), "prompt_logprobs"),
    ("completions", completion(max_tokens=0), "max_tokens"),
    ("chat", chat(prompt_logprobs=-1), "prompt_logprobs"),
    ("completions", completion(best_of=3), "best_of"),
    ("completions", completion(max_tokens=-1), "max_tokens"),
    ("completions", completion(stop=[f"s{i}" for i in range(65)]), "stop"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_requests_are_400_with_openai_body(http, path, body, param):
    r = http.post(f"/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10


def test_context_overflow_message_names_the_numbers(http, served):
    r = http.post("/v1/completions", json=completion(prompt=list(range(2, 250)), max_tokens=16))
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert f"{served[1].max_model_len} tokens" in err["message"] and "248" in err["message"]


def test_invalid_json_is_400(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "tiny", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_openai_client_raises_the_matching_errors(client, served):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
    assert e.value.body["message"].endswith(f"This server serves: `{MODEL}`.")  # what to send instead
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    bad_key = openai.OpenAI(base_url=served[0].base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad_key.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_api_key_guards_v1_only(served):
    url = served[0].url
    assert httpx.post(url + "/v1/completions", json=completion()).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/metrics").status_code == 200
    r = httpx.get(url + "/no/such/route")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS


def test_metrics_count_requests_and_tokens(http, served):
    names = [
        "polyrl_requests_total",
        "polyrl_prompt_tokens_total",
        "polyrl_generation_tokens_total",
        "polyrl_queue_depth",
        "polyrl_running_requests",
        "polyrl_kv_cache_usage",
        "polyrl_request_latency_seconds",
        "polyrl_time_to_first_token_seconds",
    ]
    before = http.get("/metrics")
    assert before.headers["content-type"].startswith("text/plain")
    for n in names:
        assert f"# TYPE {n} " in before.text, n
    ok = 'endpoint="/v1/completions",status="200"'
    bad = 'endpoint="/v1/completions",status="400"'
    ids = [5, 6, 7, 8, 9]
    http.post("/v1/completions", json=completion(prompt=ids, max_tokens=6, ignore_eos=True)).raise_for_status()
    r = http.post("/v1/completions", json=completion(prompt=ids, max_tokens=4, ignore_eos=True, stream=True))
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert http.post("/v1/completions", json=completion(max_tokens=0)).status_code == 400
    after = http.get("/metrics").text
    b = before.text
    assert metric(after, "polyrl_requests_total", ok) == metric(b, "polyrl_requests_total", ok) + 2
    assert metric(after, "polyrl_requests_total", bad) == metric(b, "polyrl_requests_total", bad) + 1
    assert metric(after, "polyrl_prompt_tokens_total") == metric(b, "polyrl_prompt_tokens_total") + 10
    assert metric(after, "polyrl_generation_tokens_total") == metric(b, "polyrl_generation_tokens_total") + 10
    lat = "polyrl_request_latency_seconds_count"
    assert metric(after, lat) == metric(b, lat) + 2
    ttft = "polyrl_time_to_first_token_seconds_count"
    assert metric(after, ttft) == metric(b, ttft) + 1  # measured on streaming requests
    inf = 'le="+Inf"'
    assert metric(after, "polyrl_request_latency_seconds_bucket", inf) == metric(after, lat)
    assert metric(after, "polyrl_running_requests") == 0 and metric(after, "polyrl_queue_depth") == 0
    assert 0.0 <= metric(after, "polyrl_kv_cache_usage") <= 1.0


SURROGATES = [
    # (path, raw JSON body, param): "\\ud800" is valid JSON that no tokenizer takes and no reply can encode (was a 500)
    (
        "chat/completions",
        '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
        "messages.0.content",
    ),
    ("completions", '{"prompt": "\\udc00x", "max_tokens": 2}', "prompt"),
    ("completions", '{"prompt": "x", "stop": ["a", "\\udfff"], "max_tokens": 2}', "stop.1"),
    ("responses", '{"input": "hi", "metadata": {"k\\ud801": "v"}, "max_output_tokens": 2}', "metadata.k\\ud801"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATES)
def test_lone_surrogates_are_400_naming_the_field(http, path, raw, param):
    r = http.post(f"/v1/{path}", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["param"] == param
        and "unpaired UTF-16 surrogate" in err["message"]
        and "send valid Unicode" in err["message"]
    )
    # a character outside the BMP sent as an escaped surrogate pair (json.dumps' default) is text
    ok = raw.replace("\\ud800", "\\ud83d\\ude00").replace("\\udc00", "\\ud83d\\ude00")
    if ok != raw:
        assert http.post(f"/v1/{path}", content=ok.encode(), headers={"content-type": "application/json"}).is_success


def test_too_many_stop_strings_name_the_limit(http):
    # Each stop string is checked on every new text on the engine thread: 20,000 of them slowed every request ~20x.
    r = http.post("/v1/chat/completions", json=chat(stop=["x"] * 65, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "stop has 65 strings; at most 64 are allowed" in r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json=chat(stop=["x"] * 64, max_tokens=2)).status_code == 200


@pytest.mark.parametrize(
    "content,param,says",
    [
        (
            [{"type": "text"}],
            "messages.1.content.0.text",
            "text is required",
        ),  # was: "parts of type 'text' unsupported"
        (
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
            "messages.1.content.1",
            "'image_url'",
        ),
        ([{"type": "refusal", "refusal": "no"}], "messages.1.content.0", "'refusal'"),  # a user cannot refuse
    ],
)
def test_content_parts_name_the_part(http, content, param, says):
    r = http.post("/v1/chat/completions", json=chat(messages=[*MSG, {"role": "user", "content": content}]))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"] and err["code"] in ("invalid_value", "unsupported")


def test_assistant_refusal_part_is_its_text(client):
    # OpenAI's assistant content may hold {"type": "refusal"} parts (a refused turn sent back): was a 400
    parts = [{"type": "text", "text": "I "}, {"type": "refusal", "refusal": "cannot."}]
    ask = [*MSG, {"role": "assistant", "content": parts}, {"role": "user", "content": "ok"}]
    plain = [*MSG, {"role": "assistant", "content": "I cannot."}, {"role": "user", "content": "ok"}]
    a = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=1)
    b = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=1)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
