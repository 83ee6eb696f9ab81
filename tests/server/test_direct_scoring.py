"""``/v1/completions`` scoring requests (``echo`` + ``logprobs`` <= 1, ``max_tokens`` 0 or 1, greedy: lm-eval's
loglikelihood request) are scored in one engine-thread call (``server/scoring.py``) and answer exactly what the
per-prompt request path answers: the same tokens, text, offsets, finish reasons and usage, log-probs within 1e-5
(the direct path batches differently). Requests that could differ (sampling, 2 alternatives) take the request
path."""

from __future__ import annotations

import pytest

from .conftest import MODEL

PROMPTS = [[5, 17, 42, 9, 77, 3, 64], [8, 8, 100, 23], [11], list(range(1, 60))]


def _close(a, b) -> None:
    """Equal JSON, floats within 1e-5."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-5)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y)
    else:
        assert a == b


def _post(http, body):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"], out["usage"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
        {"prompt": PROMPTS, "echo": True, "logprobs": 0, "max_tokens": 0},
        {"prompt": "The quick brown fox jumps", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
    ],
)
def test_direct_scoring_answers_what_the_request_path_answers(served, http, monkeypatch, body):
    from polyrl.server import completions

    engine_calls = []
    real = completions.scored_outputs

    async def spy(engine, *a, **k):
        engine_calls.append(len(a[0]))
        return await real(engine, *a, **k)

    monkeypatch.setattr(completions, "scored_outputs", spy)
    direct = _post(http, body)
    assert engine_calls == [len(PROMPTS) if isinstance(body["prompt"], list) else 1]  # one call for the batch
    monkeypatch.setattr(completions, "direct_scoring", lambda *a: False)
    _close(direct, _post(http, body))


def test_requests_that_could_differ_take_the_request_path(served, http, monkeypatch):
    from polyrl.server import completions

    monkeypatch.setattr(completions, "scored_outputs", lambda *a, **k: pytest.fail("must not score directly"))
    for extra in ({"temperature": 0.7, "seed": 1}, {"temperature": 0, "logprobs": 2}, {"temperature": 0, "n": 2}):
        body = {"prompt": PROMPTS[:2], "echo": True, "logprobs": 1, "max_tokens": 1, **extra}
        choices, _ = _post(http, body)
        assert len(choices) == 2 * body.get("n", 1)


def test_a_batch_the_engine_cannot_score_now_takes_the_request_path(served, http, monkeypatch):
    from polyrl.errors import UserError

    _, llm = served
    body = {"prompt": PROMPTS[:2], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    want, _ = _post(http, body)

    def full(*a, **k):
        raise UserError("the KV cache has 0 free blocks; scoring needs 3")

    monkeypatch.setattr("polyrl.server.async_engine.score_prompts", full)
    got, _ = _post(http, body)
    _close(got, want)


def test_scoring_between_the_steps_of_running_requests(served, http):
    """A scoring batch that arrives while generations run is scored between their steps (the engine is not idle)
    with the same numbers, and the generations finish whole."""
    import threading

    body = {"prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    idle, _ = _post(http, body)
    gen = {"prompt": [[3, 4, 5]] * 4, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    results = []
    worker = threading.Thread(target=lambda: results.append(_post(http, gen)))
    worker.start()
    busy = [_post(http, body)[0] for _ in range(3)]
    worker.join(60)
    for got in busy:
        _close(got, idle)
    ((choices, usage),) = results
    assert usage["completion_tokens"] == 4 * 120
