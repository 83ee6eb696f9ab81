"""Issue 33: no single request may stall the others, and every bad parameter is a 4xx naming the field.

The event loop keeps answering while a maximal prompt is refused; bodies are capped (413) and timed (408) after the
API key is checked (401 first); request-supplied chat templates are refused unless allowed, and then time-limited;
non-finite and out-of-range parameters are 400s with ``param``; a batch larger than ``--max-queue`` is a 400; a chat
reply without max_tokens is bounded by ``default_max_tokens``; the OpenAPI schema lists the real answers; 405 has
``Allow``; ``prompt: ""`` is served as the OpenAI API serves it."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from .conftest import API_KEY, MODEL, make_llm

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}
CAP = 64 * 1024  # the guarded server's body cap
LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    """A server with small limits: 64 KiB bodies within 1 s, 2 waiting requests, 5-token default replies, and
    request chat templates allowed (1.5 s each)."""
    from polyrl.server import ServeConfig, start_server

    llm = make_llm(tiny_model_dir)
    cfg = ServeConfig(
        port=0,
        served_model_name=MODEL,
        api_key=API_KEY,
        log_level="warning",
        max_queue=2,
        max_request_bytes=CAP,
        body_timeout_s=1.0,
        default_max_tokens=5,
        allow_request_chat_template=True,
        chat_template_timeout_s=1.5,
    )
    handle = start_server(llm, cfg)
    yield handle, llm
    handle.stop()


def raw_request(handle, head: str, body: bytes = b"", timeout_s: float = 10.0) -> tuple[int, dict, bytes]:
    """Send ``head`` (request line + headers, no blank line) and ``body`` on a fresh socket; (status, headers,
    body) of the answer, read until the server closes or Content-Length is complete."""
    with socket.create_connection((handle.host, handle.port), timeout=timeout_s) as s:
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        return read_response(s)


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    want = int(headers.get("content-length", "0"))
    while len(rest) < want:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest


def post_head(handle, path: str, length: int, auth: bool = True, extra: str = "") -> str:
    head = f"POST {path} HTTP/1.1\r\nHost: {handle.host}:{handle.port}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {length}"
    if auth:
        head += f"\r\nAuthorization: Bearer {API_KEY}"
    return head + extra


# ---- item 1: tokenisation off the event loop; body and prompt-length caps --------------------------------------


def test_health_answers_within_1s_while_a_maximal_prompt_is_refused(served):
    handle, llm = served
    from polyrl.server.config import MAX_REQUEST_BYTES

    unit = "hello world, this is a test. "
    prompt = unit * ((MAX_REQUEST_BYTES - 200) // len(unit))
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16}).encode()
    assert MAX_REQUEST_BYTES - 1000 < len(body) <= MAX_REQUEST_BYTES
    with socket.create_connection((handle.host, handle.port), timeout=60) as s:
        s.sendall(post_head(handle, "/v1/completions", len(body)).encode() + b"\r\n\r\n" + body)
        # The whole body is with the server, which is now parsing and tokenising it: /health must still answer.
        t0 = time.monotonic()
        h = httpx.get(handle.url + "/health", timeout=1.0)
        assert h.status_code == 200 and time.monotonic() - t0 < 1.0
        status, _, raw = read_response(s)
    assert status == 400, raw[:300]
    err = json.loads(raw)["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    ctx = llm.max_model_len
    assert f"maximum context length is {ctx} tokens" in err["message"]
    assert f"at most {ctx - 16} tokens" in err["message"]


def test_body_over_the_cap_is_413_before_reading(served):
    from polyrl.server.config import MAX_REQUEST_BYTES

    handle, _ = served
    status, headers, raw = raw_request(handle, post_head(handle, "/v1/completions", MAX_REQUEST_BYTES + 1))
    assert status == 413 and headers.get("connection") == "close"
    err = json.loads(raw)["error"]
    assert set(err) == ERROR_KEYS and err["code"] == "request_too_large"
    assert f"at most {MAX_REQUEST_BYTES}" in err["message"]


def test_tokenize_capped_refuses_early_and_matches_encode(served):
    from polyrl.server.prompts import PromptTooLong, tokenize_capped

    tok = served[1].tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * 20
    assert tokenize_capped(tok, text, 10_000, True) == list(tok.encode(text))
    huge = text * 5000  # ~4.5 MB
    t0 = time.monotonic()
    with pytest.raises(PromptTooLong) as e:
        tokenize_capped(tok, huge, 100, True)
    assert time.monotonic() - t0 < 2.0 and e.value.at_least > 100 and not e.value.exact
    with pytest.raises(PromptTooLong) as e:
        tokenize_capped(tok, text, 50, True)
    assert e.value.exact and e.value.at_least == len(tok.encode(text))


# ---- item 2: request-supplied chat templates ----------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"chat_template": LOOP_TEMPLATE}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": LOOP_TEMPLATE}}, "chat_template_kwargs.chat_template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ],
)
def test_request_chat_template_refused_by_default(http, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = http.post("/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    if param != "chat_template_kwargs.tokenize":
        assert "--allow-request-chat-template" in err["message"] and err["code"] == "unsupported"


def test_allowed_request_template_is_sandboxed_and_time_limited(guarded):
    handle, llm = guarded
    msgs = [{"role": "user", "content": "hi there"}]
    with httpx.Client(base_url=handle.url, headers=AUTH, timeout=30) as c:
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "chat_template": LOOP_TEMPLATE})
        assert r.status_code == 400 and time.monotonic() - t0 < 15
        assert r.json()["error"]["param"] == "chat_template"
        assert "did not finish rendering within 1.5s" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        escape = "{{ messages.__class__.__mro__ }}"  # the sandbox refuses dunder access
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "chat_template": escape})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
        r = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": msgs, "chat_template": plain, "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("hi there", add_special_tokens=False))


# ---- item 3: every sampling parameter range-checked ----------------------------------------------------------

NONFINITE = [
    ('"temperature": NaN', "temperature"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": 1e400', "temperature"),
    ('"top_p": NaN', "top_p"),
    ('"min_p": -Infinity', "min_p"),
    ('"frequency_penalty": NaN', "frequency_penalty"),
    ('"top_k": 1000000000000000000000000000000', "top_k"),
    ('"top_k": -2', "top_k"),
    ('"seed": 1000000000000000000000000000000', "seed"),
    ('"stop_token_ids": [5, 100000000000]', "stop_token_ids.1"),
    ('"min_tokens": 100000000', "min_tokens"),
    ('"n": 0', "n"),
    ('"max_tokens": 0', "max_tokens"),
]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("field,param", NONFINITE)
def test_nonfinite_and_out_of_range_parameters_are_400(http, endpoint, field, param):
    if endpoint == "chat":
        path, base = "/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}]'
    else:
        path, base = "/v1/completions", '"prompt": "hi"'
    raw = '{"model": "' + MODEL + '", ' + base + ", " + field + "}"
    r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["param"] == param, err


# ---- item 4: a batch that can never be admitted is a 400, not a 429 -----------------------------------------


def test_batch_larger_than_max_queue_is_400_naming_the_limit(guarded):
    handle, _ = guarded
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1}
    r = httpx.post(handle.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "at most 2" in err["message"] and "--max-queue" in err["message"]
    r = httpx.post(handle.url + "/v1/completions", json={**body, "prompt": ["a", "b"]}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# ---- item 5: key before body; body size cap and read timeout --------------------------------------------------


def test_api_key_is_checked_before_a_huge_body_is_read(guarded):
    handle, _ = guarded
    t0 = time.monotonic()
    status, headers, raw = raw_request(handle, post_head(handle, "/v1/completions", 200_000_000, auth=False))
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    status, headers, raw = raw_request(handle, post_head(handle, "/v1/completions", 200_000_000))
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 5


def test_slow_body_gets_408_and_chunked_overflow_413(guarded):
    handle, _ = guarded
    t0 = time.monotonic()
    status, headers, raw = raw_request(handle, post_head(handle, "/v1/completions", 100), b'{"model": ')
    elapsed = time.monotonic() - t0
    assert status == 408 and json.loads(raw)["error"]["code"] == "request_timeout"
    assert 0.9 <= elapsed < 8, elapsed
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked"
    piece = b"x" * 16384
    chunks = b"".join(b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(6)) + b"0\r\n\r\n"
    status, _, raw = raw_request(handle, head, chunks)
    assert status == 413 and f"more than {CAP}" in json.loads(raw)["error"]["message"]
    assert httpx.get(handle.url + "/health", timeout=5).status_code == 200


# ---- item 6: the default completion length ----------------------------------------------------------------------


def test_chat_without_max_tokens_is_bounded_by_the_server_default(guarded):
    handle, llm = guarded
    messages = [
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": "let me compute"},
        {"role": "tool", "content": "4"},
    ]
    with openai.OpenAI(base_url=handle.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    ctx = llm.max_model_len
    body = {"model": MODEL, "prompt": list(range(5, ctx - 3 + 5)), "max_tokens": None, "ignore_eos": True}
    usage = httpx.post(handle.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == ctx - 3 and usage["completion_tokens"] == 3  # the context left


# ---- item 7: OpenAPI schema, 405 Allow, empty prompt ------------------------------------------------------------


def test_openapi_lists_the_real_error_answers(served):
    schema = httpx.get(served[0].url + "/openapi.json", timeout=10).json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    err = schema["components"]["schemas"]["ErrorResponse"]
    assert "error" in err["properties"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert {"200", "400", "401", "404", "408", "413", "429", "503"} <= set(responses)
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
        assert "Retry-After" in responses["429"]["headers"]


def test_405_carries_allow(http):
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == ERROR_KEYS
    r = http.post("/v1/models", json={})
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_empty_prompt_is_served_like_openai(client, served):
    # OpenAI accepts prompt "" for completions: the model continues from the start-of-text token.
    r = client.completions.create(model=MODEL, prompt="", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens == 3
