"""Tool-call parsers per family (Hermes/Qwen, Llama 3 JSON, Mistral), their streaming and their grammars, and the
shared message preparation (native tools vs the system-prompt fallback). No server: pure functions + llguidance."""

from __future__ import annotations

import json

import pytest

from polyrl.agents.render import prepare_messages
from polyrl.agents.tool_parsers import ToolCallStream, detect_parser, get_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]


def calls(msg):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]


def test_hermes_parses_blocks_and_keeps_content():
    p = get_parser("qwen")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    )
    text += '\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    msg = p.parse(text, "call_x")
    assert msg["content"] == "Let me check."
    assert calls(msg) == [("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]
    assert [c["id"] for c in msg["tool_calls"]] == ["call_x_0", "call_x_1"]
    bad = p.parse("<tool_call>{not json}</tool_call>")
    assert "tool_calls" not in bad and len(bad["invalid_tool_calls"]) == 1


def test_llama3_json_and_mistral():
    llama = get_parser("llama3_json")
    msg = llama.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}; {"name": "noop"}'
    )
    assert calls(msg) == [("get_weather", {"city": "Rome", "days": 1}), ("noop", {})] and msg["content"] is None
    plain = llama.parse("The answer is {not a call}")
    assert plain["content"] == "The answer is {not a call}" and "tool_calls" not in plain
    mistral = get_parser("mistral")
    msg = mistral.parse('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]')
    assert msg["content"] == "Sure." and calls(msg) == [("get_weather", {"city": "Paris", "days": 3})]
    assert mistral.keep_special_tokens and not llama.keep_special_tokens


def test_detect_parser_from_template():
    assert detect_parser("{{ '<tool_call>' }}").name == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert detect_parser("<|python_tag|>{{ x }}").name == "llama3_json"
    assert detect_parser(None).name == "hermes"  # no template tool support: the fallback asks for <tool_call>
    with pytest.raises(Exception, match="unknown tool-call parser"):
        get_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_streaming_holds_back_markers_and_sends_calls_whole(name):
    p = get_parser(name)
    if name == "hermes":
        text = 'Hi <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    elif name == "llama3_json":
        text = '{"name": "noop", "parameters": {}}'
    else:
        text = 'Hi [TOOL_CALLS][{"name": "noop", "arguments": {}}]'
    stream = ToolCallStream(p, "call_s")
    content = "".join(stream.feed(text[:i]) for i in range(1, len(text) + 1))
    rest, msg = stream.finish(text)
    assert content + rest == ("" if name == "llama3_json" else "Hi ")
    assert calls(msg) == [("noop", {})]
    # a reply without calls streams whole: held-back text comes out at the end
    stream = ToolCallStream(p, "call_s")
    text = "plain <tool answer"
    content = "".join(stream.feed(text[:i]) for i in range(1, len(text) + 1))
    rest, msg = stream.finish(text)
    assert content + rest == text and "tool_calls" not in msg


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_grammar_admits_exactly_the_format(name):
    llg = pytest.importorskip("llguidance")
    p = get_parser(name)
    grammar = llg.LLMatcher.grammar_from_lark(p.grammar(TOOLS[:1], parallel=False))
    assert llg.LLMatcher.validate_grammar(grammar) == ""
    args = {"city": "Paris", "days": 2}
    good = {
        "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>',
        "llama3_json": f'{{"name": "get_weather", "parameters": {json.dumps(args)}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(args)}}}]',
    }[name]
    assert calls(p.parse(good)) == [("get_weather", args)]
    # the text form of the grammar pins the tool name and the parameter schema
    text = p.grammar(TOOLS[:1], parallel=False)
    assert '"const": "get_weather"' in text and '"enum": ["Paris", "Rome"]' in text


def test_prepare_messages_native_vs_fallback():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    native, tools = prepare_messages(history, TOOLS, "{{ tools }} {{ m.tool_calls }}")
    assert tools == TOOLS and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert native[1]["content"] == "" and native[2]["tool_call_id"] == "c1"
    fallback, tools = prepare_messages(history, TOOLS, "{{ m.content }}")
    assert tools is None and fallback[0]["role"] == "system" and "get_weather(city, days)" in fallback[0]["content"]
    assert fallback[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
