"""The agent proxy's /v1/responses: an agent written against the Responses API (the official openai client) is
recorded like a chat agent: its second call continues the first call's segment token-exactly."""

from __future__ import annotations

import openai
import pytest

TOOL = {"type": "function", "name": "lookup", "description": "look up", "parameters": {"type": "object"}}


def responses_agent(base_url: str, example: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    items = [{"role": "user", "content": example["prompt"]}]
    first = client.responses.create(model="m", instructions="Be brief.", input=items, tools=[TOOL], max_output_tokens=6)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"role": "user", "content": "And then?"})
    second = client.responses.create(
        model="m", instructions="Be brief.", input=items, tools=[TOOL], max_output_tokens=6
    )
    example["seen"] += [first, second]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="x", previous_response_id=first.id)
    return 1.0


def test_responses_agent_is_recorded_token_exactly(tiny_llm):
    from polyrl.agents.proxy_server import AgentProxy

    example = {"prompt": "task", "seen": []}
    with AgentProxy(tiny_llm, max_tokens=8) as proxy:
        (ep,) = proxy.run_agents(responses_agent, [example], n=1, seeds=[0], timeout=300.0)
        assert dict(proxy.failures) == {"error": 0, "timeout": 0, "no_reward": 0}
    first, second = example["seen"]
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.output and first.usage.output_tokens == len(first.model_extra["token_ids"])
    assert ep.num_turns == 2 and ep.reward == 1.0  # one segment: the second call extended the first
    (s0, e0), (s1, e1) = ep.turns
    assert ep.ids[s0:e0] == first.model_extra["token_ids"] and ep.ids[s1:e1] == second.model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"] == ep.prompt_ids + ep.ids[:s1]
    assert "lookup" in tiny_llm.tokenizer.decode(ep.prompt_ids)  # the tools rendered (system-prompt fallback)
