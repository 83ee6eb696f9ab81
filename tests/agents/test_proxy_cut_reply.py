"""The agent proxy on a reply that the token limit cut inside a tool call, as `polyrl serve` answers it: chat
finish_reason "length" with the whole calls kept and the half-written one dropped (no call markup as content);
Responses status "incomplete" (reason max_output_tokens) with only the whole calls as items. The replies are forced
calls (the run's format is the Hermes call grammar), sampled with a seed, so a lower limit cuts the same reply."""

from __future__ import annotations

import openai

from polyrl.agents.tool_parsers import HermesParser
from polyrl.infer import SamplingParams
from polyrl.infer.sampling_params import StructuredOutputs

ZONE = {"zone": {"enum": ["UTC", "CET"]}}
TIME = {"type": "object", "properties": ZONE, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}}]
ASK = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1.0}


def _parallel_calls(client: openai.OpenAI) -> tuple[int, list[tuple[str, str]], int]:
    """(seed, whole calls, completion tokens) of the first seeded reply with two or more calls that ended by itself."""
    for seed in range(40):
        r = client.chat.completions.create(**ASK, seed=seed, max_tokens=120)
        c = r.choices[0]
        if c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 2:
            whole = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            return seed, whole, r.usage.completion_tokens
    raise AssertionError("no seed gave two calls")


def test_a_reply_cut_inside_a_call_is_length_and_incomplete_with_the_whole_calls(tiny_llm):
    from polyrl.agents.proxy_server import AgentProxy

    calls = StructuredOutputs("lark", HermesParser().grammar(TOOLS, True, tiny_llm.tokenizer))
    with AgentProxy(tiny_llm, SamplingParams(temperature=1.0, structured=calls), max_tokens=120) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url(proxy.open().eid), api_key="x", max_retries=0)
        seed, whole, n = _parallel_calls(client)
        for limit, kept in ((n - 3, whole[:-1]), (6, [])):  # 3 tokens before the end: inside the last call
            r = client.chat.completions.create(**ASK, seed=seed, max_tokens=limit)
            (c,) = r.choices
            assert c.finish_reason == "length" and r.usage.completion_tokens == limit  # was "tool_calls"
            assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []] == kept
            assert not c.message.content  # the half call's markup is not content
            resp = client.responses.create(
                model="m", input="x", temperature=1.0, max_output_tokens=limit, extra_body={"seed": seed}
            )
            assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
            assert resp.usage.output_tokens == limit and resp.output_text == ""
            assert [(o.type, o.name, o.arguments) for o in resp.output] == [("function_call", *k) for k in kept]
