"""Agentic RL under torchrun: 2 gloo ranks, FSDP2, each rank running the episodes of its share of the prompts with its
own environment pool (a worker process per rank; in the async runs, in the rank's process) or its own agent proxy,
in ONE spawn of two processes running eight runs in turn (``dist_async_worker``), plus two one-process runs here. The
environment is a multi-turn one with a dense reward (the digits of each reply, so that every step has non-zero
advantages and losses; the builtin ``guessing`` game rewards a random tiny model at step 1 only) that raises on the
second turn of an example whose answer is divisible by 3 (failures counted on whichever rank ran the episode). GRPO,
4 steps of 2 prompts x 3 episodes, 2 mini-batches, greedy and ``eval_n = 2`` sampled evaluation episodes every 2
steps, a checkpoint every 2.

- synchronous, 2 ranks vs one process: the same episodes (every token, mask, reward, status, transcript of
  rollouts.jsonl, every episode, failure and evaluation metric) exactly; the log-probs, losses, mismatch and the
  final weights within fp32 noise (each rank's engine batches 3 episodes' turns instead of 6, and the CPU forward
  is not batch-invariant: other matmul shapes, other rounding; the gradients are reduce-scattered over 2 ranks);
- the 2-rank run resumed from its step-2 checkpoint equals the uninterrupted one bit for bit (failure totals, rows
  and final weights included);
- K = 1: the thread producer (episodes, environment calls and the gather on the producer's gloo group, in the
  background thread) equals the inline producer bit for bit (every metric but the clocks, the rows, the final
  weights), trains staleness 0, 1, 1, 1 and generates batch s+1 while step s trains; resumed from its step-2
  checkpoint (its queue: batch 3, episodes and transcripts, the same on both ranks) it equals the uninterrupted run;
- K = 1, the process producer: rank 0's two rollout worker processes run every episode (an environment pool each),
  the batch broadcast to rank 1 with the replicas' failure counts (``root_episodes``); each replica ran one example,
  as each rank did in the thread run, which it equals bit for bit (metrics, rows, final weights; its step-2
  checkpoint's queue digests agreed on both ranks); rank 1 builds no environment pool;
- an agent program through the proxy (``--agent``, 2 steps, failing on the same examples): a proxy per rank serving
  that rank's engine gives the one-process agent runs (rewards, turns, failures, the greedy and sampled evaluation)
  exactly, the losses within fp32 noise;
- K = 1, partial rollouts (thread producer, ``partial_swap_step`` 8): each rank's episode loop takes every update
  after the first mid-episode, the samples span two versions (non-decreasing), the ranks' queues agree.

Apart (a spawn of its own, ``steps_probe``): an agent program through the proxy with the process producer, K = 1,
rank 0's two rollout workers running every agent run (each through a proxy of its own) and the episodes broadcast
to rank 1 with the failure counts (``root_episodes``): both ranks train on the same episodes with the same records
and failure totals, rank 1 starting no proxy. In the same spawn, partial rollouts with the process producer (K = 1,
``partial_swap_step`` 2, one worker on rank 0): an environment run, then an agent program; the episodes reach rank 1
with their per-token versions, every update after the first lands in flight, both ranks train on the same episodes.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
from dist_helpers import held_ports, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "run"))
from _async_runs import raw_config, records, run, without_clocks  # noqa: E402

TOL = 1e-4

FLAKY_DIGITS_ENV = """
from polyrl.agents.env import Environment, EnvStep


class FlakyDigitsEnv(Environment):
    def reset(self, example):
        self.turn, self.flaky = 0, int(float(example["answer"])) % 3 == 0
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, message):
        self.turn += 1
        if self.turn == 2 and self.flaky:
            raise RuntimeError("answers divisible by 3 fail on the second turn")
        text = message.get("content") or ""
        reward = sum(ch.isdigit() for ch in text) / max(len(text), 1)
        return EnvStep([{"role": "user", "content": "Again."}], reward, self.turn >= 3)
"""


def _raw(model_dir, out, env, env_workers=1, **kw):
    import polyrl.agents  # noqa: F401  (registers the [agent] table)

    table = {"prompts_per_step": 2, "samples_per_prompt": 3, "max_new_tokens": 6, "rollouts_to_save": 6}
    table.update(mini_batches=2, eval_prompts=4, eval_n=2, **kw)
    raw = raw_config(model_dir, out, "exact_match", steps=4, save_every=2, **table)
    raw["agent"] = {"env": env, "env_workers": env_workers, "max_turns": 3, "max_episode_tokens": 256}
    raw["engine"]["micro_batch_tokens"] = 512
    raw["train"].update(save_final_model=True, eval_every=2, eval_data="builtin:arithmetic?max=9&n=8")
    return raw


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
    if int(float(example["answer"])) % 3 == 0:
        raise RuntimeError("this agent fails when the answer is divisible by 3")
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)
"""


def _rows(out):
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


def _weights(out: Path):
    from safetensors.torch import load_file

    files = sorted((out / "final").glob("*.safetensors"))
    assert files, out
    return {k: v for f in files for k, v in load_file(f).items()}


def _weights_hash(out: Path) -> str:
    files = sorted((out / "final").glob("*.safetensors"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def _plain(rec):
    return without_clocks(rec, ("weight_sync/",))


# measured by the trainer (fp32 noise between world sizes); everything else of a record is the episodes'
MODEL_SIDE = ("loss", "grad_norm", "mismatch", "entropy", "ratio", "kl", "is_weight", "clip")


def test_two_rank_agentic_runs_equal_one_process_resume_and_run_async(tiny_model_dir, tmp_path):
    env_file = tmp_path / "flaky_digits_env.py"
    env_file.write_text(FLAKY_DIGITS_ENV)
    env = f"{env_file}:FlakyDigitsEnv"
    sync = _raw(tiny_model_dir, tmp_path / "sync", env)
    resumed = _raw(tiny_model_dir, tmp_path / "resumed", env)
    resumed["resume"] = str(tmp_path / "sync" / "checkpoints" / "step-00000002")
    # the environments in each rank's process (env_workers 0; the runs above: a worker process per rank)
    inline = _raw(tiny_model_dir, tmp_path / "inline", env, 0, max_staleness=1)
    thread = _raw(tiny_model_dir, tmp_path / "thread", env, 0, max_staleness=1, async_producer="thread")
    thread_resumed = _raw(tiny_model_dir, tmp_path / "thread_resumed", env, 0, max_staleness=1, async_producer="thread")
    thread_resumed["resume"] = str(tmp_path / "thread" / "checkpoints" / "step-00000002")
    (tmp_path / "my_agent.py").write_text(AGENT_FILE)
    proxy = _raw(tiny_model_dir, tmp_path / "proxy", env, rollouts_to_save=0)
    proxy["agent"] = {"agent": f"{tmp_path / 'my_agent.py'}:agent", "max_turns": 2, "max_episode_tokens": 200}
    proxy["train"]["max_steps"] = 2
    # the process producer: rank 0's two rollout worker processes run every episode (an environment pool in each)
    process = _raw(tiny_model_dir, tmp_path / "process", env, 0, max_staleness=1, async_producer="process",
                   rollout_workers=2)  # fmt: skip
    # partial rollouts, thread producer: each rank's episode loop takes the update at its engine step 8
    partial = _raw(tiny_model_dir, tmp_path / "partial", env, 0, max_staleness=1, async_producer="thread",
                   partial_rollouts=True, partial_swap_step=8)  # fmt: skip
    runs = [{"raw": r} for r in (sync, resumed, inline, thread, thread_resumed, proxy, process, partial)]
    runs[6]["pool_probe"] = True  # the process run: whether each rank built an environment pool
    from dist_async_worker import async_runs_worker

    with held_ports(len(runs)) as ports:  # one process group per run, each on a port held here
        spawn(async_runs_worker, 2, runs, ports)

    # (1) synchronous: 2 ranks run the one-process episodes
    run(_raw(tiny_model_dir, tmp_path / "one", env))
    one, two = records(tmp_path / "one"), records(tmp_path / "sync")
    assert [r["step"] for r in two] == [1, 2, 3, 4] and [r["step"] for r in two if "eval_reward" in r] == [2, 4]
    assert json.loads((tmp_path / "sync" / "summary.json").read_text())["world_size"] == 2
    assert [without_clocks(r, MODEL_SIDE) for r in two] == [without_clocks(r, MODEL_SIDE) for r in one]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "mismatch_mean", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), (b["step"], key)
    assert all(r["loss"] != 0.0 for r in two) and len({r["reward"] for r in two}) > 1  # it trains every step
    # rank 1's environment failures reach rank 0 (which logs and checkpoints the totals) through the gather
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "sync")
    assert len(rows_two) == 4 * 6
    assert 1 in {r["group"] for r in rows_two if r["status"] == "env_error"}  # group g of a step ran on rank g
    assert two[-1]["env_failures_total"] == sum(r["status"] == "env_error" for r in rows_two)
    lp = ("logprobs", "trainer_logprobs")
    for a, b in zip(rows_one, rows_two):
        assert {k: v for k, v in a.items() if k not in lp} == {k: v for k, v in b.items() if k not in lp}
        for key in lp:
            assert (a[key] is None) == (b[key] is None) and len(a[key] or []) == len(b[key] or []), key
            for x, y in zip(a[key] or [], b[key] or []):
                # step 1 (the initial weights): the rows' rounding; later the weights' fp32 noise, grown by lr 5e-2
                tol = 2e-5 if a["step"] == 1 else 2e-3
                assert (x is None) == (y is None) and (x is None or abs(x - y) <= tol), key
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "sync")
    assert w1.keys() == w2.keys()
    for k in w1:
        # 7e-4 at most here: Adam at lr 5e-2 turns fp32 noise in a near-zero gradient into a visible step
        assert float((w1[k].float() - w2[k].float()).abs().max()) <= 5e-3, k

    # (2) resumed from the 2-rank step-2 checkpoint: the uninterrupted run, bit for bit
    res = records(tmp_path / "resumed")
    assert [r["step"] for r in res] == [3, 4]
    assert [_plain(r) for r in res] == [_plain(r) for r in two[2:]]
    assert [r for r in rows_two if r["step"] > 2] == _rows(tmp_path / "resumed")
    assert _weights_hash(tmp_path / "resumed") == _weights_hash(tmp_path / "sync")

    # (3) K = 1 under 2 ranks: the thread producer equals the inline producer bit for bit, staleness <= 1
    inl, th = records(tmp_path / "inline"), records(tmp_path / "thread")
    assert [r["step"] for r in th] == [1, 2, 3, 4]
    assert [_plain(r) for r in th] == [_plain(r) for r in inl]
    assert _rows(tmp_path / "thread") == _rows(tmp_path / "inline")
    assert _weights_hash(tmp_path / "thread") == _weights_hash(tmp_path / "inline")
    assert [r["async/staleness_max"] for r in th] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["async/stale_dropped_total"] == 0.0 and r["loss"] != 0.0 for r in th)
    for r in th[1:]:
        assert r["async/staleness_mean"] == 1.0 and r["async/tokens_lag1"] == r["response_length"] * 6
    for a, b in zip(th, th[1:]):  # batch s+1's episodes ran while step s trained
        assert b["async/gen_start_s"] < a["async/train_end_s"] and b["async/gen_end_s"] > a["async/train_start_s"]
    # batch 1 was generated by version 0 in both the synchronous and the async runs: the same episodes
    assert without_clocks(th[0], MODEL_SIDE + ("async/", "weight_sync/")) == without_clocks(two[0], MODEL_SIDE)

    queue = json.loads((tmp_path / "thread" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    ((queued,),) = [queue["data"]["async"]["queue"]]
    assert (queued["step"], queued["version"]) == (2, 1) and len(queued["extra"]) == len(queued["samples"]) == 6
    again = records(tmp_path / "thread_resumed")
    assert [r["step"] for r in again] == [3, 4] and [_plain(r) for r in again] == [_plain(r) for r in th[2:]]
    assert [r for r in _rows(tmp_path / "thread") if r["step"] > 2] == _rows(tmp_path / "thread_resumed")
    assert _weights_hash(tmp_path / "thread_resumed") == _weights_hash(tmp_path / "thread")

    # (4) the process producer under 2 ranks: rank 0's replicas ran the thread run's episodes (one example each, as
    # each rank did), broadcast to rank 1 with the failure counts of both replicas
    pr = records(tmp_path / "process")
    workers = ("weight_sync/", "rollout_worker", "async/replica")
    assert [without_clocks(r, workers) for r in pr] == [_plain(r) for r in th]  # env failures of both replicas too
    assert all(r["async/rollout_workers_alive"] == 2.0 and r["async/replica_share_max"] == 0.5 for r in pr)
    assert _rows(tmp_path / "process") == _rows(tmp_path / "thread")
    assert _weights_hash(tmp_path / "process") == _weights_hash(tmp_path / "thread")
    # rank 1 only takes the broadcast: no environment pool of its own, a plain dict of failure counts
    kinds = ["crash", "error", "invalid", "lost", "timeout"]
    probes = [json.loads((tmp_path / "process" / f"pool{r}.json").read_text()) for r in (0, 1)]
    assert probes == [{"pool": True, "totals": kinds}, {"pool": False, "totals": kinds}]

    # (5) agent programs through the proxy: a proxy per rank, serving that rank's engine; the agent runs (their
    # segments, rewards, the failures of rank 0's and rank 1's runs) are one process's
    proxy_one = json.loads(json.dumps(proxy))
    proxy_one["out"] = str(tmp_path / "proxy_one")
    run(proxy_one)
    p1, p2 = records(tmp_path / "proxy_one"), records(tmp_path / "proxy")
    assert [r["step"] for r in p2] == [1, 2] and "eval_sampled_reward" in p2[1]
    assert [without_clocks(r, MODEL_SIDE) for r in p2] == [without_clocks(r, MODEL_SIDE) for r in p1]
    assert p2[-1]["env_failures_total"] > 0 and all(r["episode/turns"] == 2.0 for r in p2)
    for a, b in zip(p1, p2):
        assert b["loss"] == pytest.approx(a["loss"], rel=TOL, abs=TOL)

    # (6) partial rollouts under 2 ranks: every update after the first step's lands in the episodes in flight on both
    # ranks (the staging copy all-gathered in the trainer's thread, loaded by each rank's producer at its step 8)
    pa = records(tmp_path / "partial")
    assert [r["async/weight_swaps_total"] for r in pa] == [0.0, 1.0, 2.0, 3.0]
    assert [r["async/staleness_max"] for r in pa] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["async/mixed_version_samples"] > 0 for r in pa[1:]) and all(math.isfinite(r["loss"]) for r in pa)
    state = json.loads((tmp_path / "partial" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    ((queued,),) = [state["data"]["async"]["queue"]]  # written: the ranks' queues (and versions) agreed
    versions = [s["token_versions"] for s in queued["samples"]]
    assert len(versions) == 6 and all(v == sorted(v) and set(v) == {1, 2} for v in versions)


# AGENT_FILE's agent, writing per run the proxy that served it, its process and the example's answer to SEEN
RECORDING_AGENT_FILE = AGENT_FILE.replace("import openai\n", "import os\n\nimport openai\n").replace(
    "    if int(float(example",
    '    with open(SEEN, "a") as f:\n'
    "        f.write(f\"{base_url.split('/agents/')[0]} {os.getpid()} {example['answer']}\\n\")\n"
    "    if int(float(example",
)


def _partial_raw(model_dir, out, agent):
    """K = 1, the process producer's partial rollouts (``partial_swap_step`` 2), one CPU rollout worker on rank 0:
    3 steps of 2 prompts x 2 episodes (every episode's row saved), a checkpoint at step 2."""
    table = {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 6, "rollouts_to_save": 4}
    table.update(max_staleness=1, async_producer="process", rollout_workers=1, partial_rollouts=True,
                 partial_swap_step=2, failure_reward=-1.0)  # fmt: skip
    raw = raw_config(model_dir, out, "exact_match", steps=3, save_every=2, **table)
    raw["agent"] = {**agent, "max_turns": 2, "max_episode_tokens": 200}
    raw["engine"]["micro_batch_tokens"] = 512
    return raw


def _check_partial(out: Path, ranks: list[dict], split: bool) -> None:
    """A process-producer partial run under 2 ranks (``_partial_raw``, ``steps_probe``): rank 0's worker took every
    update after the first step's in flight, and both ranks trained on the same episodes with the same versions.
    ``split``: every episode of batch s switches at completion token 2 (the episode loop's engine step 2; an agent's
    calls start when the program sends them, so there only some segments span two versions)."""
    batches = [[s["batch"] for s in p["steps"]] for p in ranks]
    assert batches[0] == batches[1] and len(set(batches[0])) == 3
    assert [p["local"] for p in ranks] == [[], []] and ranks[0]["failures"] == ranks[1]["failures"]
    own = ("weight_sync/", "rollout_worker", "async/replica")
    per_rank = [[without_clocks(s["record"], own) for s in p["steps"]] for p in ranks]
    assert per_rank[0] == per_rank[1] and all(math.isfinite(r["loss"]) for r in per_rank[1])
    # the per-token versions travelled with the broadcast episodes: batch s (1-based) was submitted at version s - 2
    # and took version s - 1 in flight (K = 1); versions never decrease within an episode
    versions = [[s["versions"] for s in p["steps"]] for p in ranks]
    assert versions[0] == versions[1]
    assert all(v == [0] * len(v) for v in versions[0][0])
    for step, eps in enumerate(versions[0][1:], 2):
        assert all(v == sorted(v) and set(v) <= {step - 2, step - 1} for v in eps)
        assert any(set(v) == {step - 2, step - 1} for v in eps)  # an update landed inside an episode
        if split:
            assert all(v == [step - 2] * 2 + [step - 1] * (len(v) - 2) for v in eps)
    recs = records(out)
    assert [r["async/weight_swaps_total"] for r in recs] == [0.0, 1.0, 2.0]
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert all(r["async/mixed_version_samples"] > 0 for r in recs[1:]) and any(r["loss"] != 0.0 for r in recs)
    assert all(r["async/stale_dropped_total"] == 0.0 and r["async/rollout_workers_alive"] == 1.0 for r in recs)
    # the worker generated with the weights each token's version names: at step s the trainer (version s - 1)
    # recomputes to fp32 noise every turn sampled wholly on version s - 1 (prefilled by those weights: the swap forgets
    # the prefix cache; a turn the update landed in keeps its older KV), and not the older version's tokens
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 4
    fresh, old = [], []
    for r in rows:
        v = versions[0][r["step"] - 1][r["sample"]]
        turn: list[int] = []  # positions of the policy tokens of the current turn
        for j, lp in enumerate([*r["logprobs"], None]):
            if lp is not None:
                turn.append(j)
                continue
            if turn and all(v[i] == r["step"] - 1 for i in turn):
                fresh += [abs(r["logprobs"][i] - r["trainer_logprobs"][i]) for i in turn]
            old += [abs(r["logprobs"][i] - r["trainer_logprobs"][i]) for i in turn if v[i] < r["step"] - 1]
            turn = []
    assert len(fresh) > 4 * 6 and max(fresh) < 1e-3 and max(old) > 1e-2
    # the step-2 checkpoint was written (the ranks' queue digests agreed): batch 3, versions 1 then 2
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    ((queued,),) = [state["data"]["async"]["queue"]]
    assert queued["step"] == 2 and [s["token_versions"] for s in queued["samples"]] == versions[0][2]


def test_two_rank_process_producer_runs_every_agent_in_rank0_workers(tiny_model_dir, tmp_path):
    """An agent program through the proxy with the process producer under 2 ranks (K = 1, 3 steps of 2 prompts x 3
    runs, 2 CPU rollout workers on rank 0, a greedy evaluation at the end): every run, the evaluation's too, is
    served by one of the two workers' proxies (two processes, neither rank's; rank 1 starts no proxy, and rank 0's
    own proxy runs nothing), and the episodes and failure counts are broadcast to rank 1 (``root_episodes``): both
    ranks train on the same episodes at every step (a digest of every field), log the same batch metrics and
    evaluation, and end with the same failure totals, which count every failed run (answers divisible by 3).

    In the same spawn, partial rollouts with the process producer (``_partial_raw``, ``_check_partial``): environment
    episodes (``--env``: rank 0's worker's episode loop takes version s - 1 at its engine step 2 of batch s) and agent
    programs (``--agent``: the worker's proxy driver takes it at its engine step 2), broadcast to rank 1 with their
    per-token versions."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    seen = tmp_path / "seen.txt"
    agent = tmp_path / "my_agent.py"
    agent.write_text(f"SEEN = {str(seen)!r}\n" + RECORDING_AGENT_FILE)
    out = tmp_path / "process"
    table = {"prompts_per_step": 2, "samples_per_prompt": 3, "max_new_tokens": 6, "eval_prompts": 2}
    table.update(max_staleness=1, async_producer="process", rollout_workers=2, rollout_balance="count")
    raw = raw_config(tiny_model_dir, out, "exact_match", steps=3, failure_reward=-1.0, **table)
    raw["agent"] = {"agent": f"{agent}:agent", "max_turns": 2, "max_episode_tokens": 200}
    raw["engine"]["micro_batch_tokens"] = 512
    raw["train"].update(eval_every=3, eval_data="builtin:arithmetic?max=9&n=8")
    env_file = tmp_path / "flaky_digits_env.py"
    env_file.write_text(FLAKY_DIGITS_ENV)
    (tmp_path / "plain_agent.py").write_text(AGENT_FILE)
    partial_env = _partial_raw(tiny_model_dir, tmp_path / "partial_env", {"env": f"{env_file}:FlakyDigitsEnv"})
    partial_env["agent"]["env_workers"] = 0
    partial_agent = _partial_raw(tiny_model_dir, tmp_path / "partial_agent",
                                 {"agent": f"{tmp_path / 'plain_agent.py'}:agent"})  # fmt: skip
    runs = [{"raw": r, "steps_probe": True} for r in (raw, partial_env, partial_agent)]
    from dist_async_worker import async_runs_worker

    with held_ports(len(runs)) as ports:  # one process group per run, each on a port held here
        spawn(async_runs_worker, 2, runs, ports)

    ranks = [json.loads((out / f"steps{r}.json").read_text()) for r in (0, 1)]
    assert [p["proxy"] for p in ranks] == [True, False] and [p["local"] for p in ranks] == [[], []]
    served = [line.split() for line in seen.read_text().splitlines()]
    assert len(served) == 3 * 6 + 2  # the batches' runs, then the greedy evaluation's
    assert len({url for url, _, _ in served}) == 2 and len({pid for _, pid, _ in served}) == 2
    assert not {int(pid) for _, pid, _ in served} & {p["pid"] for p in ranks}
    failed = sum(int(float(answer)) % 3 == 0 for _, _, answer in served)
    assert 0 < failed < len(served)
    # both ranks trained on the same episodes, step by step, and count the same failures
    batches = [[s["batch"] for s in p["steps"]] for p in ranks]
    assert batches[0] == batches[1] and len(set(batches[0])) == 3
    assert ranks[0]["failures"] == ranks[1]["failures"] == {"error": failed}
    # every value of each step's record but the clocks and rank 0's workers' counters: the batch's metrics, the
    # evaluation, the losses and gradient norms
    own = ("weight_sync/", "rollout_worker", "async/replica")
    per_rank = [[without_clocks(s["record"], own) for s in p["steps"]] for p in ranks]
    assert per_rank[0] == per_rank[1] and "eval_reward" in per_rank[1][-1] and "loss" in per_rank[1][-1]
    recs = records(out)
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0] and "eval_reward" in recs[-1]
    assert recs[-1]["env_failures_total"] == sum(int(float(a)) % 3 == 0 for _, _, a in served[:18])
    for r in recs:
        assert r["episode/turns"] == 2.0 and math.isfinite(r["loss"])
        assert r["async/rollout_workers_alive"] == 2.0 and r["async/replica_share_max"] == 0.5

    # partial rollouts with the process producer: environment episodes, then agent programs (rank 1: no proxy)
    for name, split in (("partial_env", True), ("partial_agent", False)):
        ranks = [json.loads((tmp_path / name / f"steps{r}.json").read_text()) for r in (0, 1)]
        _check_partial(tmp_path / name, ranks, split)
    assert [p["proxy"] for p in ranks] == [True, False]
