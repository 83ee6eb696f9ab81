"""Output formats in agentic episodes (``polyrl.agents.formats``): an environment's per-turn ``response_format``
(class-wide, or per step through ``EnvStep``) and the run's ``grpo.rollout_response_format`` constrain every
assistant turn of a multi-turn episode on the real engine (tiny random model); with tools a turn is a valid call OR
an answer in the format; the masks' cost is measured; bad formats are clear errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from polyrl.agents.env import register_env
from polyrl.agents.formats import TEXT, pick, to_format, turn_grammar
from polyrl.agents.pool import EnvPool
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, run_episodes
from polyrl.errors import ConfigError
from polyrl.infer import SamplingParams
from polyrl.infer.sampling_params import StructuredOutputs

pytest.importorskip("llguidance")

ANSWER = {
    "type": "object",
    "properties": {"guess": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["guess"],
    "additionalProperties": False,
}
KEY = {
    "type": "object",
    "properties": {"key": {"enum": ["a", "b"]}},
    "required": ["key"],
    "additionalProperties": False,
}

# An environment with one tool and a JSON answer format for every turn; after turn 0 it asks for "yes"/"no" (or a
# call), after turn 1 for free text, after turn 2 nothing (its class format again).
ENV_SRC = f"""
from polyrl.agents.env import Environment, EnvStep

NEXT = ["choice:yes|no", "text", None, None]


class FormatEnv(Environment):
    tools = [{{"type": "function", "function": {{"name": "lookup", "parameters": {KEY!r}}}}}]
    response_format = {{"type": "json_schema", "json_schema": {{"name": "answer", "schema": {ANSWER!r}}}}}
    parallel_tool_calls = False  # one call per turn (a random model would chain calls up to max_new_tokens)

    def reset(self, example):
        self.turn = 0
        return [{{"role": "user", "content": example["prompt"]}}]

    def step(self, message):
        nxt, self.turn = NEXT[self.turn], self.turn + 1
        out = [{{"role": "tool", "tool_call_id": c["id"], "content": "42"}} for c in message.get("tool_calls") or []]
        return EnvStep(out or [{{"role": "user", "content": "again"}}], 0.0, False, {{}}, nxt)


class PlainEnv(Environment):
    def reset(self, example):
        return [{{"role": "user", "content": example["prompt"]}}]

    def step(self, message):
        return EnvStep([{{"role": "user", "content": "more"}}], 0.0, False, {{}})


class BadStepEnv(PlainEnv):
    tools = FormatEnv.tools

    def step(self, message):
        return EnvStep([{{"role": "user", "content": "more"}}], 0.0, False, {{}}, "grammar:start: \\"a\\"\\n")
"""

EXAMPLES = [{"prompt": f"puzzle {i}"} for i in range(2)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls run faster on one thread; on two shared cores more threads slow the engine many times over."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    src = tmp_path_factory.mktemp("envs") / "format_env.py"
    src.write_text(ENV_SRC)
    for name in ("FormatEnv", "PlainEnv", "BadStepEnv"):
        register_env(f"test-{name}", f"{src}:{name}")
    return src


def _turn_texts(tok, e):
    """The sampled text of each turn (without its end-of-turn token)."""
    eos = tok.eos_token_id
    return [tok.decode([t for t in e.ids[a:b] if t != eos]) for a, b in e.turns]


def _assistant(e):
    return [m for m in e.messages if m["role"] == "assistant"]


def _is_call(msg):
    if not msg.get("tool_calls") or msg.get("invalid_tool_calls") or msg.get("content"):
        return False
    for c in msg["tool_calls"]:
        assert c["function"]["name"] == "lookup"
        jsonschema.validate(json.loads(c["function"]["arguments"]), KEY)
    return True


def test_to_format_and_pick():
    schema = {"type": "object"}
    assert to_format(None, "x") is None and to_format("text", "x") == TEXT and to_format({"type": "text"}, "x") == TEXT
    assert to_format({"type": "json_object"}, "x") == StructuredOutputs("json_object")
    nested = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert to_format(nested, "x") == StructuredOutputs.json_schema(schema)
    flat = {"type": "json_schema", "schema": json.dumps(schema)}  # Responses' text.format shape, schema as text
    assert to_format(flat, "x") == StructuredOutputs.json_schema(schema)
    assert to_format("regex:[0-9]+", "x") == StructuredOutputs("regex", "[0-9]+")
    for bad, why in [({"type": "xml"}, "not one of"), ({"type": "json_schema"}, "needs"), ("yaml:1", "not one of"),
                     (3, "must be a response_format")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            to_format(bad, "MyEnv.response_format")
    a, b = StructuredOutputs("json_object"), StructuredOutputs("regex", "x")
    assert pick(None, a, b) == a and pick(TEXT, a, b) is None and pick(None, None, b) == b and pick() is None
    assert turn_grammar(a, [], None) == a and turn_grammar(None, [{"function": {"name": "f"}}], None) is None
    with pytest.raises(ConfigError, match="cannot be combined"):
        turn_grammar(StructuredOutputs("grammar", 'start: "a"'), [{"function": {"name": "f"}}], None)


def test_env_formats_constrain_every_turn(tiny_llm, env_file):
    """Turn 0: a call or the JSON answer; turn 1 (EnvStep): a call or yes/no; turn 2 (EnvStep "text"): free; turn 3
    (the class format again): a call or the JSON answer. Log-probs stay the engine's; the masks' cost is summed."""
    renderer = ChatRenderer(tiny_llm.tokenizer)
    limits = EpisodeLimits(max_turns=4, max_new_tokens=60, max_episode_tokens=1000)
    with EnvPool("test-FormatEnv", workers=0) as pool:
        eps = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 4, SamplingParams(temperature=1.0), [3, 4], limits)
    seen = {"call": 0, "answer": 0, "choice": 0}
    for e in eps:
        assert e.num_turns == 4 and e.status == "max_turns", (e.status, e.error)
        msgs, texts = _assistant(e), _turn_texts(tiny_llm.tokenizer, e)
        for t in (0, 3):
            if _is_call(msgs[t]):
                seen["call"] += 1
            else:
                jsonschema.validate(json.loads(texts[t]), ANSWER)
                seen["answer"] += 1
        if not _is_call(msgs[1]):
            assert texts[1] in ("yes", "no"), texts[1]
            seen["choice"] += 1
        assert e.metrics["constrained_turns"] == 3.0  # turn 2 was free
        assert e.masked_logmass is not None and e.masked_logmass < 0  # the random policy's mass outside the formats
        assert len(e.logprobs) == sum(e.mask) and all(lp <= 0 for lp in e.logprobs)
        assert e.to_sample().masked_logmass == e.masked_logmass
    assert all(v > 0 for v in seen.values()), seen


def test_run_format_applies_to_every_turn_and_bad_step_formats_fail_the_episode(tiny_llm, env_file):
    renderer = ChatRenderer(tiny_llm.tokenizer)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=12, max_episode_tokens=600)
    run_format = StructuredOutputs("regex", "[0-9]{1,2}")  # what --set grpo.rollout_response_format=regex:... gives
    sampling = SamplingParams(temperature=1.0, structured=run_format)
    with EnvPool("test-PlainEnv", workers=0) as pool:
        eps = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 3, sampling, [1, 2], limits)
    for e in eps:
        texts = _turn_texts(tiny_llm.tokenizer, e)
        assert len(texts) == 3 and all(re.fullmatch(r"[0-9]{1,2}", t) for t in texts), texts
        assert e.metrics["constrained_turns"] == 3.0
    # an environment with tools that asks for a whole grammar: its episodes end as env_error (invalid), counted
    with EnvPool("test-BadStepEnv", workers=0) as pool:
        eps = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 1, SamplingParams(temperature=1.0), [1, 2], limits)
        assert pool.totals["invalid"] == 2
    assert [e.status for e in eps] == ["env_error", "env_error"] and eps[0].num_turns == 1
    assert "cannot be combined" in eps[0].error


def test_grpo_over_episodes_with_a_run_format(tiny_model_dir, env_file, tmp_path):
    """``--set grpo.rollout_response_format`` reaches the episode path: the saved transcripts follow it on every
    turn and the run logs what the masks removed."""
    from polyrl.cli.main import main

    out = tmp_path / "run"
    args = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--out", str(out)]
    args += [
        "--env",
        f"{env_file}:PlainEnv",
        "--data",
        "builtin:arithmetic?max=9&n=8",
        "--micro-batch-tokens",
        "256",
        "--n",
        "2",
    ]
    args += ["--prompts-per-step", "2", "--max-new-tokens", "6", "--max-steps", "1", "--log-every", "1"]
    args += ["--set", "agent.max_turns=2", "--set", "agent.max_episode_tokens=200", "--set", "agent.env_workers=0"]
    args += ["--set", "grpo.rollout_response_format=choice:yes|no", "--set", "grpo.rollouts_to_save=4"]
    assert main(args) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "rollout_mask_logmass" in r]
    assert len(steps) == 1 and steps[0]["rollout_mask_logmass"] < 0
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    replies = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert rows and len(replies) == 2 * len(rows) and set(replies) <= {"yes", "no"}, replies


def test_agent_proxy_applies_the_request_or_run_format(tiny_llm):
    """Proxy mode: the agent's own response_format (with its tools: a call or the JSON answer), else the run's."""
    openai = pytest.importorskip("openai")
    from polyrl.agents.proxy_server import AgentProxy

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": KEY}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    replies = []

    def agent(base_url, example):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": example["prompt"]}]
        for kw in ({"tools": tools, "response_format": fmt, "parallel_tool_calls": False}, {}):
            r = client.chat.completions.create(model="polyrl-policy", messages=msgs, max_tokens=60, **kw)
            replies.append((bool(kw), r.choices[0].message))
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": "?"},
            ]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="polyrl-policy", messages=msgs, response_format={"type": "xml"})
        return 1.0

    run_fmt = SamplingParams(temperature=1.0, structured=StructuredOutputs("regex", "[a-c]{2}"))
    with AgentProxy(tiny_llm, run_fmt, max_tokens=60) as proxy:
        eps = proxy.run_agents(agent, [{"prompt": f"p{i}"} for i in range(3)], n=2, seeds=[1, 2, 3], timeout=300.0)
    assert len(eps) >= 6 and len(replies) == 12  # a call whose tool_calls the agent drops starts a new segment
    assert all(e.masked_logmass < 0 and e.metrics["constrained_turns"] == e.num_turns for e in eps)
    kinds = set()
    for own, msg in replies:
        if own and msg.tool_calls:
            (call,) = msg.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), KEY)
            kinds.add("call")
        elif own:
            jsonschema.validate(json.loads(msg.content), ANSWER)
            kinds.add("answer")
        else:
            assert re.fullmatch("[a-c]{2}", msg.content), msg.content
    assert kinds == {"call", "answer"}, replies


@pytest.fixture(scope="module")
def mistral_llm(tiny_model_dir, tmp_path_factory):
    """The tiny model with two filler tokens renamed to Mistral's special ``[TOOL_CALLS]`` / ``[ARGS]``."""
    import shutil

    from polyrl.infer import LLM, RolloutConfig

    out = tmp_path_factory.mktemp("mistral") / "tiny"
    shutil.copytree(tiny_model_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    for filler, name in (("<filler_0>", "[TOOL_CALLS]"), ("<filler_1>", "[ARGS]")):
        i = spec["model"]["vocab"].pop(filler)
        spec["model"]["vocab"][name] = i
        spec["added_tokens"].append(
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
        )  # fmt: skip
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return LLM.from_pretrained(str(out), RolloutConfig(num_blocks=512, max_model_len=1024, max_num_seqs=64), "float32")


def test_episodes_parse_and_constrain_calls_in_the_templates_syntax(mistral_llm, env_file):
    """A template that teaches Mistral v11 calls (``[TOOL_CALLS]name[ARGS]{...}``): the episode's turns are
    constrained to that syntax OR the JSON answer, and the calls are parsed from it (Hermes parsing would find none)."""
    from polyrl.agents.tool_parsers import MistralParser

    template = mistral_llm.tokenizer.chat_template + "{# tools: [TOOL_CALLS]name[ARGS]{arguments} #}"
    renderer = ChatRenderer(mistral_llm.tokenizer, template)
    assert isinstance(renderer.tool_parser, MistralParser)
    limits = EpisodeLimits(max_turns=1, max_new_tokens=60, max_episode_tokens=1000)
    with EnvPool("test-FormatEnv", workers=0) as pool:
        eps = run_episodes(mistral_llm, pool, renderer, EXAMPLES, 6, SamplingParams(temperature=1.0), [5, 6], limits)
    calls = 0
    for e in eps:
        (msg,) = _assistant(e)
        text = mistral_llm.tokenizer.decode(e.ids[e.turns[0][0] : e.turns[0][1]], skip_special_tokens=False)
        if _is_call(msg):
            calls += 1
            assert text.startswith("[TOOL_CALLS]lookup[ARGS]{"), text
        else:
            assert "[TOOL_CALLS]" not in text
            jsonschema.validate(json.loads(_turn_texts(mistral_llm.tokenizer, e)[0]), ANSWER)
    assert calls > 0 and calls < len(eps), calls
