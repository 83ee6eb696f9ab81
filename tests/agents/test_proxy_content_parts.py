"""Proxy mode: the chat endpoint takes OpenAI text content parts (openai-agents and LangChain send them) as
``polyrl serve`` does, recording exactly the prompt of the same conversation sent as strings; content it cannot render
(an image part) and an assistant tool call without a name are 400s naming the message. Before, both were a 400
"the chat template rejected the messages (TypeError: ...)" / "(KeyError: 'name')" and text parts could not be used."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")


def _parts(text: str) -> list[dict]:
    return [{"type": "text", "text": text[:3]}, {"type": "text", "text": text[3:]}]


def _conversation(as_parts: bool) -> list[dict]:
    c = _parts if as_parts else (lambda t: t)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    return [
        {"role": "system", "content": c("Be brief.")},
        {"role": "user", "content": c("What is 6 * 7?")},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": c("42")},
    ]


def agent(base_url: str, example: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=_conversation(example["parts"]), max_tokens=4)
    example["out"].append(r.model_extra["prompt_token_ids"])
    bad_calls = _conversation(False)
    nameless = {"id": "c1", "type": "function", "function": {"arguments": "{}"}}
    bad_calls[2] = {"role": "assistant", "content": None, "tool_calls": [nameless]}
    image = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {}}]}]
    for messages in (bad_calls, image):
        try:
            client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        except openai.BadRequestError as exc:
            example["out"].append(exc.body["message"])
    return 1.0


def test_text_parts_are_rendered_and_unrenderable_content_is_named(tiny_llm):
    from polyrl.agents.proxy_server import AgentProxy

    out = []
    examples = [{"prompt": "parts", "parts": True, "out": out}, {"prompt": "strings", "parts": False, "out": out}]
    with AgentProxy(tiny_llm, max_tokens=8) as proxy:
        for ex in examples:  # one after the other: the results in this order
            eps = proxy.run_agents(agent, [ex], n=1, seeds=[0], timeout=300.0, failure_reward=-1.0)
            assert proxy.failures == {"error": 0, "timeout": 0, "no_reward": 0} and eps[0].reward == 1.0
    parts_prompt, missing_name, image, strings_prompt = out[:4]
    assert parts_prompt == strings_prompt
    assert "<|im_start|>tool\n42<|im_end|>" in tiny_llm.tokenizer.decode(parts_prompt)
    assert missing_name == "messages[2].tool_calls[0].function.name is required (the name of the tool)"
    assert image.startswith("messages[0].content[1] is not a text part")
