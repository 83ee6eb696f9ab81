"""Asynchronous agentic RL (``[agent]`` runs with ``max_staleness``) on the CPU with the tiny preset, the builtin
``guessing`` environment and a dense-reward one (multi-turn episodes, one environment worker process): the producer
thread (its own copy of the weights; episodes, environment calls included, run in it) gives the inline producer's
run bit for bit (rewards, losses, every metric but the clocks, the transcripts of rollouts.jsonl) while the episodes
of batch s+1 run beside step s's training; no sample older than K is trained on; a resumed run reproduces the
uninterrupted one (the queue keeps each batch's transcripts); an agent program through the proxy runs in the
producer thread too; the process producer and partial rollouts are refused at config time."""

from __future__ import annotations

import json
import shutil

import pytest
from _async_runs import raw_config, records, run, without_clocks


def _agentic(model_dir, out, steps=4, save_every=0, **algo_kw):
    import polyrl.agents  # noqa: F401  (registers the [agent] table)

    table = {"prompts_per_step": 2, "samples_per_prompt": 3, "max_new_tokens": 6, "rollouts_to_save": 2, **algo_kw}
    raw = raw_config(model_dir, out, "exact_match", steps=steps, save_every=save_every, **table)
    raw["agent"] = {"env": "guessing", "env_workers": 1, "max_turns": 3, "max_episode_tokens": 256}
    raw["engine"]["micro_batch_tokens"] = 512
    return raw


# a multi-turn environment with a dense reward (the digits of each reply), so that every step of a 4-step run has
# non-zero advantages and losses (a random tiny model rarely wins ``guessing``: its runs learn from step 1 only)
DIGITS_ENV = """
from polyrl.agents.env import Environment, EnvStep


class DigitsEnv(Environment):
    def reset(self, example):
        self.turn = 0
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, message):
        self.turn += 1
        text = message.get("content") or ""
        reward = sum(ch.isdigit() for ch in text) / max(len(text), 1)
        return EnvStep([{"role": "user", "content": "Again."}], reward, self.turn >= 3)
"""


def _env(name, folder):
    if name == "guessing":
        return name
    path = folder / "digits_env.py"
    path.write_text(DIGITS_ENV)
    return f"{path}:DigitsEnv"


def _plain(rec):
    return without_clocks(rec, ("weight_sync/",))


def _rows(out):
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("env", ["guessing", "digits"])
def test_thread_producer_equals_inline_and_overlaps_training(tiny_model_dir, tmp_path, env):
    for producer in ("inline", "thread"):
        raw = _agentic(tiny_model_dir, tmp_path / producer, max_staleness=1, async_producer=producer)
        raw["agent"]["env"] = _env(env, tmp_path)
        if env == "digits":  # greedy evaluation episodes in the trainer's thread, once the producer is drained
            raw["train"].update(eval_every=2, eval_data="builtin:arithmetic?max=9&n=8")
            raw[raw["algo"]]["eval_prompts"] = 4
        run(raw)
    inline, thread = records(tmp_path / "inline"), records(tmp_path / "thread")
    # same episodes (same versions, same seeds, same environment answers), same updates: bit for bit
    assert [r["step"] for r in thread] == [1, 2, 3, 4]
    assert [_plain(r) for r in inline] == [_plain(r) for r in thread]
    assert [r["step"] for r in thread if "eval_reward" in r] == ([2, 4] if env == "digits" else [])
    assert _rows(tmp_path / "inline") == _rows(tmp_path / "thread")
    # the run trains: a real comparison (guessing: step 1 only; digits: every step)
    assert sum(r["loss"] != 0.0 for r in thread) >= (1 if env == "guessing" else 4)
    assert len({r["reward"] for r in thread}) > 1
    # staleness: step 1 trains version 0 on version 0, every later step one version stale, never older
    assert [r["async/staleness_max"] for r in thread] == [0.0, 1.0, 1.0, 1.0]
    for r in thread[1:]:
        assert r["async/staleness_mean"] == 1.0 and "async/tokens_lag0" not in r
        assert r["async/tokens_lag1"] == r["response_length"] * 6  # the 6 episodes' policy tokens
        assert "async/is_weight_mean" in r and r["mismatch_mean"] > 1e-4
    assert all(r["async/stale_dropped_total"] == 0.0 for r in thread)
    # the producer thread ran batch s+1's episodes while step s trained; the inline producer before it
    for a, b in zip(thread, thread[1:]):
        assert b["async/gen_start_s"] < a["async/train_end_s"] and b["async/gen_end_s"] > a["async/train_start_s"]
    for a, b in zip(inline, inline[1:]):
        assert b["async/gen_end_s"] <= a["async/train_start_s"]
    # each row's transcript is the episode of its own sample (not of the batch the thread generated since)
    for r in _rows(tmp_path / "thread"):
        assert r["kind"] == "episode"
        first = r["mask"].index(0)
        assert "".join(r["tokens"][:first]).strip() == r["messages"][1]["content"].strip()


def test_thread_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    full = tmp_path / "full"
    raw = _agentic(tiny_model_dir, full, save_every=2, max_staleness=2, async_producer="thread")
    raw["agent"]["env"] = _env("digits", tmp_path)
    run(raw)
    ckpt = full / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())["data"]["async"]
    assert state["version"] == 2 and [b["step"] for b in state["queue"]] == [2, 3]  # K = 2 batches ahead
    assert [b["version"] for b in state["queue"]] == [0, 1]
    for b in state["queue"]:  # each queued batch keeps its episodes' transcripts, one per sample
        assert len(b["extra"]) == len(b["samples"]) > 0
        assert [e["ids"] for e in b["extra"]] == [s["completion_ids"] for s in b["samples"]]
    resumed = tmp_path / "resumed"
    raw2 = json.loads(json.dumps(raw))
    raw2["out"], raw2["resume"] = str(resumed), str(ckpt)
    assert run(raw2)["resumed_from_step"] == 2
    a, b = records(full), records(resumed)
    assert [r["step"] for r in b] == [3, 4]
    assert [_plain(r) for r in a[2:]] == [_plain(r) for r in b] and all(r["loss"] != 0.0 for r in b)
    # no sample older than K = 2 versions was trained on, in either run
    assert [r["async/staleness_max"] for r in a] == [0.0, 1.0, 2.0, 2.0]
    assert [r["async/staleness_max"] for r in b] == [2.0, 2.0]
    # the rows of the queued steps come back with their transcripts, as the uninterrupted run wrote them
    rows = [r for r in _rows(full) if r["step"] > 2]
    assert rows == _rows(resumed) and all(r["kind"] == "episode" and r["messages"] for r in rows)
    shutil.rmtree(resumed)


def test_agentic_producers_refused_at_config_time(tiny_model_dir, tmp_path):
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError, match='rollout worker processes generate single completions.*"thread"'):
        run(_agentic(tiny_model_dir, tmp_path / "p", max_staleness=1, async_producer="process"))
    with pytest.raises(ConfigError, match="partial_rollouts does not reach agentic runs"):
        run(_agentic(tiny_model_dir, tmp_path / "q", max_staleness=1, async_producer="thread", partial_rollouts=True))
    # synchronous runs are not checked for producers
    from polyrl.agents.config import AgentConfig
    from polyrl.algorithms.grpo import GRPOConfig

    AgentConfig(env="guessing").check(GRPOConfig(async_producer="process"), "grpo")


AGENT_FILE = """
import openai

def agent(base_url, example):
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": example["prompt"]}]
    text = ""
    for _ in range(2):
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=99)
        text += r.choices[0].message.content or ""
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return float(any(ch.isdigit() for ch in text))
"""


def test_thread_producer_drives_an_agent_through_the_proxy(tiny_model_dir, tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_FILE)
    out = tmp_path / "proxy"
    raw = _agentic(tiny_model_dir, out, steps=3, max_staleness=1, async_producer="thread")
    raw["agent"] = {"agent": f"{path}:agent", "max_turns": 2, "max_episode_tokens": 200}
    run(raw)
    recs = records(out)
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    for r in recs:
        assert r["episode/turns"] == 2.0 and r["env_failures"] == 0.0
    # the proxy serves the rollout copy: at step 1 (version 0 on version 0) the trainer's recompute matches the
    # recorded log-probs; later the policy moved between behaviour and proximal versions
    assert recs[0]["mismatch_max"] < 1e-3 and recs[-1]["mismatch_mean"] > 1e-4
    for a, b in zip(recs, recs[1:]):  # the agents' calls for batch s+1 were served while step s trained
        assert b["async/gen_start_s"] < a["async/train_end_s"] and b["async/gen_end_s"] > a["async/train_start_s"]
