"""Evaluation during training in proxy mode (``--agent``): the greedy and the sampled (``eval_n``) evaluation run the
agent program through the OpenAI-compatible proxy, and their metrics count agent runs (episodes), whatever the
proxy recorded of them: an agent that rewrites its history gives two segments (two training samples) but is one
episode of the evaluation, and an agent that fails before its first call (nothing recorded) is still one episode,
with the failure reward. The numbers are checked against the agent's own account of every run it made (its
replies' token ids, its reward), in the order the run called it; ``eval_max_new_tokens`` caps the evaluation's
calls."""

from __future__ import annotations

import json
from math import comb

import pytest

pytest.importorskip("openai")

AGENT = """
import json
import threading

import openai

_lock = threading.Lock()


def agent(base_url, example):
    eid = base_url.rstrip("/").split("/")[-2]  # .../agents/ep<g>-<j>-<id>/v1
    g, j = int(eid.split("-")[0][2:]), int(eid.split("-")[1])
    row = {"g": g, "j": j, "tokens": [], "reward": None}
    try:
        if g == 0 and j == 1:
            raise RuntimeError("this run fails before its first call")
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        text = ""
        # the second call does not extend the first conversation: the proxy records two segments
        for content in (example["prompt"], "Once more: " + example["prompt"]):
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}])
            row["tokens"].append(len(r.choices[0].model_extra["token_ids"]))
            text += r.choices[0].message.content or ""
        # prompt 0 passes (its other run fails: it passes once of twice), the others by the text's parity
        row["reward"] = 1.0 if g == 0 else float(sum(ord(ch) for ch in text) % 2)
        return row["reward"]
    finally:
        with _lock, open(LOG, "a") as f:
            f.write(json.dumps(row) + "\\n")
"""

EVAL_PROMPTS, N, FAILURE = 4, 2, -1.0


def _raw(model_dir, out, agent):
    return {
        "algo": "grpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=16"},
        "engine": {"micro_batch_tokens": 512},
        "optim": {"lr": 1e-2},
        "train": {
            "max_steps": 1,
            "log_every": 100,
            "report_to": "none",
            "eval_every": 1,
            "eval_before_train": True,
            "eval_data": "builtin:arithmetic?max=9&n=8",
        },  # fmt: skip
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "grpo": {
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 6,
            "eval_max_new_tokens": 3,
            "eval_prompts": EVAL_PROMPTS,
            "eval_n": N,
            "failure_reward": FAILURE,
        },  # fmt: skip
        "agent": {"agent": agent, "max_turns": 2, "max_episode_tokens": 200},
    }


def _expected(greedy: list[dict], sampled: list[dict]) -> dict[str, float]:
    """The evaluation's metrics from the agent's own rows: one episode per agent run."""

    def reward(row):
        return FAILURE if row["reward"] is None else row["reward"]

    passed = [sum(reward(r) >= 1.0 for r in sampled if r["g"] == g) for g in range(EVAL_PROMPTS)]
    out = {
        "eval_reward": sum(map(reward, greedy)) / len(greedy),
        "eval_turns": sum(len(r["tokens"]) for r in greedy) / len(greedy),
        "eval_tool_call_rate": 0.0,
        "eval_sampled_reward": sum(map(reward, sampled)) / len(sampled),
        "eval_length": sum(sum(r["tokens"]) for r in sampled) / len(sampled),
    }
    for k in (1, 2):
        out[f"eval_pass@{k}"] = sum(1 - comb(N - c, k) / comb(N, k) for c in passed) / EVAL_PROMPTS
    return out


def test_agent_run_eval_n_metrics_count_agent_runs(tiny_model_dir, tmp_path):
    import polyrl.agents  # noqa: F401  (registers the [agent] table)
    from polyrl import run as runner
    from polyrl.run import config

    log = tmp_path / "agent_log.jsonl"
    path = tmp_path / "my_agent.py"
    path.write_text(f"LOG = {str(log)!r}\n" + AGENT)
    out = tmp_path / "run"
    runner.run(config.build(_raw(tiny_model_dir, out, f"{path}:agent")))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]

    # the agent's rows in call order: step-0 evaluation (greedy, then sampled), step 1's rollout, step-1 evaluation
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    sizes = [EVAL_PROMPTS, EVAL_PROMPTS * N, 2 * 2, EVAL_PROMPTS, EVAL_PROMPTS * N]
    assert len(calls) == sum(sizes)
    phases, at = [], 0
    for size in sizes:
        phases.append(calls[at : at + size])
        at += size
    for phase, n in zip(phases, (1, N, 2, 1, N)):
        assert sorted((r["g"], r["j"]) for r in phase) == [(g, j) for g in range(len(phase) // n) for j in range(n)]
    evals = [phase for k, phase in enumerate(phases) if k != 2]
    assert all(0 < t <= 3 for phase in evals for r in phase for t in r["tokens"])  # eval_max_new_tokens
    assert any(t == 3 for phase in evals for r in phase for t in r["tokens"])
    training = [t for r in phases[2] for t in r["tokens"]]
    assert all(0 < t <= 6 for t in training) and any(t > 3 for t in training)  # max_new_tokens

    for row, (greedy, sampled) in zip(rows, ((phases[0], phases[1]), (phases[3], phases[4]))):
        want = _expected(greedy, sampled)
        assert {k: row[k] for k in want} == pytest.approx(want, abs=1e-12), row["step"]
        assert row["eval_pass@1"] < row["eval_pass@2"]  # prompt 0 passes once of twice
    # the failed run (prompt 0, j = 1) is in the sampled evaluation with the failure reward
    assert any(r["reward"] is None for r in phases[1])
    # training: each agent run gives two samples (its segments); the failed one none, counted as a failure
    assert rows[1]["env_failures"] == 1.0
