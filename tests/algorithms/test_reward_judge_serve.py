"""Issue 29 (2): the judge against a real ``polyrl serve`` (the tiny checkpoint behind uvicorn): the model name
comes from ``/v1/models``, the key from ``api_key_env``, every reply is parsed (the random tiny model writes no
score, so a reply is a counted ``non_number`` unless it happens to hold one), and a wrong key is an HTTP 401 ``error``
that is not retried."""

from __future__ import annotations

import time

import pytest

from polyrl.algorithms.reward_sources.judge import JudgeConfig, JudgeScorer

KEY = "judge-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from polyrl.infer import LLM, RolloutConfig
    from polyrl.server import ServeConfig, start_server

    cfg = RolloutConfig(block_size=16, num_blocks=256, max_num_seqs=16, max_model_len=512)
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="float32", device="cpu")
    handle = start_server(llm, ServeConfig(port=0, served_model_name="tiny-judge", api_key=KEY, log_level="warning"))
    yield handle
    handle.stop()


def test_judge_against_polyrl_serve(server, monkeypatch):
    monkeypatch.setenv("POLYRL_TEST_JUDGE_KEY", KEY)
    cfg = JudgeConfig(url=server.base_url, api_key_env="POLYRL_TEST_JUDGE_KEY", max_tokens=8, concurrency=2)
    judge = JudgeScorer(cfg)
    try:
        outs = judge.outcomes(["4", "five", "2+2=4"], [{"prompt": "What is 2+2?", "answer": "4"}] * 3)
    finally:
        judge.close()
    assert judge.model() == "tiny-judge"
    for kind, value, _ in outs:
        assert kind in ("ok", "non_number"), value
        assert kind == "non_number" or 0.0 <= value <= 1.0
        assert kind == "ok" or "judge's" in value


def test_wrong_key_is_a_401_error_without_retries(server, monkeypatch):
    monkeypatch.setenv("POLYRL_TEST_JUDGE_KEY", "wrong")
    cfg = JudgeConfig(url=server.base_url, model="tiny-judge", api_key_env="POLYRL_TEST_JUDGE_KEY", backoff=5.0)
    judge = JudgeScorer(cfg)
    t0 = time.monotonic()
    try:
        [(kind, message, _)] = judge.outcomes(["4"], [{"prompt": "q", "answer": None}])
    finally:
        judge.close()
    assert kind == "error" and "judge HTTP 401" in message
    assert time.monotonic() - t0 < 5.0  # not retried: a retry would first wait the 5 s backoff
