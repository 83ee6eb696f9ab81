"""Servers for the server tests: the tiny checkpoint in the rollout engine behind a real uvicorn on
127.0.0.1 (free port), started once per module, plus a second engine over the same weights for reference
outputs (the served engine belongs to its engine thread)."""

from __future__ import annotations

import re

import pytest
import torch

API_KEY = "test-key"
MODEL = "tiny"


def make_llm(model_dir, **engine_kw):
    from polyrl.infer import LLM, RolloutConfig

    kw = dict(block_size=16, num_blocks=512, max_num_seqs=64, max_model_len=256)
    kw.update(engine_kw)
    return LLM.from_pretrained(str(model_dir), RolloutConfig(**kw), dtype="float32", device="cpu")


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (labels as written, e.g. 'endpoint="/health",status="200"')."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    m = re.search(r"^" + pattern + r"$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    """Tiny matmuls run faster on one thread, and CI's two cores are shared with the HTTP threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(handle, llm) of a server with an API key, started once per module."""
    from polyrl.server import ServeConfig, start_server

    llm = make_llm(tiny_model_dir)
    handle = start_server(llm, ServeConfig(port=0, served_model_name=MODEL, api_key=API_KEY, log_level="warning"))
    yield handle, llm
    handle.stop()


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dir):
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[0].base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(served):
    import httpx

    with httpx.Client(base_url=served[0].url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c
