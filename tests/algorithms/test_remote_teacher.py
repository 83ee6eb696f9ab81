"""A remote distillation teacher (``--teacher-url``) against a real ``polyrl serve`` started in-process over the same
tiny checkpoint: its per-token log-probs equal the in-process teacher's (fp32 CPU, 1e-5); the tokenizer probe refuses
a server of another tokenizer; an unreachable server fails after its retries with what to check; a distillation run
trains from the server's scores."""

from __future__ import annotations

import json
import time

import pytest
import torch

from polyrl.errors import ConfigError


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from polyrl.infer import LLM, RolloutConfig
    from polyrl.server import ServeConfig, start_server

    torch.set_num_threads(1)
    cfg = RolloutConfig(block_size=16, num_blocks=512, max_num_seqs=64, max_model_len=256)
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="float32", device="cpu")
    handle = start_server(llm, ServeConfig(port=0, served_model_name="teacher", log_level="warning"))
    yield handle
    handle.stop()


def _samples():
    from polyrl.algorithms.rl_batch import Sample

    return [
        Sample([5, 9, 11, 40], [7, 8, 3], [0.0] * 3, "length", ""),
        Sample([5, 9, 11, 40], [2, 100, 64, 1], [0.0] * 2, "stop", "", mask=[1, 0, 1, 0]),
        Sample([300, 12], [1500, 2000, 47, 47, 5], [0.0] * 5, "length", ""),
    ] + [Sample([17, 18, 19], [k, k + 1], [0.0] * 2, "length", "") for k in range(20, 60)]


def test_remote_teacher_equals_the_in_process_teacher(served, tiny_model_dir):
    from polyrl.algorithms.remote_teacher import RemoteTeacher
    from polyrl.algorithms.teacher import TeacherScorer
    from polyrl.models.checkpoint import load_tokenizer

    remote = RemoteTeacher(served.url, concurrency=3, batch_size=8)
    assert remote.model == "teacher"
    remote.check_tokenizer(load_tokenizer(tiny_model_dir))  # the same tokenizer: no error
    samples = _samples()
    got = remote.score(samples)
    want = TeacherScorer(str(tiny_model_dir), "float32").score(samples)
    assert [len(x) for x in got] == [3, 2, 5] + [2] * 40  # masked sample: its policy tokens only
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)
    assert remote.requests >= 1 + 1 + 6  # /models, the probe, 43 prompts in batches of 8
    assert min(min(x) for x in got) < -1.0  # real log-probs, not zeros


def test_remote_teacher_refuses_another_tokenizer(served):
    from polyrl.algorithms.remote_teacher import RemoteTeacher
    from polyrl.models.tokenizer import build_tokenizer

    other = build_tokenizer(2048, trained_vocab=600, seed=1)
    with pytest.raises(ConfigError, match="tokenizes differently from the student"):
        RemoteTeacher(served.url).check_tokenizer(other)


def test_unreachable_teacher_fails_after_retries():
    import socket

    from polyrl.algorithms.remote_teacher import RemoteTeacher, TeacherServerError

    # a port held bound, never listening: connections are refused, and no other process (nor a client's own
    # ephemeral port: a self-connection) can take it while the test runs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        remote = RemoteTeacher(f"http://127.0.0.1:{port}/v1", timeout=2, retries=2, backoff=0.01)
        t0 = time.perf_counter()
        with pytest.raises(TeacherServerError, match="failed 3 time"):
            _ = remote.model
    assert remote.requests == 3 and remote.retried == 2 and time.perf_counter() - t0 < 10


def test_bad_request_is_not_retried(served):
    from polyrl.algorithms.remote_teacher import RemoteTeacher, TeacherServerError

    remote = RemoteTeacher(served.url, retries=3)
    with pytest.raises(TeacherServerError, match="answered 400"):
        remote.prompt_logprobs([[5, 10**7]])  # an id past the vocabulary
    assert remote.retried == 0


def test_a_web_page_at_the_teacher_url_is_named_not_a_traceback():
    """--teacher-url pointing at a server that answers HTML (a web UI, a login proxy) with status 200 ended in a
    JSONDecodeError traceback; it is now a TeacherServerError naming the URL, the content type and the start of the
    body, not retried."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from polyrl.algorithms.remote_teacher import RemoteTeacher, TeacherServerError

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b"<html><body>sign in</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        remote = RemoteTeacher(f"http://127.0.0.1:{server.server_address[1]}", retries=2, backoff=0.01)
        with pytest.raises(TeacherServerError, match=r"/v1/models answered text/html, not JSON: '<html><body>sign in"):
            _ = remote.model
        assert remote.requests == 1
    finally:
        server.shutdown()
        server.server_close()


def test_distill_run_with_teacher_url(served, tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config

    out = tmp_path / "run"
    raw = {
        "algo": "distill",
        "model": str(tiny_model_dir),
        "out": str(out),
        "data": {"path": "builtin:arithmetic?max=9&n=32"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 1e-2},
        "train": {"max_steps": 1, "log_every": 100},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "distill": {
            "teacher_url": served.url,
            "reward_workers": 0,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 4,
        },
    }
    runner.run(config.build(raw))
    (rec,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the teacher is the student's own weights: before the update the reverse KL is 0 up to float noise
    assert abs(rec["distill/reverse_kl"]) < 1e-4 and rec["optimizer_steps"] == 1
