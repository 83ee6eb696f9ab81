"""Many streaming clients at once, the queue limit (429), client disconnects aborting engine work, and a
graceful shutdown that completes the requests in flight."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from .conftest import API_KEY, MODEL, make_llm

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def wait_for(cond, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_64_concurrent_streaming_clients(served):
    import openai

    handle, llm = served
    max_tokens = 8

    async def one(ac, i):
        stream = await ac.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"client {i} says " + "hi " * (i % 7)}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        token_chunks = [c for c in chunks[1:] if c.choices and c.choices[0].finish_reason is None]
        n_logprobs = sum(len(c.choices[0].logprobs.content) for c in token_chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return len(token_chunks), n_logprobs, finish, chunks[-1].usage

    async def main():
        async with openai.AsyncOpenAI(base_url=handle.base_url, api_key=API_KEY, max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for n_chunks, n_logprobs, finish, usage in results:
        assert n_chunks == max_tokens and n_logprobs == max_tokens
        assert finish == ["length"]
        assert usage.completion_tokens == max_tokens
        assert usage.total_tokens == usage.prompt_tokens + max_tokens
    engine = handle.app.state.polyrl.engine
    wait_for(lambda: engine.num_in_flight == 0, what="the engine to go idle")


@pytest.fixture()
def limited(tiny_model_dir):
    """One sequence at a time, one request may wait: the second waiting request gets 429."""
    from polyrl.server import ServeConfig, start_server

    llm = make_llm(tiny_model_dir, max_num_seqs=1, max_model_len=2048, num_blocks=160)
    handle = start_server(
        llm, ServeConfig(port=0, served_model_name=MODEL, api_key=API_KEY, max_queue=1, log_level="warning")
    )
    yield handle, llm
    handle.stop()


def test_queue_limit_429_and_disconnect_aborts(limited):
    handle, llm = limited
    engine = handle.app.state.polyrl.engine
    long = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=handle.url, headers=AUTH, timeout=60) as c:
            started, release = asyncio.Event(), asyncio.Event()

            async def stream_a():
                async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                    assert r.status_code == 200
                    # Keep the line iterator referenced: a dropped one is finalised, which closes the stream.
                    lines = r.aiter_lines()
                    while not (await lines.__anext__()).startswith("data: {"):
                        pass
                    started.set()
                    await release.wait()  # leaving the block closes the connection mid-stream

            a = asyncio.create_task(stream_a())
            await asyncio.wait_for(started.wait(), 30)
            b = asyncio.create_task(c.post("/v1/completions", json=long))  # waits: the only slot is A's
            for _ in range(2000):
                if engine.num_in_flight == 2 and engine.snapshot["waiting_requests"] == 1:
                    break
                await asyncio.sleep(0.005)
            assert engine.num_in_flight == 2
            r = await c.post("/v1/completions", json=long)
            assert r.status_code == 429 and r.headers.get("retry-after") == "1"
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and set(err) == {"message", "type", "param", "code"}
            b.cancel()  # the client of B hangs up while B waits
            for _ in range(2000):
                if engine.num_in_flight == 1:
                    break
                await asyncio.sleep(0.005)
            assert engine.num_in_flight == 1
            release.set()  # A's client hangs up mid-stream
            await a
            for _ in range(2000):
                if engine.num_in_flight == 0:
                    break
                await asyncio.sleep(0.005)
            assert engine.num_in_flight == 0

    asyncio.run(scenario())
    # A was cut short and B never ran: far fewer than the 2000 tokens a finished A alone would have made.
    assert llm.stats()["num_generated_tokens"] < 2000
    assert llm.stats()["num_running"] == 0 and llm.stats()["num_waiting"] == 0
    # The server keeps serving.
    r = httpx.post(handle.url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_graceful_shutdown_completes_in_flight(tiny_model_dir):
    from polyrl.server import ServeConfig, start_server

    llm = make_llm(tiny_model_dir, max_num_seqs=4)
    handle = start_server(llm, ServeConfig(port=0, served_model_name=MODEL, log_level="warning"))
    engine = handle.app.state.polyrl.engine
    body = {"model": MODEL, "prompt": "count", "max_tokens": 120, "ignore_eos": True}
    results: dict[str, object] = {}

    def plain():
        results["plain"] = httpx.post(handle.url + "/v1/completions", json=body, timeout=60).json()

    def streamed():
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", handle.url + "/v1/completions", json=payload, timeout=60) as r:
            results["stream"] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    wait_for(lambda: engine.num_in_flight == 2 and llm.stats()["num_generated_tokens"] > 0, what="both running")
    handle.stop()  # returns after uvicorn finished the requests and the engine drained
    for t in threads:
        t.join(30)
    assert not handle.running and not engine.alive
    assert results["plain"]["usage"]["completion_tokens"] == 120
    assert results["plain"]["choices"][0]["finish_reason"] == "length"
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 120
    with pytest.raises(httpx.ConnectError):
        httpx.get(handle.url + "/health", timeout=2)


def test_engine_failure_is_reported_not_hung(tiny_model_dir):
    """A step that raises (here: the KV cache was released under the server) fails the requests in flight with a
    500 server_error body, then /health says 503 and new requests get 503 instead of hanging."""
    from polyrl.server import ServeConfig, start_server

    llm = make_llm(tiny_model_dir, max_num_seqs=4)
    with start_server(llm, ServeConfig(port=0, served_model_name=MODEL, log_level="critical")) as handle:
        llm.release()
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        r = httpx.post(handle.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "KV cache is released" in r.json()["error"]["message"]
        h = httpx.get(handle.url + "/health", timeout=10)
        assert h.status_code == 503 and "engine failed" in h.json()["detail"]
        r = httpx.post(handle.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
