"""Asynchronous agentic RL (``[agent]`` runs with ``max_staleness``) on the CPU with the tiny preset, the builtin
``guessing`` environment and a dense-reward one (multi-turn episodes, one environment worker process): the producer
thread (its own copy of the weights; episodes, environment calls included, run in it) gives the inline producer's
run bit for bit (rewards, losses, every metric but the clocks, the transcripts of rollouts.jsonl) while the episodes
of batch s+1 run beside step s's training; no sample older than K is trained on; a resumed run reproduces the
uninterrupted one (the queue keeps each batch's transcripts); an agent program through the proxy runs in the
producer thread too. Partial rollouts (``partial_rollouts``): a weight update lands between engine steps of the
episode loop while episodes are in flight; each token records the version that sampled it (checked against the
engine's version at the swap and against a recompute under each version's weights), and a run trains no token older
than K. The process producer: environment episodes in 2 rollout worker processes, each replica's episodes those of
the episode loop on its share, the same episodes as the thread run (log-probs to float rounding), a dead replica's
share run by the trainer, the staleness bound; with partial rollouts (each worker's episode loop takes the update at
its engine step N) the thread run's tokens, transcripts, per-token versions and rewards. An agent program through
the proxy with partial rollouts: the proxy's engine driver thread takes the update between its engine steps, and the
recorded calls carry per-token versions. The process producer for an agent program: each of 2 rollout workers serves
its share through a proxy of its own (under torchrun too); with partial rollouts each worker's proxy driver takes the
update between its engine steps (per-token versions, a dead worker's share in the trainer on one version)."""

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
    # without partial rollouts: one version per sample, no per-token versions, no swap mid-episode
    assert not any(k in r for r in thread for k in ("async/mixed_version_samples", "async/weight_swaps_total"))
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
        # without partial rollouts: no per-token versions, the batch's version on every sample
        assert all(e["versions"] is None for e in b["extra"])
        assert all(s["token_versions"] is None and s["policy_version"] == b["version"] for s in b["samples"])
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


def test_process_producer_runs_episodes_in_two_workers(tiny_model_dir, tmp_path, monkeypatch):
    """Environment episodes with ``async_producer = "process"``, 2 CPU rollout workers (each runs the episode loop on
    its own engine, with its own environment pool of one worker process) and greedy evaluation episodes every 2
    steps; replica 1 is killed just before batch 2's episodes (restarts off): its example of that batch runs in the
    trainer (the episode loop on its rollout engine) in the same call, later calls go to replica 0 alone.
    (a) Each replica's episodes are, bit for bit, the episode loop's on its share alone with the same weights
    (checked against the trainer's rollout copy, which holds version 0 until step 1's update is published).
    (b) Against the thread producer (one engine for all 6 episodes): the same episodes (tokens, masks, transcripts,
    rewards, every episode and evaluation metric, the rows of rollouts.jsonl); the log-probs agree to float rounding
    only, since the engine's CPU forward is not batch-invariant (a replica's steps batch 3 episodes' turns, the
    thread's 6: other matmul shapes, other fp32 rounding), so the losses agree closely, not exactly. (c) The
    staleness bound holds and the episodes overlap training."""
    import os
    import signal

    import torch

    from polyrl.agents import train as agents_train
    from polyrl.run import online

    calls = []  # (examples, n, sampling, seeds, episodes) of every remote_episodes call, in order
    remote = agents_train.remote_episodes

    def recording(workers, env, examples, n, sampling, seeds, *rest):
        if len(calls) == 2:  # batch 2: replica 1 dies just before it (its share then runs in the trainer)
            os.kill(workers.procs[1].pid, signal.SIGKILL)
            workers.procs[1].join()
        eps = remote(workers, env, examples, n, sampling, seeds, *rest)
        calls.append((examples, n, sampling, seeds, eps))
        return eps

    local_calls = []  # the number of examples of each call of the trainer's own episode loop
    local = agents_train.EpisodeSteps.local_episodes

    def counting(self, examples, *args):
        local_calls.append(len(examples))
        return local(self, examples, *args)

    checked = []
    original = online.OnlineRun._async_record

    def check(self, batch, t_train, t_end):
        if batch.step == 0:
            self.source.drain()  # batch 1 (version 0) is done: the rollout copy still holds version 0
            for examples, n, sampling, seeds, eps in calls[:2]:  # batches 0 and 1
                for g in range(len(examples)):  # example g ran on replica g (balance "count")
                    alone = self.local_episodes(examples[g : g + 1], n, sampling, seeds[g : g + 1])
                    got = [e for e in eps if e.group == g]
                    for e in alone:
                        e.group = g
                    assert [vars(e) for e in alone] == [vars(e) for e in got]
                    checked.append(len(got))
        return original(self, batch, t_train, t_end)

    runs = {}
    for producer in ("thread", "process"):
        raw = _agentic(tiny_model_dir, tmp_path / producer, steps=3, max_staleness=1, async_producer=producer,
                       rollout_workers=2, rollout_balance="count", rollout_worker_restarts=0)  # fmt: skip
        raw["agent"].update(env=_env("digits", tmp_path), env_workers=1 if producer == "process" else 0)
        raw["train"].update(eval_every=2, eval_data="builtin:arithmetic?max=9&n=8")
        raw[raw["algo"]]["eval_prompts"] = 4
        if producer == "process":
            monkeypatch.setattr(agents_train, "remote_episodes", recording)
            monkeypatch.setattr(online.OnlineRun, "_async_record", check)
            monkeypatch.setattr(agents_train.EpisodeSteps, "local_episodes", counting)
        run(raw)
        runs[producer] = records(tmp_path / producer)
    thread, proc = runs["thread"], runs["process"]
    assert checked == [3, 3, 3, 3]  # (a): 2 batches x 2 replicas, 3 episodes each
    assert len(calls) == 5  # batches 0-2 and two evaluations, each through the replicas' call
    # (b) the same episodes and everything computed from them alone; the rest close
    model_side = ("loss", "grad_norm", "mismatch", "entropy", "kl", "is_weight", "clip", "rollout_worker", "replica")
    assert [_plain(r) for r in thread] != [_plain(r) for r in proc]  # not bit for bit (see above)
    same = [[without_clocks(_plain(r), model_side) for r in rs] for rs in (thread, proc)]
    assert same[0] == same[1] and [r["step"] for r in proc if "eval_reward" in r] == [2, 3]
    for a, b in zip(thread, proc):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2, abs=1e-6)
        assert b["mismatch_mean"] == pytest.approx(a["mismatch_mean"], rel=2e-2, abs=1e-6)
    rows_t, rows_p = _rows(tmp_path / "thread"), _rows(tmp_path / "process")
    assert len(rows_t) == len(rows_p) == 6
    for a, b in zip(rows_t, rows_p):
        lp = ("logprobs", "trainer_logprobs")
        assert {k: v for k, v in a.items() if k not in lp} == {k: v for k, v in b.items() if k not in lp}
        la, lb = (torch.tensor([x for x in r["logprobs"] if x is not None]) for r in (a, b))
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)  # the rows round to 1e-5
    # both replicas ran episodes; replica 1 died at batch 2's send: its example ran in the trainer in that call
    # (after the 4 single-example checks of (a)), and the evaluations ran on replica 0 alone
    assert local_calls == [1, 1, 1, 1, 1]
    assert [r["async/rollout_workers_alive"] for r in proc] == [2.0, 1.0, 1.0]
    assert [r["async/rollout_worker_failures_total"] for r in proc] == [0.0, 1.0, 1.0]
    assert [r["async/replica_share_max"] for r in proc] == [0.5, 0.5, 1.0]
    assert proc[0]["async/replica0_work_per_s"] > 0 and proc[0]["async/replica1_work_per_s"] > 0
    # (c) step 1 trains version 0, every later step exactly one version stale, nothing dropped
    assert [r["async/staleness_max"] for r in proc] == [0.0, 1.0, 1.0]
    for r in proc[1:]:
        assert r["async/staleness_mean"] == 1.0 and r["async/tokens_lag1"] == r["response_length"] * 6
    assert all(r["async/stale_dropped_total"] == 0.0 for r in proc)
    for a, b in zip(proc, proc[1:]):  # the episodes of batch s+1 ran while step s trained
        assert b["async/gen_start_s"] < a["async/train_end_s"] and b["async/gen_end_s"] > a["async/train_start_s"]


def test_agent_config_takes_every_producer(monkeypatch):
    """Environment episodes and agent programs take every producer, with or without partial rollouts, in one process
    and under torchrun (the launcher's WORLD_SIZE): test_process_producer_runs_agents_in_two_workers,
    test_process_producer_partial_rollouts_of_an_agent and, under torchrun,
    tests/distributed/test_agentic_distributed.py. What the table still refuses is its own limits."""
    from polyrl.agents.config import AgentConfig
    from polyrl.algorithms.grpo import GRPOConfig
    from polyrl.errors import ConfigError

    partial = dict(partial_rollouts=True, partial_swap_step=8)  # the inline producer has nothing in flight
    settings = [("inline", {}), ("thread", {}), ("process", {}), ("thread", partial), ("process", partial)]
    for world in ("1", "2"):
        monkeypatch.setenv("WORLD_SIZE", world)
        for producer, extra in settings:
            config = GRPOConfig(max_staleness=1, async_producer=producer, **extra)
            AgentConfig(agent="a.py:f").check(config, "grpo")
            AgentConfig(env="guessing").check(config, "grpo")
    with pytest.raises(ConfigError, match="max_episode_tokens .* must exceed grpo.max_new_tokens"):
        AgentConfig(agent="a.py:f", max_episode_tokens=8).check(GRPOConfig(max_new_tokens=64), "grpo")


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


# the agent above, failing (after its calls, so its segments are recorded with the failure reward) when the
# example's answer is divisible by 3, and writing the proxy that served it (its address, the process id) to SEEN
FLAKY_AGENT_FILE = AGENT_FILE.replace(
    "    return float(",
    "    with open(SEEN, 'a') as f:\n        f.write(base_url.split('/agents/')[0] + ' ' + str(os.getpid()) + '\\n')\n"
    "    if int(float(example['answer'])) % 3 == 0:\n        raise RuntimeError('answers divisible by 3 fail')\n"
    "    return float(",
).replace("import openai", "import os\n\nimport openai")


def test_process_producer_runs_agents_in_two_workers(tiny_model_dir, tmp_path, monkeypatch):
    """An agent program through the proxy with ``async_producer = "process"``, 2 CPU rollout workers (K = 1, 3
    steps): each worker imports the agent file and serves its own engine through a proxy of its own (kept across
    calls), runs its share of every batch's agent runs and sends the episodes and its failure counts back; the
    trainer's own proxy runs nothing (no worker died). Each batch's episodes are grouped as the trainer expects
    (every example's 3 runs, 2 turns each), the failures of the agent (answers divisible by 3) are counted in
    ``env_failures`` with the failure reward, the staleness bound holds and the losses are finite."""
    import math
    import os

    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from polyrl.agents import train as agents_train

    calls = []  # per remote_agent_episodes call: (examples, episodes)
    remote = agents_train.remote_agent_episodes

    def recording(workers, spec, examples, *rest):
        eps = remote(workers, spec, examples, *rest)
        calls.append((examples, eps))
        return eps

    local_calls = []
    monkeypatch.setattr(agents_train, "remote_agent_episodes", recording)
    monkeypatch.setattr(agents_train.EpisodeSteps, "local_episodes", lambda self, xs, *a: local_calls.append(xs))
    path = tmp_path / "my_agent.py"
    seen = tmp_path / "seen.txt"
    path.write_text(f"SEEN = {str(seen)!r}\n" + FLAKY_AGENT_FILE)
    out = tmp_path / "proxy"
    raw = _agentic(tiny_model_dir, out, steps=3, max_staleness=1, async_producer="process", rollout_workers=2,
                   rollout_balance="count", failure_reward=-1.0)  # fmt: skip
    raw["agent"] = {"agent": f"{path}:agent", "max_turns": 2, "max_episode_tokens": 200}
    run(raw)
    recs = records(out)
    assert local_calls == [] and len(calls) == 3  # batches 0-2, all in the workers
    # every run was served by one of two proxies, one per worker process (not the trainer's), each kept for the 3
    # calls: 9 runs each
    served = [tuple(line.split()) for line in seen.read_text().splitlines()]
    assert len(served) == 18 and len({url for url, _ in served}) == 2 and len({pid for _, pid in served}) == 2
    assert all(int(pid) != os.getpid() for _, pid in served)
    assert sorted(sum(1 for x in served if x == k) for k in set(served)) == [9, 9]
    failed = 0
    for examples, eps in calls:
        # one segment per run (the agent extends its conversation): each example's 3 runs, in (group, index) order
        assert [(e.group, e.index) for e in eps] == [(g, j) for g in range(2) for j in range(3)]
        for e in eps:
            flaky = int(float(examples[e.group]["answer"])) % 3 == 0
            assert e.metrics["turns"] == 2.0 and len(e.turns) == 2 and e.trainable
            assert e.status == ("env_error" if flaky else "done")
            assert e.reward == -1.0 if flaky else e.reward in (0.0, 1.0)
            failed += flaky
    assert 0 < failed < 18  # the agent failed on some examples, not on all
    assert [r["env_failures"] for r in recs] == [
        float(sum(int(float(x["answer"])) % 3 == 0 for x in xs) * 3) for xs, _ in calls
    ]
    assert recs[-1]["env_failures_total"] == failed
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert all(r["async/stale_dropped_total"] == 0.0 for r in recs)
    for r in recs:
        assert r["episode/turns"] == 2.0 and math.isfinite(r["loss"]) and r["async/replica_share_max"] == 0.5
        assert r["async/replica0_work_per_s"] > 0 and r["async/replica1_work_per_s"] > 0


def test_partial_rollouts_of_an_agent_through_the_proxy(tiny_model_dir, tmp_path, monkeypatch):
    """Partial rollouts of an agent program through the proxy (K = 1, thread producer, update at engine step 4 of
    the proxy's driver thread): the agents' first calls are in flight there, so every batch after the first takes
    the trainer's update mid-episode (``async/weight_swaps_total``), in the driver thread; the trained samples (one
    per recorded segment) carry each token's version: never decreasing along a sample, one sample at least with both,
    the oldest token's version as the sample's, none older than K; the losses are finite."""
    import math
    import threading

    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from polyrl.run import async_rollout, online

    batches = []  # (step, per sample (completion ids, token versions, policy version))
    original = online.OnlineRun._async_record

    def record(self, batch, t_train, t_end):
        batches.append((batch.step, [(s.completion_ids, s.token_versions, s.policy_version) for s in batch.samples]))
        return original(self, batch, t_train, t_end)

    swaps = []  # (thread name, the engine's version before, after) of every update taken in flight
    apply = async_rollout.PartialRollouts._apply

    def applying(self, version, in_flight):
        before = self.engine.policy_version
        apply(self, version, in_flight)
        if in_flight:
            swaps.append((threading.current_thread().name, before, self.engine.policy_version))

    monkeypatch.setattr(online.OnlineRun, "_async_record", record)
    monkeypatch.setattr(async_rollout.PartialRollouts, "_apply", applying)
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_FILE)
    out = tmp_path / "proxy"
    raw = _agentic(tiny_model_dir, out, steps=3, max_staleness=1, async_producer="thread", partial_rollouts=True,
                   partial_swap_step=4)  # fmt: skip
    raw["agent"] = {"agent": f"{path}:agent", "max_turns": 2, "max_episode_tokens": 200}
    run(raw)
    recs = records(out)
    # batches 1 and 2 (submitted at versions 0 and 1) took versions 1 and 2 mid-episode, in the proxy's driver thread
    assert [r["async/weight_swaps_total"] for r in recs] == [0.0, 1.0, 2.0]
    assert swaps == [("polyrl-agent-engine", 0, 1), ("polyrl-agent-engine", 1, 2)]
    assert [b[0] for b in batches] == [0, 1, 2]
    for r in recs:
        assert r["episode/turns"] == 2.0 and r["env_failures"] == 0.0 and math.isfinite(r["loss"])
        assert r["async/staleness_max"] <= 1.0 and r["async/stale_dropped_total"] == 0.0
    for (step, samples), r in zip(batches, recs):
        assert samples and all(len(v) == len(ids) for ids, v, _ in samples)
        assert all(v == sorted(v) and pv == min(v) and step - pv <= 1 for _, v, pv in samples)
        mixed = sum(len(set(v)) > 1 for _, v, _ in samples)
        assert r["async/mixed_version_samples"] == float(mixed)
        if step == 0:  # produced on demand at version 0: takes no update
            assert {x for _, v, _ in samples for x in v} == {0} and mixed == 0
        else:
            assert {x for _, v, _ in samples for x in v} == {step - 1, step} and mixed > 0
            assert r["async/tokens_lag0"] > 0 and r["async/tokens_lag1"] > 0


# the flaky agent above, killing its own process when that is the one whose id is in the file KILL
KILLING_AGENT_FILE = FLAKY_AGENT_FILE.replace(
    "    client = ",
    "    if os.path.exists(KILL) and open(KILL).read() == str(os.getpid()):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n    client = ",
).replace("import os\n", "import os\nimport signal\n")


def test_process_producer_partial_rollouts_of_an_agent(tiny_model_dir, tmp_path, monkeypatch):
    """Partial rollouts of an agent program with ``async_producer = "process"`` (2 CPU rollout workers, K = 1, 3
    steps, the update at engine step 4 of each worker's proxy driver): each worker's proxy takes the batch's update
    between its engine steps while its agents' calls are in flight, so the batches after the first mix the two
    versions within recorded segments; the trained samples (one per segment) carry each token's version: as many as
    tokens, never decreasing, the oldest as the sample's, none older than K; the agent's failures are counted with
    the failure reward; the losses are finite. Replica 1 dies in batch 2 (its agent kills it; restarts off): its
    example runs through the trainer's own proxy in that call, on one version (no swap inside it)."""
    import math
    import os

    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from polyrl.agents import train as agents_train
    from polyrl.run import online

    batches = []  # (step, per sample (completion ids, token versions, policy version, reward))
    original = online.OnlineRun._async_record

    def record(self, batch, t_train, t_end):
        rows = [(s.completion_ids, s.token_versions, s.policy_version, r) for s, r in zip(batch.samples, batch.rewards)]
        batches.append((batch.step, rows))
        return original(self, batch, t_train, t_end)

    calls = []
    remote = agents_train.remote_agent_episodes
    kill = tmp_path / "kill.txt"

    def recording(workers, *args):
        if len(calls) == 2:  # batch 2: replica 1 gets its share, then dies in it (it then runs in the trainer)
            kill.write_text(str(workers.procs[1].pid))
        calls.append(args)
        return remote(workers, *args)

    local_calls = []  # the examples of each call of the trainer's own proxy
    local = agents_train.EpisodeSteps.local_episodes

    def counting(self, examples, *args):
        local_calls.append(len(examples))
        return local(self, examples, *args)

    monkeypatch.setattr(online.OnlineRun, "_async_record", record)
    monkeypatch.setattr(agents_train, "remote_agent_episodes", recording)
    monkeypatch.setattr(agents_train.EpisodeSteps, "local_episodes", counting)
    path = tmp_path / "my_agent.py"
    seen = tmp_path / "seen.txt"
    path.write_text(f"SEEN = {str(seen)!r}\nKILL = {str(kill)!r}\n" + KILLING_AGENT_FILE)
    out = tmp_path / "proxy"
    raw = _agentic(tiny_model_dir, out, steps=3, max_staleness=1, async_producer="process", rollout_workers=2,
                   rollout_balance="count", rollout_worker_restarts=0, failure_reward=-1.0, partial_rollouts=True,
                   partial_swap_step=4)  # fmt: skip
    raw["agent"] = {"agent": f"{path}:agent", "max_turns": 2, "max_episode_tokens": 200}
    run(raw)
    recs = records(out)
    assert len(calls) == 3 and local_calls == [1]  # batch 2's example 1, in the trainer
    # every run was served by a proxy: one per worker process, and the trainer's for replica 1's share of batch 2
    served = [tuple(line.split()) for line in seen.read_text().splitlines()]
    assert len(served) == 18 and len({pid for _, pid in served}) == 3
    assert sum(int(pid) == os.getpid() for _, pid in served) == 3
    # batches 1 and 2 (submitted at versions 0 and 1) took versions 1 and 2 while their agents ran in the workers
    assert [r["async/weight_swaps_total"] for r in recs] == [0.0, 1.0, 2.0]
    assert [b[0] for b in batches] == [0, 1, 2]
    failed = 0
    for (step, samples), r in zip(batches, recs):
        assert len(samples) == 6 and all(len(v) == len(ids) for ids, v, _, _ in samples)
        assert all(v == sorted(v) and pv == min(v) and step - pv <= 1 for _, v, pv, _ in samples)
        mixed = sum(len(set(v)) > 1 for _, v, _, _ in samples)
        assert r["async/mixed_version_samples"] == float(mixed)
        if step == 0:  # produced on demand at version 0: takes no update
            assert {x for _, v, _, _ in samples for x in v} == {0} and mixed == 0
        else:  # tokens after the swap carry the newer version, within one segment
            assert {x for _, v, _, _ in samples for x in v} == {step - 1, step} and mixed > 0
            assert r["async/tokens_lag0"] > 0 and r["async/tokens_lag1"] > 0
        flaky = sum(rw == -1.0 for _, _, _, rw in samples)
        assert r["env_failures"] == float(flaky) and flaky % 3 == 0  # an example's 3 runs fail together
        failed += flaky
        assert r["episode/turns"] == 2.0 and math.isfinite(r["loss"])
        assert r["async/staleness_max"] <= 1.0 and r["async/stale_dropped_total"] == 0.0
    # batch 2: example 0 (replica 0) took version 2 at its step 4; example 1 ran in the trainer on one version (1,
    # or 2 when the trainer's engine took the update first)
    (_, last) = batches[2]
    assert {x for _, v, _, _ in last[:3] for x in v} == {1, 2}
    assert len({x for _, v, _, _ in last[3:] for x in v}) == 1
    assert [r["async/rollout_workers_alive"] for r in recs] == [2.0, 1.0, 1.0]
    assert [r["async/replica_share_max"] for r in recs] == [0.5, 0.5, 0.5]  # batch 2 was split before it died
    assert 0 < failed < 18 and recs[-1]["env_failures_total"] == failed


def _episode_run(raw):
    """An agentic run object (not started): the run class of ``raw``'s ``[agent]`` table over ``OnlineRun``."""
    import io

    from polyrl.run import config
    from polyrl.run.online import OnlineRun

    cfg = config.build(raw)
    return cfg, cfg.episodes.run_class(OnlineRun)(cfg, cfg.spec.hooks(cfg.algo_config), io.StringIO())


def _recompute(model, samples, temperature):
    """Per sample, its policy tokens' log-probs under ``model`` in one plain forward of the whole episode."""
    import torch

    from polyrl.algorithms.rl_batch import completion_logprobs, pack_samples

    lps = [None] * len(samples)
    with torch.no_grad():
        for b in pack_samples(samples, max_tokens=4096):
            lp, _ = completion_logprobs(model, b, temperature)
            for j, v in zip(b.sample_ids, b.per_sample(lp)):
                lps[j] = v
    return lps


def test_partial_rollouts_an_update_lands_mid_episode(tiny_model_dir, tmp_path):
    """Partial rollouts in an agentic thread run: batch 1's episodes (submitted at version 0) take version 1 at their
    engine step 8, in the middle of their second turn. Each token's recorded version is the engine's when it sampled
    it (the tokens a turn running at the swap had generated by then are version 0, the rest 1), versions never
    decrease along an episode, and the behaviour log-probs are each version's: a version-0 token's equals a plain
    forward under version 0, and a token of a turn started after the swap (prefilled afresh: the swap forgets the
    prefix cache) a plain forward under version 1; the tokens of the turn spanning the swap saw the older weights'
    kept KV, which neither reproduces (the caveat of docs/async-rl.md)."""
    import copy

    import torch

    raw = _agentic(tiny_model_dir, tmp_path / "run", steps=2, max_staleness=1, async_producer="thread",
                   partial_rollouts=True, partial_swap_step=8)  # fmt: skip
    raw["agent"]["env"] = _env("digits", tmp_path)
    cfg, r = _episode_run(raw)
    hook = r.policy.between_steps
    assert hook == r.source.between_steps  # the policy hands the source's hook to the episode loop
    swaps = []  # (engine step of the episode loop, tokens each running turn had generated before the swap)

    def recording(engine, steps):
        assert engine is r.policy.llm  # the rollout copy's engine, stepped by the episode loop
        before = engine.policy_version
        running = {rid: len(q.seqs[0].output_token_ids) for rid, q in engine._requests.items()}
        hook(engine, steps)
        if engine.policy_version != before:
            swaps.append((steps, before, engine.policy_version, running))

    r.policy.between_steps = recording
    v0 = copy.deepcopy(r.policy.rollout_net).eval()  # the weights of version 0
    try:
        r.step(0)  # trains batch 0 (version 0 only) and publishes version 1; batch 1's episodes are in flight
        batch = r.source.get(1)
        episodes = batch.extra
        v1 = r.policy.rollout_net.eval()  # the rollout copy now holds version 1 (the trainer's weights)
        for a, b in zip(r.policy.model.state_dict().values(), v1.state_dict().values()):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert len(swaps) == 1 and swaps[0][:3] == (8, 0, 1) and r.source.swaps_total == 1
        running = swaps[0][3]
        n = cfg.algo_config.samples_per_prompt
        spanning = 0
        samples = batch.samples
        assert len(samples) == len(episodes) == 6
        for s, e in zip(samples, episodes):
            assert s.token_versions == e["versions"] and len(s.token_versions) == len(s.completion_ids)
            assert s.token_versions == sorted(s.token_versions) and set(s.token_versions) <= {0, 1}
            assert s.policy_version == min(s.token_versions)
            k = e["group"] * n + e["index"]  # the episode's request ids: episode-{k}-turn-{t}
            for t, (a, b) in enumerate(e["turns"]):
                got = s.token_versions[a:b]
                rid = f"episode-{k}-turn-{t}"
                if rid in running:  # running at the swap: its tokens so far are version 0, the rest version 1
                    old = running[rid]
                    assert got == [0] * old + [1] * (b - a - old)
                    spanning += 0 < old < b - a
                else:
                    assert len(set(got)) == 1  # finished before the swap, or started after it
        assert spanning > 0 and sum(len(set(s.token_versions)) > 1 for s in samples) > 0
        # the behaviour log-probs against a recompute under each token's version
        t = cfg.algo_config.temperature
        lp0, lp1 = _recompute(v0, samples, t), _recompute(v1, samples, t)
        checked = [0, 0]
        for s, e, a0, a1 in zip(samples, episodes, lp0, lp1):
            got = torch.tensor(s.logprobs)
            mask = torch.tensor(s.mask, dtype=torch.bool)
            ver = torch.tensor(s.token_versions)[mask]
            fresh = torch.zeros(len(s.completion_ids), dtype=torch.bool)  # turns wholly after the swap
            for a, b in e["turns"]:
                fresh[a:b] = bool(s.token_versions[a] == 1)
            fresh = fresh[mask]
            torch.testing.assert_close(got[ver == 0], a0[ver == 0], atol=1e-5, rtol=0)
            torch.testing.assert_close(got[fresh], a1[fresh], atol=1e-5, rtol=0)
            late = (ver == 1) & ~fresh  # sampled by version 1 over version 0's KV of the turn's earlier tokens
            assert late.any() and float((got[late] - a0[late]).abs().max()) > 1e-3  # not the old weights'
            checked[0] += int((ver == 0).sum())
            checked[1] += int(fresh.sum())
        assert min(checked) > 0
        # the update moved the policy: the two versions' log-probs differ, so the checks above tell them apart
        assert max(float((a0 - a1).abs().max()) for a0, a1 in zip(lp0, lp1)) > 1e-3
    finally:
        r.source.close()
        r.env_pool.close()


def _same_run(thread, proc, rows_t, rows_p, batches_t, batches_p):
    """The process producer's partial run against the thread producer's: the same tokens, masks, per-token versions,
    transcripts and rewards (every metric computed from the episodes alone, every row but its log-probs), exactly.
    Floats: batch 0 (version 0 only) within 1e-5 (a replica's engine steps batch 3 episodes' turns, the thread's 6:
    other matmul shapes, so the CPU forward rounds a few ulps apart), and so step 1's loss and metrics; from then on
    the trained weights differ by what Adam makes of those ulps in step 1's gradient (the sign-like update of
    near-zero gradients), so later log-probs and losses agree closely, not to 1e-5 (as without partial rollouts:
    ``test_process_producer_runs_episodes_in_two_workers``)."""
    import torch

    model_side = ("loss", "grad_norm", "mismatch", "entropy", "kl", "is_weight", "clip", "rollout_worker", "replica")
    assert [without_clocks(_plain(r), model_side) for r in thread] == [
        without_clocks(_plain(r), model_side) for r in proc
    ]
    for a, b in zip(thread, proc):
        keys = [k for k in without_clocks(_plain(a)) if any(m in k for m in model_side[:7])]
        assert "loss" in keys and "async/is_weight_mean" in keys and set(keys) <= set(b)
        tol = 1e-5 if a["step"] == 1 else 2e-2
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=tol, abs=1e-5), k
    # the trained batches: tokens, masks and per-token versions equal; batch 0's log-probs within 1e-5
    assert [b[0] for b in batches_t] == [b[0] for b in batches_p] == [0, 1, 2, 3]
    for (step, samples_t), (_, samples_p) in zip(batches_t, batches_p):
        assert [s[:3] for s in samples_t] == [s[:3] for s in samples_p]
        assert step == 0 or len({v for s in samples_p for v in s[2]}) == 2  # batches after the first: two versions
        for a, b in zip(samples_t, samples_p):
            torch.testing.assert_close(torch.tensor(b[3]), torch.tensor(a[3]), atol=1e-5 if step == 0 else 5e-3, rtol=0)
    assert len(rows_t) == len(rows_p) == 8
    lp = ("logprobs", "trainer_logprobs")
    for a, b in zip(rows_t, rows_p):
        assert {k: v for k, v in a.items() if k not in lp} == {k: v for k, v in b.items() if k not in lp}


def test_partial_rollouts_run_mixes_versions_within_the_staleness_bound_and_resumes(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A 4-step agentic thread run with partial rollouts (update at engine step 8 of the episode loop, greedy
    evaluation every 2 steps, which finishes the batch in flight first): every batch after the first holds episodes
    of two versions, the per-version token counts add up to the policy tokens, no token is older than K = 1, nothing
    is dropped, each update but the last (after the last step) lands in a batch in flight; the checkpoint's queue
    keeps each token's version (samples and transcripts) and the resumed run equals the uninterrupted one."""
    from polyrl.run import online

    batches = {}  # run folder -> (step, per sample (completion ids, mask, token versions, log-probs)) per batch
    original = online.OnlineRun._async_record

    def record(self, batch, t_train, t_end):
        samples = [(s.completion_ids, s.mask, s.token_versions, s.logprobs) for s in batch.samples]
        batches.setdefault(self.out.name, []).append((batch.step, samples))
        return original(self, batch, t_train, t_end)

    monkeypatch.setattr(online.OnlineRun, "_async_record", record)
    out = tmp_path / "partial"
    raw = _agentic(tiny_model_dir, out, save_every=2, max_staleness=1, async_producer="thread",
                   partial_rollouts=True, partial_swap_step=8)  # fmt: skip
    raw["agent"]["env"] = _env("digits", tmp_path)
    raw["train"].update(eval_every=2, eval_data="builtin:arithmetic?max=9&n=8")
    raw[raw["algo"]]["eval_prompts"] = 4
    run(raw)
    recs = records(out)
    # the same run with the process producer: each of 2 rollout workers runs the episode loop on its example, taking
    # the batch's update at engine step 8 of its own loop (every opening prompt is admitted in the first step, so
    # step 8 is each episode's step 8 in either producer)
    proc_out = tmp_path / "process"
    raw_p = json.loads(json.dumps(raw))
    raw_p["out"] = str(proc_out)
    raw_p["checkpoint"].update(every_n_steps=0, save_final=False)
    raw_p[raw["algo"]].update(async_producer="process", rollout_workers=2, rollout_balance="count")
    run(raw_p)
    _same_run(recs, records(proc_out), _rows(out), _rows(proc_out), batches["partial"], batches["process"])
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and [r["step"] for r in recs if "eval_reward" in r] == [2, 4]
    assert recs[0]["async/staleness_max"] == 0.0 and recs[0]["async/mixed_version_samples"] == 0.0
    for r in recs[1:]:
        # batch s was submitted at version s-1 and took version s at its engine step 8: both versions in it
        assert r["async/staleness_max"] == 1.0 and r["async/mixed_version_samples"] > 0
        assert r["async/tokens_lag0"] > 0 and r["async/tokens_lag1"] > 0
        assert r["async/tokens_lag0"] + r["async/tokens_lag1"] == r["response_length"] * 6  # the policy tokens
        assert 0.0 < r["async/staleness_mean"] < 1.0 and "async/is_weight_mean" in r
    assert all(r["async/stale_dropped_total"] == 0.0 and r["loss"] != 0.0 for r in recs)
    # read before each step's own update: updates 1, 2, 3 landed in batches 1, 2, 3 while their episodes ran
    assert [r["async/weight_swaps_total"] for r in recs] == [0.0, 1.0, 2.0, 3.0]
    ckpt = out / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())["data"]["async"]
    assert state["version"] == 2 and [b["step"] for b in state["queue"]] == [2]
    (queued,) = state["queue"]  # submitted at version 1, took version 2 at its engine step 8
    assert queued["version"] == 1 and len(queued["extra"]) == len(queued["samples"]) == 6
    for smp, e in zip(queued["samples"], queued["extra"]):
        assert smp["token_versions"] == e["versions"] and set(e["versions"]) == {1, 2}
        assert smp["policy_version"] == 1 and e["versions"] == sorted(e["versions"])
    resumed = tmp_path / "resumed"
    raw2 = json.loads(json.dumps(raw))
    raw2["out"], raw2["resume"] = str(resumed), str(ckpt)
    assert run(raw2)["resumed_from_step"] == 2
    again = records(resumed)
    assert [r["step"] for r in again] == [3, 4] and [_plain(r) for r in recs[2:]] == [_plain(r) for r in again]
    rows = [r for r in _rows(out) if r["step"] > 2]
    assert rows == _rows(resumed) and all(r["kind"] == "episode" and r["messages"] for r in rows)
    shutil.rmtree(resumed)
