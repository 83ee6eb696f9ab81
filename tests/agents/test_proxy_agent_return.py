"""Proxy mode: what an agent function returns is its reward; a return value that is not a finite number (a string,
NaN, a bool) is the agent's failure, counted with the failure reward and a message saying what it returned, never an
exception out of ``run_agents`` (which ended the training run with a traceback)."""

from __future__ import annotations

import math

import httpx
import pytest

openai = pytest.importorskip("openai")

STATUS: dict[str, int] = {}  # the /reward answers the agent got
RETURNS = {"number": 0.75, "string": "good", "nan": math.nan, "bool": True, "none_after_post": None}


def agent(base_url: str, example: dict) -> object:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    if example["kind"] == "none_after_post":
        url = base_url.removesuffix("/v1") + "/reward"
        STATUS["nan"] = httpx.post(url, content=b'{"reward": NaN}').status_code  # not a reward: a 400
        httpx.post(url, json={"reward": 0.5}).raise_for_status()
    return RETURNS[example["kind"]]


def test_an_agent_returning_a_non_number_is_a_counted_failure(tiny_llm):
    from polyrl.agents.proxy_server import AgentProxy

    examples = [{"prompt": k, "kind": k} for k in RETURNS]
    with AgentProxy(tiny_llm, max_tokens=8) as proxy:
        eps = proxy.run_agents(agent, examples, n=1, seeds=[0] * len(examples), timeout=300.0, failure_reward=-1.0)
        failures = dict(proxy.failures)
    assert failures == {"error": 3, "timeout": 0, "no_reward": 0}
    assert [e.reward for e in eps] == [0.75, -1.0, -1.0, -1.0, 0.5]
    assert [e.status for e in eps] == ["done", "env_error", "env_error", "env_error", "done"]
    assert "the agent returned 'good' (str), not a finite number" in eps[1].error
    assert "returned nan (float)" in eps[2].error and "returned True (bool)" in eps[3].error
    assert STATUS == {"nan": 400}
