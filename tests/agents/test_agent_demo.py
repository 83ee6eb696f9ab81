"""The agent demo's warm-up data and wiring: SFT transcripts replayed as the policy's replies through the episode
rollout (real renderer, real calculator environment) give exactly the token ids SFT trains on, the same loss
positions apart from the template's text after each end-of-turn token, and the environment's reward; and
``run_demo`` on a cut-down setting reports held-out metrics that are its own, reproducibly. Learning itself is
``polyrl demo --agent``'s job (its measured numbers are in ``polyrl.agents.demo``)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from polyrl.agents.builtin import calculator_transcripts
from polyrl.agents.pool import EnvPool
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, run_episodes
from polyrl.data import builtin
from polyrl.infer import SamplingParams

TASK = "builtin:arithmetic?min=32&max=99&ops=*"


class ScriptedLLM:
    """The engine's interface to ``run_episodes``, replying to turn t of episode k with ``replies[k][t]`` as the
    engine reports a sampled reply: its ids, then the end-of-turn id it stopped at (finish reason "stop")."""

    max_model_len = 4096

    def __init__(self, renderer: ChatRenderer, replies: list[list[str]]):
        self.renderer, self.replies, self.waiting = renderer, replies, []

    def add_request(self, prompt_ids, params, request_id):
        self.waiting.append(request_id)
        return request_id

    def step(self, ahead=False):
        outs = []
        for rid in self.waiting:
            _, k, _, t = rid.split("-")  # episode-{k}-turn-{t}
            text = self.replies[int(k)][int(t)]
            ids = self.renderer.encode(text) + [self.renderer.eos_id]
            done = SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), text=text, finish_reason="stop")
            outs.append(SimpleNamespace(request_id=rid, finished=True, outputs=[done]))
        self.waiting = []
        return outs


def test_warmup_transcripts_are_the_episodes_the_rollout_records(tiny_model_dir, tmp_path):
    from polyrl.data import DataConfig
    from polyrl.data.dataset import build_sft
    from polyrl.models.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    renderer = ChatRenderer(tokenizer)
    examples = builtin.generate(TASK, "train", n=12, seed=3)
    rows = calculator_transcripts(examples, 0, 0.5, renderer)
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    units = build_sft(DataConfig(path=str(path), shuffle=False), tokenizer).units  # what `train --algo sft` packs
    assert len(units) == len(rows)

    replies = [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows]
    with EnvPool("calculator", workers=0) as pool:
        eps = run_episodes(
            ScriptedLLM(renderer, replies), pool, renderer, examples, 1, SamplingParams(), None,
            EpisodeLimits(max_turns=3, max_new_tokens=64, max_episode_tokens=1024),
        )  # fmt: skip
    after_eos = renderer.encode(renderer.after_eos)  # ChatML: the newline after <|im_end|>
    assert after_eos
    calls = 0
    for row, (seq,), e, said in zip(rows, units, eps, replies):
        assert e.status == "done" and e.num_turns == len(said)
        # the same ids: the opening prompt (tools block included), the replies, the tool's answer and the prompts
        # between turns; the transcript goes on with the template's text after the last end-of-turn id
        assert e.prompt_ids + e.ids + after_eos == seq.input_ids
        # the same loss positions: the sampled tokens (each turn's end-of-turn id included), and SFT also trains the
        # template's text after each end-of-turn id, which the rollout appends as context (mask 0)
        rollout_mask = [0] * len(e.prompt_ids) + e.mask + [0] * len(after_eos)
        extra = [i for i, (a, b) in enumerate(zip(seq.loss_mask, rollout_mask)) if a != b]
        assert all(seq.loss_mask[i] == 1 and rollout_mask[i] == 0 for i in extra)
        ends = [i + 1 for i, t in enumerate(seq.input_ids) if t == renderer.eos_id and rollout_mask[i]]
        assert extra == [j + d for j in ends for d in range(len(after_eos))]
        assert len(ends) == e.num_turns
        # the environment agrees with the transcript: its tool message is the transcript's, the answer is right
        tool = len(said) == 2
        calls += tool
        assert e.metrics.get("tool_calls", 0.0) == float(tool) and e.metrics.get("tool_errors", 0.0) == 0.0
        assert e.reward == (1.0 if tool else 0.0)
        if tool:
            assert e.messages[3]["content"] == row["messages"][3]["content"] == str(e.messages[3]["content"])
    assert 0 < calls < len(rows)


def test_run_demo_reports_its_own_held_out_metrics(tmp_path):
    from polyrl.agents.demo import held_out_metrics, run_demo

    small = dict(
        sft_rows=16, sft_steps=3, mix_steps=2, rl_steps=2, rl_prompts=2, rl_samples=2, eval_prompts=3,
        eval_samples=2, micro_batch_tokens=512, max_new_tokens=8,
    )  # fmt: skip
    lines: list[str] = []
    res = run_demo(tmp_path / "demo", seed=1, log=lines.append, **small)
    text = "\n".join(lines)
    for stage in ("sft_tool-use", "sft_mixed", "grpo"):
        assert (tmp_path / "demo" / stage / "final" / "config.json").is_file(), stage
    assert len(res["curve"]) == 2
    table = dict(re.findall(r"^ {4}([a-z -]+?) +([\d.]+ -> +[\d.]+)", text, re.M))
    for key, label in (("tool_call_rate", "tool-call rate"), ("reward", "episode reward"), ("turns", "turns")):
        before, after = (float(x) for x in table[label].split("->"))
        assert (before, after) == pytest.approx((res["before"][key], res["after"][key]), abs=5e-3), label
    from polyrl.agents.demo import MAX_TURNS

    for when in ("before", "after"):
        m = res[when]
        # a reply without a tool call ends the episode: only episodes that called a tool (or sent a malformed call)
        # can take more than one turn, and none more than MAX_TURNS
        multi = min(1.0, m["tool_call_rate"] + m["tool_error_rate"])
        fewest, most = 1.0, 1.0 + (MAX_TURNS - 1) * multi + 1e-9
        assert fewest <= m["turns"] <= most, (when, m)
    # the held-out episodes are the task's test-split prompts with fixed seeds: a second scoring gives the same
    test = builtin.generate(TASK, "test", n=3)
    again = held_out_metrics(tmp_path / "demo" / "grpo" / "final", test, 2, 1 + 10_000, 8)
    assert again == res["after"]
    with pytest.raises(TypeError, match="unknown setting"):
        run_demo(tmp_path / "x", rl_stpes=1)
