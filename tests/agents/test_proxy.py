"""Proxy mode: the real ``openai`` client drives a 3-turn agent against polyrl's per-episode endpoint (uvicorn, real
engine); every call is recorded token-exactly (the recorded ids and log-probs are what the client received), the
reward comes back by HTTP or as the agent's return value, and an agent that raises or hangs is counted."""

from __future__ import annotations

import time

import httpx
import pytest

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look up", "parameters": {}}}]


def three_turn_agent(base_url: str, example: dict) -> float | None:
    """A plain openai-client agent loop: ask, feed a tool result back, ask again, then a user follow-up."""
    if example["prompt"].endswith("hang"):
        time.sleep(5)  # hangs before its first call: past the 1 s timeout whatever the machine's load
        return 1.0
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": example["prompt"]}]
    seen = []
    for turn in range(3):
        r = client.chat.completions.create(
            model="polyrl-policy", messages=messages, tools=TOOLS, max_tokens=6, logprobs=True
        )
        msg = r.choices[0].message
        seen.append(
            (r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"],
             [x.logprob for x in r.choices[0].logprobs.content])
        )  # fmt: skip
        messages.append(msg.model_dump(exclude_none=True))
        if turn == 0:
            messages.append({"role": "tool", "tool_call_id": "call_x", "content": "42"})
        else:
            messages.append({"role": "user", "content": "And then?"})
    example["seen"].append(seen)
    if example["prompt"].endswith("http"):
        httpx.post(base_url.removesuffix("/v1") + "/reward", json={"reward": 0.25}).raise_for_status()
        return None
    if example["prompt"].endswith("raise"):
        raise RuntimeError("agent broke")
    return 1.0


def test_openai_client_agent_is_recorded_token_exactly(tiny_llm):
    from polyrl.agents.proxy_server import AgentProxy

    examples = [{"prompt": f"task {k}", "seen": []} for k in ("callback", "http", "raise")]
    with AgentProxy(tiny_llm, max_tokens=16) as proxy:
        eps = proxy.run_agents(three_turn_agent, examples, n=2, seeds=[1, 2, 3], timeout=300.0, failure_reward=-1)
        failures = dict(proxy.failures)
        hung = proxy.run_agents(three_turn_agent, [{"prompt": "task hang"}], n=2, timeout=1.0, failure_reward=-1)
        assert proxy.failures == {"error": 0, "timeout": 2, "no_reward": 0}
    assert hung == []  # no call was made: nothing recorded, counted as timeouts
    assert len(eps) == 6 and [(e.group, e.index) for e in eps] == [(g, j) for g in range(3) for j in range(2)]
    assert failures == {"error": 2, "timeout": 0, "no_reward": 0}
    assert [e.reward for e in eps] == [1.0, 1.0, 0.25, 0.25, -1, -1]
    assert [e.status for e in eps] == ["done"] * 4 + ["env_error"] * 2
    for e in eps[:6]:
        assert e.num_turns == 3 and e.metrics["turns"] == 3.0
        first = e.ids[: e.turns[0][1]]
        seen = next(s for s in examples[e.group]["seen"] if s[0][1] == first)  # this episode's calls
        for t, ((prompt, sampled, lps), (start, end)) in enumerate(zip(seen, e.turns)):
            assert prompt == e.prompt_ids + e.ids[:start], t  # each call's prompt: the episode so far, exactly
            assert e.ids[start:end] == sampled
            assert e.logprobs[sum(b - a for a, b in e.turns[:t]) :][: len(sampled)] == pytest.approx(lps)
        assert sum(e.mask) == len(e.logprobs) == sum(b - a for a, b in e.turns)
        # the opening prompt carries the tools (the tiny ChatML template has none: a system block)
        assert "lookup" in tiny_llm.tokenizer.decode(e.prompt_ids)
        between = tiny_llm.tokenizer.decode(e.ids[e.turns[0][1] : e.turns[1][0]])
        assert "<|im_start|>tool\n42<|im_end|>" in between and between.endswith("<|im_start|>assistant\n")


def test_rewritten_history_starts_a_new_segment_and_unknown_episode_is_404(tiny_llm):
    from polyrl.agents.proxy_server import AgentProxy

    def agent(base_url, example):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        a = [{"role": "user", "content": "first"}]
        client.chat.completions.create(model="m", messages=a, max_tokens=4)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"}], max_tokens=4)
        return 0.5

    with AgentProxy(tiny_llm, max_tokens=8) as proxy:
        eps = proxy.run_agents(agent, [{"prompt": "p"}], n=1, seeds=[0])
        client = openai.OpenAI(base_url=proxy.base_url("nope"), api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert len(eps) == 2 and [e.num_turns for e in eps] == [1, 1] and [e.reward for e in eps] == [0.5, 0.5]


AGENT_FILE = """
import openai

def agent(base_url, example):
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": example["prompt"]}]
    text = ""
    for _ in range(2):
        r = client.chat.completions.create(model="policy", messages=messages, temperature=0.0, max_tokens=99)
        text += r.choices[0].message.content or ""
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return float(any(ch.isdigit() for ch in text))
"""


def test_grpo_trains_on_an_openai_agent_through_the_proxy(tiny_model_dir, tmp_path):
    import json

    from polyrl.trainer import fit

    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_FILE)
    out = tmp_path / "proxy-run"
    summary = fit(
        "grpo", tiny_model_dir, "builtin:arithmetic?max=9&n=16", out, train={"max_steps": 2},
        optim={"lr": 1e-2}, engine={"micro_batch_tokens": 512},
        grpo={"max_new_tokens": 6, "samples_per_prompt": 3, "prompts_per_step": 2},
        agent={"agent": f"{path}:agent", "max_turns": 2, "max_episode_tokens": 200},
    )  # fmt: skip
    assert summary["status"] == "finished"
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["episode/turns"] == 2.0 and r["env_failures"] == 0.0  # the run's max_tokens (6) won over 99
        assert r["response_length"] <= 12
        # the agent asked for temperature 0, the run samples at 1: the recorded log-probs are the run's, so the
        # trainer's recompute matches them
        assert r["mismatch_max"] < 1e-3


def test_driver_calls_the_step_hook_and_records_token_versions(tiny_llm):
    """Partial rollouts through the proxy: the engine driver thread calls the hook it was given between its engine
    steps (steps 1, 2, ... in order, requests in flight); a weight swap there (here: only a new version stamp, the
    weights unchanged) splits the call in flight, so its recorded tokens carry versions 0 then 1, the template and
    user tokens between calls the version before them, and the next call's tokens version 1. The time the driver
    stood still in the hook is not counted against the agents' timeout: the hook holds the engine until the run has
    lasted longer than the timeout, which the agent's own work (a fraction of a second, under a second on a loaded
    2-core machine) stays well within."""
    import threading

    from polyrl.agents.proxy_server import AgentProxy

    calls = []
    timeout_s = 3.0
    started = []  # when run_agents began

    def hook(llm, steps):
        calls.append((threading.current_thread().name, steps, llm.policy_version))
        if steps == 3:
            llm.swap_weights(lambda: None, 1)
            # an update that keeps the engine waiting until the run is past the agent's timeout
            time.sleep(max(0.0, started[0] + timeout_s + 0.3 - time.monotonic()))

    def agent(base_url, example):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "count"}]
        for _ in range(2):
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        return 1.0

    tiny_llm.policy_version = 0
    try:
        with AgentProxy(tiny_llm, max_tokens=6).start(drive=False) as proxy:
            with proxy.driving(hook):
                started.append(time.monotonic())
                (e,) = proxy.run_agents(agent, [{"prompt": "p"}], n=1, seeds=[0], timeout=timeout_s)
                took = time.monotonic() - started[0]
            assert proxy.failures == {"error": 0, "timeout": 0, "no_reward": 0} and proxy.driver.between_steps is None
            assert took > timeout_s  # the run outlasted the timeout: only the time in the hook is left out
    finally:
        tiny_llm.policy_version = None
    assert e.status == "done" and e.num_turns == 2 and e.reward == 1.0
    assert [c[0] for c in calls] == ["polyrl-agent-engine"] * len(calls)
    assert [c[1] for c in calls] == list(range(1, len(calls) + 1))  # every boundary, in order
    assert [c[2] for c in calls[:3]] == [0, 0, 0] and {c[2] for c in calls[3:]} == {1}
    (a0, b0), (a1, b1) = e.turns
    assert len(e.versions) == len(e.ids)  # the first call's tokens: 3 sampled in steps 1-3, 3 after the swap
    assert e.versions[a0:b0] == [0, 0, 0, 1, 1, 1]
    assert e.versions[b0:a1] == [1] * (a1 - b0) and e.versions[a1:b1] == [1] * (b1 - a1)
    assert e.to_sample().token_versions == e.versions


def test_a_driver_stopped_while_blocked_in_its_hook_never_steps_the_engine_again(tiny_llm):
    """``stop()`` gives up on a driver thread blocked in its ``between_steps`` hook (here after a 0.2 s join); the
    next window's thread then serves the engine. Once the hook returns, the old thread exits without another
    ``llm.step()`` (it stepped once, before the hook), and the time it stood blocked after its stop is not counted
    as the driver's pause (``paused_s`` stops growing at ``stop()``)."""
    import threading
    from collections import Counter

    from polyrl.agents.proxy_server import EngineDriver
    from polyrl.infer import SamplingParams

    class CountingEngine:  # the real engine; its step() calls counted per thread
        def __init__(self, llm):
            self.llm, self.steps = llm, Counter()

        def step(self):
            self.steps[threading.get_ident()] += 1
            return self.llm.step()

        def __getattr__(self, name):
            return getattr(self.llm, name)

    entered, release = threading.Event(), threading.Event()

    def hook(llm, steps):
        entered.set()
        release.wait(20)

    engine = CountingEngine(tiny_llm)
    driver = EngineDriver(engine, join_timeout=0.2)
    got = []
    driver.start(hook)
    old = driver._thread
    driver.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), got.append)
    assert entered.wait(20)  # one step done, the thread blocked at the next boundary
    driver.stop()
    assert old.is_alive()  # still in the hook
    paused = driver.paused_s
    time.sleep(0.3)
    assert driver.paused_s == paused > 0
    driver.start()  # the next window: no hook; its thread finishes the request the old one began
    new = driver._thread
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) == 1 and got[0].finished and len(got[0].outputs[0].token_ids) == 5
    release.set()
    old.join(20)
    driver.stop()
    assert not old.is_alive() and not new.is_alive() and driver.error is None
    assert engine.steps[old.ident] == 1 and engine.steps[new.ident] >= 1
    assert driver.paused_s == paused
