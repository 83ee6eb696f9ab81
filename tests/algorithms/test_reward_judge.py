"""Issue 29 (2): the LLM-judge reward against a real HTTP server started by the test (an OpenAI-compatible
``/v1/chat/completions`` whose reply depends on the completion): scores, malformed scores, an endpoint that is
down, a timeout, retries after a 500, the concurrency limit, and a judge summed with a reward function."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from polyrl.algorithms.reward_sources import RewardConfig, open_rewards, parse_spec
from polyrl.algorithms.reward_sources.judge import JudgeConfig, JudgeScorer, chat_url, parse_score
from polyrl.errors import ConfigError

REPLIES = {
    "good": "Score: 9",
    "bad": "score = 2",
    "bare": " 7 ",
    "garbage": "What a lovely answer!",
    "huge": "Score: 42",
    "think": "<think>maybe Score: 1</think>\nScore: 8",
}


class JudgeServer:
    """A real HTTP judge in a thread. The reply is ``REPLIES[completion]``; ``slow`` sleeps ``slow_s`` first;
    ``flaky`` fails with HTTP 500 on its first call. Records requests and the most requests in flight at once."""

    def __init__(self, slow_s: float = 2.0, delay_s: float = 0.0) -> None:
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.flaky_calls = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "judge-1", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                finished = []

                def reply_with(code: int, payload: dict) -> None:
                    # out of flight *before* the reply is written: once the client reads it, it may send the next
                    # request at once, and that one must not count this one as still in flight
                    finish()
                    self._send(code, payload)

                def finish() -> None:
                    if not finished:
                        finished.append(True)
                        with server.lock:
                            server.in_flight -= 1

                try:
                    text = body["messages"][-1]["content"]
                    completion = text.split("Response:\n", 1)[1].split("\n\n", 1)[0]
                    if delay_s:
                        time.sleep(delay_s)
                    if completion == "slow":
                        time.sleep(slow_s)
                    if completion == "flaky":
                        with server.lock:
                            server.flaky_calls += 1
                            first = server.flaky_calls == 1
                        if first:
                            return reply_with(500, {"error": {"message": "overloaded"}})
                    reply = REPLIES.get(completion, "Score: 5")
                    reply_with(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})
                finally:
                    finish()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def judge():
    server = JudgeServer()
    yield server
    server.close()


EX = {"prompt": "What is 2+2?", "answer": "4", "metadata": {}}


def test_scores_are_parsed_and_normalised(judge):
    names = ["good", "bad", "bare", "think", "other"]
    with open_rewards(f"judge:{judge.url}", workers=0) as scorer:
        res = scorer.score(names, [EX] * len(names))
    assert res.rewards == pytest.approx([0.9, 0.2, 0.7, 0.8, 0.5])
    assert res.num_failures == 0 and res.metrics()["reward/judge"] == pytest.approx(0.62)
    sent = judge.requests[0]
    assert sent["model"] == "judge-1" and sent["temperature"] == 0.0  # the first model the server lists
    assert (
        "What is 2+2?" in sent["messages"][0]["content"]
        and "Reference answer (may be empty):\n4" in (sent["messages"][0]["content"])
    )


def test_malformed_and_out_of_range_scores_are_non_number_failures(judge):
    with open_rewards(f"judge:{judge.url}", workers=0, failure_reward=-1.0) as scorer:
        res = scorer.score(["garbage", "huge", "good"], [EX] * 3)
    assert res.rewards == [-1.0, -1.0, pytest.approx(0.9)]
    assert res.failures["non_number"] == 2 and scorer.totals["non_number"] == 2
    assert any("no score in the judge's reply 'What a lovely answer!'" in m for m in res.messages)
    assert any("outside [0, 10]" in m for m in res.messages)


def test_endpoint_down_is_an_error_after_the_retries():
    # a port held bound, never listening: connections are refused, and no other process (nor a client's own
    # ephemeral port: a self-connection) can take it while the test runs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        cfg = RewardConfig(judge=JudgeConfig(retries=2, backoff=0.05, model="m"))
        t0 = time.monotonic()
        with open_rewards(f"judge:http://127.0.0.1:{port}", cfg, failure_reward=-0.5) as scorer:
            res = scorer.score(["good", "bad"], [EX, EX])
    assert res.rewards == [-0.5, -0.5] and res.failures["error"] == 2
    assert "unreachable" in res.messages[0] and f"127.0.0.1:{port}/v1/chat/completions" in res.messages[0]
    assert time.monotonic() - t0 >= 0.05 + 0.1  # backoff 0.05 then 0.1 before giving up


def test_timeout_is_counted_and_a_500_is_retried(judge):
    cfg = RewardConfig(judge=JudgeConfig(url=judge.url, timeout=0.3, retries=1, backoff=0.0))
    with open_rewards("judge", cfg) as scorer:
        res = scorer.score(["slow", "flaky", "good"], [EX] * 3)
    assert res.failures["timeout"] == 1 and "no judge reply within 0.3s" in res.messages[0]
    assert res.rewards[1:] == pytest.approx([0.5, 0.9]) and judge.flaky_calls == 2


def test_concurrency_limit_holds():
    server = JudgeServer(delay_s=0.15)
    try:
        cfg = RewardConfig(judge=JudgeConfig(url=server.url, model="j", concurrency=3))
        with open_rewards("judge", cfg) as scorer:
            res = scorer.score(["good"] * 12, [EX] * 12)
    finally:
        server.close()
    assert res.rewards == pytest.approx([0.9] * 12)
    assert server.max_in_flight == 3


def test_judge_summed_with_a_reward_function(judge):
    with open_rewards(f"exact_match+0.5*judge:{judge.url}", workers=0) as scorer:
        res = scorer.score(["The answer is \\boxed{4}. good", "good"], [EX, EX])
    # the completion text sent to the judge is the whole one; only the exact "good" maps to 9
    assert res.rewards == pytest.approx([1.0 + 0.5 * 0.5, 0.0 + 0.5 * 0.9])


def test_spec_parsing_and_config_errors():
    terms = parse_spec("exact_match+0.2*think_format+0.5*judge:http://h:1/v1")
    assert [(t.kind, t.weight, t.arg) for t in terms] == [
        ("functions", 1.0, "exact_match+0.2*think_format"),
        ("judge", 0.5, "http://h:1/v1"),
    ]
    assert [t.kind for t in parse_spec("/tmp/my_reward.py:fn")] == ["functions"]
    assert chat_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_url("https://api.x.com/v1/") == "https://api.x.com/v1/chat/completions"
    with pytest.raises(ConfigError, match="not an http"):
        chat_url("localhost:8000")
    with pytest.raises(ConfigError, match="reward.judge.template is not a valid template"):
        JudgeConfig(template="rate {response}")
    with pytest.raises(ConfigError, match="max_score > min_score"):
        JudgeConfig(min_score=5, max_score=5)
    cfg = JudgeConfig(score_pattern=r"(\d+)/10", max_score=10)
    assert parse_score("I give it 6/10", cfg) == pytest.approx(0.6)
    with pytest.raises(ConfigError, match="the judge reward has no URL"):
        JudgeScorer(JudgeConfig())
