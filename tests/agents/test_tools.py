"""Tool-call parsing (good and malformed output), rendering back, and the tool environment's answers."""

from __future__ import annotations

import json

from polyrl.agents.builtin import CalculatorEnv, safe_eval
from polyrl.agents.tools import assistant_text, format_tool_calls, parse_reply


def test_parse_good_calls():
    text = 'Let me compute.\n<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>\n'
    text += '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    msg = parse_reply(text, "call_1")
    assert msg["role"] == "assistant"
    assert msg["content"] == "Let me compute."
    assert [c["id"] for c in msg["tool_calls"]] == ["call_1_0", "call_1_1"]
    assert [c["type"] for c in msg["tool_calls"]] == ["function", "function"]
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        {"expression": "12*7"},
        {"expression": "1+1"},
    ]
    assert "invalid_tool_calls" not in msg


def test_parse_plain_reply_has_no_calls():
    msg = parse_reply("  The answer is 84.  ")
    assert msg == {"role": "assistant", "content": "The answer is 84."}


def test_parse_malformed_calls_are_reported_not_raised():
    cases = {
        "<tool_call>{not json}</tool_call>": "not valid JSON",
        "<tool_call>[1, 2]</tool_call>": "JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "no 'name'",
        '<tool_call>{"name": "calculator", "arguments": 5}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "calculator", "arguments": "x{"}</tool_call>': "not JSON",
        'ok <tool_call>{"name": "calculator", "argu': "not closed",
    }
    for text, why in cases.items():
        msg = parse_reply(text)
        assert "tool_calls" not in msg, text
        assert len(msg["invalid_tool_calls"]) == 1, text
        assert why in msg["invalid_tool_calls"][0]["error"], (text, msg)
    mixed = parse_reply('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>')
    assert len(mixed["tool_calls"]) == 1 and len(mixed["invalid_tool_calls"]) == 1 and mixed["content"] is None


def test_format_round_trip():
    calls = [{"name": "calculator", "arguments": {"expression": "3-1"}}]
    text = format_tool_calls(calls)
    back = parse_reply(text)["tool_calls"]
    assert back[0]["function"]["name"] == "calculator"
    assert json.loads(back[0]["function"]["arguments"]) == {"expression": "3-1"}
    assert parse_reply(assistant_text({"content": "hi", "tool_calls": back}))["content"] == "hi"


def test_calculator_env_answers_calls_errors_and_finishes():
    env = CalculatorEnv()
    msgs = env.reset({"prompt": "What is 12 * 7?", "answer": "84"})
    assert msgs[-1] == {"role": "user", "content": "What is 12 * 7?"}
    good = parse_reply('<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>', "c")
    st = env.step(good)
    assert not st.done and st.reward == 0.0
    assert st.messages == [{"role": "tool", "tool_call_id": "c_0", "name": "calculator", "content": "84"}]
    bad = parse_reply(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    )
    st = env.step(bad)
    assert [m["content"].startswith("error:") for m in st.messages] == [True, True, True]
    assert st.metrics["tool_errors"] == 3.0
    assert env.step(parse_reply("It is 84.")).reward == 1.0
    assert env.step(parse_reply("It is 85.")).reward == 0.0
    assert safe_eval("2 ** 10 - (3 // 2)") == 1023


def test_import_polyrl_agents_imports_no_fastapi_or_transformers():
    import subprocess
    import sys

    mods = "('fastapi', 'uvicorn', 'transformers')"
    code = f"import sys, polyrl.agents; print(sorted(m for m in {mods} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_calculator_transcripts_replay_through_the_env(tiny_model_dir):
    from polyrl.agents.builtin import calculator_transcripts
    from polyrl.agents.render import ChatRenderer
    from polyrl.data import builtin
    from polyrl.models.checkpoint import load_tokenizer

    renderer = ChatRenderer(load_tokenizer(str(tiny_model_dir)))
    examples = builtin.generate("builtin:arithmetic?max=99&ops=*", "train", n=40, seed=1)
    rows = calculator_transcripts(examples, 0, 0.5, renderer)
    with_tool = 0
    for ex, row in zip(examples, rows):
        msgs = row["messages"]
        assert "calculator(expression)" in msgs[0]["content"] and msgs[1]["content"] == ex["prompt"]
        first = parse_reply(msgs[2]["content"])
        if "tool_calls" in first:  # the call parses and the environment answers what the transcript says
            with_tool += 1
            env = CalculatorEnv()
            env.reset(ex)
            assert env.step(first).messages[0]["content"] == msgs[3]["content"] == ex["answer"]
            assert env.step(parse_reply(msgs[4]["content"])).reward == 1.0
        else:
            assert len(msgs) == 3
    assert 10 <= with_tool <= 30
