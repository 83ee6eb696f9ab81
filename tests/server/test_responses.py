"""POST /v1/responses with the official openai client: input items (messages, function_call,
function_call_output) render as the equivalent chat conversation, forced function calls, text.format structured
outputs, the typed stream events, incomplete replies, and the 400s for what a stateless server cannot do."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import MODEL
from .test_tools import TOOLS, parallel_calls

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}
ARGS = '{"city": "Paris"}'


def test_items_render_as_the_chat_conversation(client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=items, tools=[TOOL], max_output_tokens=3)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[CHAT_TOOL],
        max_tokens=3,
        temperature=0,
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens <= 3 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    greedy = client.responses.create(
        model=MODEL, instructions="Be brief.", input=items, tools=[TOOL], max_output_tokens=3, temperature=0
    )
    assert greedy.output_text == chat.choices[0].message.content


def test_forced_call_and_text_format(client):
    r = client.responses.create(
        model=MODEL, input="Weather in Rome?", tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=80, temperature=1.0,
    )  # fmt: skip
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    named = client.responses.create(
        model=MODEL, input="x", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
    )  # fmt: skip
    assert [o.type for o in named.output] == ["function_call"]
    fmt = {
        "type": "json_schema",
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["ok", "n"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    r = client.responses.create(model=MODEL, input="Answer.", text={"format": fmt}, max_output_tokens=40)
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"ok", "n"}
    assert r.text.format.type == "json_schema"


def test_auto_tools_with_text_format_call_or_answer(client):
    """What the openai-agents SDK sends for an agent with tools and an output_type: each reply is a valid call or a
    valid answer in the schema (tool_choice auto: the grammar is their union)."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    kinds = set()
    for seed in range(6):
        r = client.responses.create(
            model=MODEL, input="Weather?", tools=[TOOL], text={"format": fmt}, parallel_tool_calls=False,
            max_output_tokens=80, temperature=1.0, extra_body={"seed": seed},
        )  # fmt: skip
        assert r.status == "completed"
        (item,) = r.output
        if item.type == "function_call":
            assert json.loads(item.arguments)["city"] in ("Paris", "Rome")
        else:
            assert isinstance(json.loads(r.output_text)["ok"], bool)
        kinds.add(item.type)
    assert kinds == {"function_call", "message"}


def test_stream_events(client):
    stream = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    last = "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0)
    assert text == whole.output_text == events[-1].response.output_text
    with client.responses.stream(
        model=MODEL, input="x", tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_output_tokens=80
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output[0].parsed_arguments["city"] in ("Paris", "Rome")


def test_cut_inside_a_call_is_incomplete_with_the_whole_calls_only(client):
    """max_output_tokens cuts the last of several forced calls: status incomplete (reason max_output_tokens), the
    whole calls as completed function_call items, and no message item holding the half call's <tool_call> markup
    (was: a message whose text was that markup); streamed alike. Cut inside the first call: no output items."""
    seed, whole, n = parallel_calls(client)  # via chat: the same prompt, tools and seeded sampling
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    ask = dict(model=MODEL, input="x", tools=tools, tool_choice="required", temperature=1.0, extra_body={"seed": seed})
    for limit, kept in ((n - 3, whole[:-1]), (6, [])):
        r = client.responses.create(**ask, max_output_tokens=limit)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == limit and r.output_text == ""
        assert [o.type for o in r.output] == ["function_call"] * len(kept)
        assert [(o.name, o.arguments) for o in r.output] == kept and {o.status for o in r.output} <= {"completed"}
        events = list(client.responses.create(**ask, max_output_tokens=limit, stream=True))
        kinds = [e.type for e in events]
        assert "response.output_text.delta" not in kinds and kinds.count("response.output_item.added") == len(kept)
        final = events[-1]
        assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
        assert [(o.type, o.name, o.arguments) for o in final.response.output] == [("function_call", *c) for c in kept]


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, "text.format"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        # the Responses spelling of each field (were: max_tokens, messages, tools.0.function.*, text.format)
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hello " * 300, "max_output_tokens": 8}, "input"),
        ({"tools": [CHAT_TOOL]}, "tools.0.name"),
        ({"tools": [{**TOOL, "name": "a b"}]}, "tools.0.name"),
        ({"tools": [{**TOOL, "parameters": {"type": "array"}}]}, "tools.0.parameters"),
        (
            {"tools": [{**TOOL, "parameters": {"properties": {"a": {"type": "strin"}}}}], "tool_choice": "required"},
            "tools.0.parameters",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
        ({"text": {"format": {}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.name"),  # was tool_choice.function.name
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),  # the shapes it lists are the Responses ones
    ],
)
def test_unsupported_is_400_naming_the_field(client, kw, param):
    kw = {"input": "hi", "max_output_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, **kw)
    assert info.value.body["param"] == param, info.value.body
    message = info.value.body["message"]
    assert param.split(".")[0] in message
    assert "max_tokens" not in message and "messages" not in message and ".function." not in message
    assert '"function": {' not in message  # a shape to send is the Responses one ({"type": "function", "name": ...})
