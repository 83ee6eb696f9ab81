"""``/v1/completions`` scoring requests (``echo`` + ``logprobs`` <= 1, ``max_tokens`` 0 or 1, greedy: lm-eval's
loglikelihood request) are scored in one engine-thread call (``server/scoring.py``) and answer exactly what the
per-prompt request path answers: the same tokens, text, offsets, finish reasons and usage, log-probs within 1e-5
(the direct path batches differently). Requests that could differ (sampling, 2 alternatives) take the request
path."""

from __future__ import annotations

import pytest

from .conftest import MODEL

PROMPTS = [[5, 17, 42, 9, 77, 3, 64], [8, 8, 100, 23], [11], list(range(1, 60))]
# lm-eval's multiple-choice shape: one 40-token context (block 16) and four choices, an identical choice, the context
# alone, one leaving it after two blocks: the scorer feeds shared blocks once (``infer.scoring.score_prompts``)
CONTEXT = [(7 * i) % 90 + 3 for i in range(40)]
SHARED = [CONTEXT + c for c in ([11], [12, 13], [14, 15, 16], [17, 5, 5, 5, 5], [12, 13])]
SHARED += [CONTEXT, CONTEXT[:32] + [9, 9], [11]]


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
        {"prompt": SHARED, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
        {"prompt": "The quick brown fox jumps", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
    ],
)
def test_direct_scoring_answers_what_the_request_path_answers(served, http, monkeypatch, body):
    from polyrl.server import completions

    engine_calls = []
    real = completions.scored_prompts

    async def spy(engine, prompts):
        engine_calls.append(len(prompts))
        return await real(engine, prompts)

    monkeypatch.setattr(completions, "scored_prompts", spy)
    direct = _post(http, body)
    assert engine_calls == [len(body["prompt"]) if isinstance(body["prompt"], list) else 1]  # one call for the batch
    monkeypatch.setattr(completions, "direct_scoring", lambda *a: False)
    _close(direct, _post(http, body))


def test_requests_that_could_differ_take_the_request_path(served, http, monkeypatch):
    from polyrl.server import completions

    monkeypatch.setattr(completions, "scored_prompts", lambda *a, **k: pytest.fail("must not score directly"))
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


class _Vocab:
    """A tokenizer's ``decode`` over a few tricky token strings: JSON escapes, non-ASCII, two ids with one string."""

    STRINGS = ["a", ' "q"', "\\", "\n", "é", "\ufffd", "\ufffd", "<|eos|>", "\u2028", "x"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (skip_special_tokens and t == 7) else self.STRINGS[t] for t in ids)


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("generated", [True, False])
def test_scored_echo_json_is_what_the_general_formatter_writes(k, generated):
    """``scored_echo_json`` (the direct path's writer) gives the bytes ``json.dumps`` writes for the block that
    ``echo_logprobs`` + ``completion_logprobs`` build from the same scorer values: argmax equal to the token, argmax
    another token, another token with the same string (5 and 6), -inf and NaN (-9999.0), escapes."""
    import json
    import math

    from polyrl.infer.sequence import PromptLogprobs
    from polyrl.server.logprobs import TokenText, completion_logprobs, echo_logprobs, join_logprobs, scored_echo_json

    ids = [0, 1, 2, 3, 4, 5, 8, 9, 7, 6]
    lps = [-0.5, -1.25, -math.inf, -3.0, -0.1, math.nan, -2.5, -1e-7, -7.75]  # tokens 1 ..
    top_ids = [1, 9, 2, 0, 4, 6, 8, 3, 5, 9]  # the argmax after each position (the last: the next token)
    top_lps = [-0.5, -0.2, -0.3, -0.01, -0.1, -0.4, -2.5, -0.9, -0.05, -math.inf]
    text_of = TokenText(_Vocab())
    alts = [None] + [({a: lp if a == t else alp} if k else {}) for t, lp, a, alp in zip(ids[1:], lps, top_ids, top_lps)]
    want = echo_logprobs(text_of, ids, PromptLogprobs([None, *lps], alts, [None] * len(ids)), k)
    start = sum(len(t) for t in want["tokens"])
    if generated:
        gen = completion_logprobs(text_of, [top_ids[-1]], [top_lps[-1]], [{top_ids[-1]: top_lps[-1]}], k, start)
        want = join_logprobs(want, gen)
    got, length = scored_echo_json(text_of, ids, lps, top_ids, top_lps, k, generated)
    assert got == json.dumps(want, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert length == start == len(_Vocab().decode(ids))
    parsed = json.loads(got)
    assert parsed["top_logprobs"][9] == {"\ufffd": -0.05 if k else -7.75}  # id 6, argmax 5: one string, one key
    assert parsed["token_logprobs"][3] == -9999.0 and parsed["token_logprobs"][6] == -9999.0


def _general_block(text_of, ids, lps, top_ids, top_lps, k, generated) -> str:
    """What the request path's formatter writes for one directly scored prompt (the reference)."""
    import json

    from polyrl.infer.sequence import PromptLogprobs
    from polyrl.server.logprobs import completion_logprobs, echo_logprobs, join_logprobs

    alts = [None] + [({a: lp if a == t else alp} if k else {}) for t, lp, a, alp in zip(ids[1:], lps, top_ids, top_lps)]
    want = echo_logprobs(text_of, ids, PromptLogprobs([None, *lps], alts, [None] * len(ids)), k)
    if generated:
        start = sum(len(t) for t in want["tokens"])
        gen = completion_logprobs(text_of, [top_ids[-1]], [top_lps[-1]], [{top_ids[-1]: top_lps[-1]}], k, start)
        want = join_logprobs(want, gen)
    return json.dumps(want, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("generated", [True, False])
def test_scored_echo_blocks_of_a_request_with_shared_contexts(k, generated):
    """The blocks of a whole request at once are each prompt's reference bytes, also where a prompt reuses the texts
    of the previous prompt's common prefix: equal values (reused), a value that differs (not reused), a -0.0 where
    the previous prompt has 0.0 (equal as floats, written differently: not reused), a one-token prompt."""
    import math

    from polyrl.server.logprobs import TokenText, _shared_positions, scored_echo_blocks

    ctx = [0, 1, 2, 3, 4, 5, 8]
    prompts = [ctx + [9], ctx + [7, 6], ctx + [9, 9], [2, 3], [2, 3, 4], [2, 3, 5], [4], [4, 1]]
    lps = [[-0.5, -1.25, -math.inf, -3.0, -0.1, math.nan, -2.5, -1e-7, -7.75][: len(p) - 1] for p in prompts]
    top_ids = [[1, 9, 2, 0, 4, 6, 8, 3, 5, 9, 1][: len(p)] for p in prompts]
    top_lps = [[-0.5, -0.2, -0.3, -0.01, -0.1, -0.4, -2.5, -0.9, -0.05, -math.inf, -1.0][: len(p)] for p in prompts]
    lps[2][6] = -2.4  # after the shared context: its own value
    lps[4][0], lps[5][0] = 0.0, -0.0
    top_lps[3][0] = -0.25  # [2, 3] and [2, 3, 4] differ at their one shared position
    text_of = TokenText(_Vocab())
    got = scored_echo_blocks(text_of, prompts, lps, top_ids, top_lps, k, generated)
    want = [_general_block(text_of, *args, k, generated) for args in zip(prompts, lps, top_ids, top_lps)]
    assert got == want
    shared = [_shared_positions(prompts, lps, top_ids, top_lps, i) for i in range(1, len(prompts))]
    assert shared == [6, 6, 0, 0, 0, 0, 0]  # 6: the context's 7 tokens - 1 (its NaN is one object: the same value)


def test_scored_echo_blocks_random_requests():
    """Random requests (neighbours sharing prefixes with the same or other values, -inf, NaN, 0.0 and -0.0, argmax
    equal to the token or not): every block is the general formatter's bytes."""
    import math
    import random

    from polyrl.server.logprobs import TokenText, scored_echo_blocks

    rng = random.Random(0)
    special = [-math.inf, math.nan, 0.0, -0.0, -9999.0, -12345.5, -1e-7]

    def value():
        return rng.choice(special) if rng.random() < 0.1 else -rng.expovariate(0.3)

    text_of = TokenText(_Vocab())
    for _ in range(40):
        prompts, lps, top_ids, top_lps = [], [], [], []
        for _ in range(rng.randint(1, 8)):
            p = [rng.randrange(10) for _ in range(rng.randint(1, 12))]
            if prompts and rng.random() < 0.5:
                p = prompts[-1][: rng.randint(1, len(prompts[-1]))] + p[: rng.randint(0, 3)]
            lps.append([value() for _ in p[1:]])
            top_ids.append([t if rng.random() < 0.4 else rng.randrange(10) for t in p[1:]] + [rng.randrange(10)])
            top_lps.append([value() for _ in p])
            if prompts and rng.random() < 0.7:  # the shared prefix scored with the same values (or a sign flip)
                c = next((j for j, (x, y) in enumerate(zip(p, prompts[-1])) if x != y), min(len(p), len(prompts[-1])))
                c = max(0, c - 1)
                lps[-1][:c] = [-x if x == 0.0 and rng.random() < 0.5 else x for x in lps[-2][:c]]
                top_ids[-1][:c], top_lps[-1][:c] = top_ids[-2][:c], top_lps[-2][:c]
            prompts.append(p)
        for k in (0, 1):
            for generated in (True, False):
                got = scored_echo_blocks(text_of, prompts, lps, top_ids, top_lps, k, generated)
                want = [_general_block(text_of, *a, k, generated) for a in zip(prompts, lps, top_ids, top_lps)]
                assert got == want


def test_out_of_vocabulary_token_ids_are_a_400(served, http):
    _, llm = served
    for prompt in ([[5, 6], [5, llm.vocab_size]], [[-1, 3]], [3, llm.vocab_size + 7]):
        body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "outside the vocabulary" in err["message"] and err["param"] == "prompt"


def test_concurrent_scoring_calls_run_as_one_engine_call(reference_llm, monkeypatch):
    """Scoring calls queued together (concurrent lm-eval requests) run as one ``score_prompts`` call, each caller
    getting its own prompts' values (equal to scoring them alone); a merged call that fails is retried per caller,
    so only the caller whose prompt is bad gets the error; a round is capped in tokens."""
    import asyncio

    from polyrl.errors import UserError
    from polyrl.infer.scoring import score_prompts
    from polyrl.server.async_engine import AsyncEngine
    from polyrl.server.metrics import ServerMetrics

    engine = AsyncEngine(reference_llm, metrics=ServerMetrics())
    loop = asyncio.new_event_loop()
    try:
        batches = [PROMPTS[:2], PROMPTS[2:], [[7, 7, 7]]]
        futs = [loop.create_future() for _ in batches]
        for prompts, fut in zip(batches, futs):
            engine._jobs.put((prompts, fut, loop))
        engine._run_jobs()  # what the engine thread does between steps
        got = loop.run_until_complete(asyncio.gather(*futs))
        assert engine.metrics.scoring_calls.get() == 1 and engine.metrics.scoring_prompts.get() == len(PROMPTS) + 1
        for prompts, res in zip(batches, got):
            alone = score_prompts(reference_llm, prompts)
            assert res.top_ids == alone.top_ids
            for a, b in zip(res.token_logprobs, alone.token_logprobs):
                assert a == pytest.approx(b, abs=1e-5)

        bad = [[5, 6], []]  # an empty prompt: score_prompts refuses it
        futs = [loop.create_future() for _ in range(3)]
        for prompts, fut in zip([PROMPTS[:1], bad, PROMPTS[1:2]], futs):
            engine._jobs.put((prompts, fut, loop))
        engine._run_jobs()
        ok1, err, ok2 = loop.run_until_complete(asyncio.gather(*futs, return_exceptions=True))
        assert isinstance(err, UserError) and "empty" in str(err)
        assert ok1.top_ids == got[0].top_ids[:1] and ok2.top_ids == got[0].top_ids[1:2]
        assert engine.metrics.scoring_calls.get() == 3  # 1 above + the two good callers alone

        # a round takes at most MERGE_BATCHES batches of tokens (here: one call at a time), one round per
        # _run_jobs, so that running generations get a step between rounds
        monkeypatch.setattr("polyrl.server.async_engine.MERGE_BATCHES", 0)
        futs = [loop.create_future() for _ in batches]
        for prompts, fut in zip(batches, futs):
            engine._jobs.put((prompts, fut, loop))
        for rounds in (1, 2, 3):
            engine._run_jobs()
            loop.run_until_complete(asyncio.sleep(0))
            assert [f.done() for f in futs] == [i < rounds for i in range(3)]
        assert not engine._has_jobs() and engine.metrics.scoring_calls.get() == 6
        assert [f.result().top_ids for f in futs] == [r.top_ids for r in got]
    finally:
        loop.close()
