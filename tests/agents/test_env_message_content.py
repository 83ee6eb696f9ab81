"""An environment's messages must have text content: a reset or step that returns a dict (or a number) as a message's
content is that episode's counted ``invalid`` failure naming the message, while the other episodes go on; OpenAI text
parts are joined into text. Before, the chat template raised on such content and the whole run ended (exit 2)."""

from __future__ import annotations

from polyrl.agents.env import register_env
from polyrl.agents.pool import EnvPool
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, run_episodes
from polyrl.infer import SamplingParams

ENV = """
from polyrl.agents import Environment, EnvStep

class Odd(Environment):
    def reset(self, example):
        self.kind = example["prompt"]
        if self.kind == "reset-dict":
            return [{"role": "user", "content": {"question": 1}}]
        return [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]}]

    def step(self, message):
        if self.kind == "step-dict":
            return EnvStep([{"role": "tool", "content": {"result": 42}}], 1.0, False)
        if self.kind == "step-int":
            return EnvStep([{"role": "user", "content": 7}], 1.0, False)
        return EnvStep([{"role": "user", "content": [{"type": "text", "text": "tool says 42"}]}], 1.0, True)
"""


def test_non_text_content_fails_its_episode_only(tiny_llm, tmp_path):
    (tmp_path / "odd_env.py").write_text(ENV)
    register_env("odd-content-test", f"{tmp_path / 'odd_env.py'}:Odd")
    renderer = ChatRenderer(tiny_llm.tokenizer)
    examples = [{"prompt": k} for k in ("reset-dict", "step-dict", "step-int", "parts")]
    sampling = SamplingParams(temperature=1.0, stop_token_ids=list(range(200, 1400)))  # short turns
    limits = EpisodeLimits(max_turns=2, max_new_tokens=8, max_episode_tokens=300)
    with EnvPool("odd-content-test", workers=0) as pool:
        eps = run_episodes(tiny_llm, pool, renderer, examples, 1, sampling, [1, 2, 3, 4], limits, failure_reward=-1.0)
        totals = dict(pool.totals)
    assert [e.status for e in eps] == ["env_error", "env_error", "env_error", "done"]
    assert [e.reward for e in eps] == [-1.0, -1.0, -1.0, 1.0]
    assert totals["invalid"] == 3
    assert eps[0].error.startswith("invalid: reset() message 0 (role 'user') has content of type dict")
    assert eps[1].error.startswith("invalid: step() message 0 (role 'tool') has content of type dict")
    assert eps[2].error.startswith("invalid: step() message 0 (role 'user') has content of type int")
    assert "content must be a string" in eps[1].error
    ok = eps[3]
    assert ok.messages[0] == {"role": "user", "content": "parts joined"}
    assert ok.messages[-1]["content"] == "tool says 42"
    assert "<|im_start|>user\nparts joined<|im_end|>" in tiny_llm.tokenizer.decode(ok.prompt_ids)
