"""Partial rollouts in rollout worker processes (``polyrl.run.worker_partial``, ``rollout_workers``' ``_Inbox`` and
``_PartialJob``) on the CPU with gloo and the tiny preset.

Two replicas, taken through one launch: an update with ``swap_step`` N > 0 lands at engine step N of each replica's
share whether its notice reaches the replica before its job (the idle worker keeps it) or after (the worker waits
at step N), a replica with an empty share still loads it (the push returns), with ``swap_step`` 0 a busy replica
loads it between two decode steps and an idle one at once; a replica killed while the trainer waits in a deferred
broadcast is dropped (the push returns, the share is the trainer's engine's), restarted, and rejoins with the live
weights and version; a general job (``call``) takes its update at step N through the hook its function gets, an
empty share's replica at its end; a job's hook waited on by two threads (an agent proxy's driver whose window closed,
and the serving loop's ``finish``) loads the update once and releases both; a batch the producer thread picked up as
``close`` began never starts. Then whole runs: the process producer's
partial run (K = 1, N = 2, two replicas) equals the thread producer's record for record (tokens, versions and
rewards exactly, the floats within 1e-5: other batch shapes), its queued samples switch versions at completion token
N, no trained token is older than K, and a resume from its checkpoint equals the uninterrupted run bit for bit."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import threading
import time

import pytest
import torch
from _async_runs import raw_config as _raw
from _async_runs import records as _records
from _async_runs import run as _run
from _async_runs import without_clocks, write_reward

MAX_TOKENS = 6


@pytest.fixture()
def setup(tiny_model_dir):
    from polyrl.infer.config import RolloutConfig
    from polyrl.infer.llm import LLM
    from polyrl.infer.sampling_params import SamplingParams
    from polyrl.models.checkpoint import load_model, load_tokenizer

    # every sequence admitted in the first engine step (16 slots): engine step k then makes completion token k + 1
    cfg = RolloutConfig(num_blocks=512, block_size=4, max_num_seqs=16)
    model = load_model(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu")).eval()
    tok = load_tokenizer(str(tiny_model_dir))
    ids = [[5 + i, 6 + i, 7 + 2 * i] for i in range(4)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=2, seed=100 + i, ignore_eos=True) for i in range(4)
    ]
    return cfg, model, tok, ids, params, lambda m: LLM(m, tok, cfg)


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def _reference(engine, old, new, v, ids, params, swap_at):
    """``ids`` generated on one engine with ``old``'s weights (version ``v``), ``new``'s (``v + 1``) loaded after
    its engine step ``swap_at``: [(tokens, versions, logprobs)] per sequence."""
    with torch.no_grad():
        for a, b in zip(engine.model.parameters(), old.parameters()):
            a.copy_(b)

    def between(llm, steps):
        if steps == swap_at:

            def load():
                for a, b in zip(llm.model.parameters(), new.parameters()):
                    a.copy_(b)

            llm.swap_weights(load, v + 1)

    engine.policy_version = v
    engine.reset_prefix_cache()
    with torch.no_grad():
        outs = engine.generate(ids, params, between_steps=between)
    return _seqs(outs)


def _seqs(outs):
    return [(list(c.token_ids), list(c.token_versions), list(c.logprobs)) for o in outs for c in o.outputs]


def _same(got, want):
    """Tokens and versions exactly; log-probs within 1e-5 (the replicas' batches hold other sequences than the
    reference's one batch, so a matmul may round differently in the last place)."""
    assert [(t, v) for t, v, _ in got] == [(t, v) for t, v, _ in want]
    for (_, _, a), (_, _, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def _in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn(*args)))
    t.start()
    return t, box


def test_replicas_take_an_update_between_their_decode_steps(tiny_model_dir, setup, caplog):
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg, model, tok, ids, params, make = setup
    ref = make(copy.deepcopy(model))
    local = make(copy.deepcopy(model))  # the trainer's engine: a dead replica's share
    workers = RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 2, timeout_s=120, balance="count")
    try:
        workers.push_weights(model, 0)
        assert workers.split(ids, params, [0, 1]) == [[0, 2], [1, 3]]
        # swap_step 3 (a batch submitted at version 0 takes version 1), the notice before the jobs: each idle
        # worker keeps it, the push returning only once both reached their step 3
        old = copy.deepcopy(model)
        _perturb(model, 1)
        want = _reference(ref, old, model, 0, ids, params, swap_at=3)
        assert all(v == [0] * 3 + [1] * (MAX_TOKENS - 3) for _, v, _ in want)
        workers.job_partial = (3, 1)
        push, _ = _in_thread(workers.push_weights, model, 1, True)
        time.sleep(0.3)
        assert push.is_alive()  # waits for the replicas' step 3 of the job that takes it
        _same(_seqs(workers.generate(ids, params, local.generate)), want)
        push.join(30)
        assert not push.is_alive()
        # the same with the jobs first: each replica waits at its step 3 for version 2
        old = copy.deepcopy(model)
        _perturb(model, 2)
        want = _reference(ref, old, model, 1, ids, params, swap_at=3)
        workers.job_partial = (3, 2)
        gen, box = _in_thread(workers.generate, ids, params, local.generate)
        time.sleep(0.3)
        assert gen.is_alive()  # held at step 3
        workers.push_weights(model, 2, defer=True)
        gen.join(30)
        _same(_seqs(box["out"]), want)
        # one prompt: replica 1's share is empty, yet it gets the job and loads version 3 at its end
        old = copy.deepcopy(model)
        _perturb(model, 3)
        want = _reference(ref, old, model, 2, ids[:1], params[:1], swap_at=3)
        workers.job_partial = (3, 3)
        gen, box = _in_thread(workers.generate, ids[:1], params[:1], local.generate)
        workers.push_weights(model, 3, defer=True)
        gen.join(30)
        _same(_seqs(box["out"]), want)
        workers.job_partial = None
        outs = _seqs(workers.generate(ids, params, local.generate))
        assert all(v == [3] * MAX_TOKENS for _, v, _ in outs)  # both replicas hold version 3
        # swap_step 0: a long share, the update pushed while it generates: loaded at a decode-step boundary, each
        # sequence's tokens version 3 then 4 (where depends on timing), the push returning with both loaded
        _perturb(model, 4)
        long = [p.clone(max_tokens=200) for p in params]
        workers.job_partial = (0, None)
        gen, box = _in_thread(workers.generate, ids, long, local.generate)
        time.sleep(0.2)
        workers.push_weights(model, 4)
        gen.join(60)
        for _, v, _ in _seqs(box["out"]):
            assert v == sorted(v) and set(v) <= {3, 4} and len(v) == 200
        workers.job_partial = None
        assert all(v == [4] * MAX_TOKENS for _, v, _ in _seqs(workers.generate(ids, params, local.generate)))
        # a replica killed while the trainer waits in a deferred broadcast: that sync fails at once (its peer's
        # connection closed), the push returns with replica 1 synced at its step 3; replica 0's share is the
        # trainer's engine's (version 4, no swap inside it); the replica restarts and rejoins with version 6
        old = copy.deepcopy(model)
        _perturb(model, 5)
        with torch.no_grad():
            for a, b in zip(local.model.parameters(), old.parameters()):
                a.copy_(b)
        local.policy_version = 4
        want = _reference(ref, old, model, 4, ids, params, swap_at=3)
        caplog.set_level(logging.WARNING, logger="polyrl.run.rollout_workers")
        workers.job_partial = (3, 5)
        push, _ = _in_thread(workers.push_weights, model, 5, True)
        time.sleep(0.3)
        os.kill(workers.procs[0].pid, signal.SIGKILL)
        workers.procs[0].join()
        got = _seqs(workers.generate(ids, params, local.generate))
        push.join(30)
        assert not push.is_alive() and workers.failures == 1 and workers.restarts == 1
        assert "rollout replica 0 (cpu) died" in caplog.text
        for k, (g, w) in enumerate(zip(got, want)):
            if k // 2 in (1, 3):  # replica 1's share: took version 5 at its step 3
                _same([g], [w])
            else:  # the trainer's engine, version 4 throughout
                assert g[1] == [4] * MAX_TOKENS
        assert workers.wait_for_restarts(60)
        _perturb(model, 6)
        workers.job_partial = None
        workers.push_weights(model, 6)
        assert workers.num_alive == 2
        assert all(v == [6] * MAX_TOKENS for _, v, _ in _seqs(workers.generate(ids, params, local.generate)))
        # a general job (call: an agentic run's episode loop) carries the same (swap_step, takes): its function steps
        # the engine with the hook it gets (ctx.between_steps), so its share takes version 7 at its step 3; one item:
        # replica 1's share is empty, yet it gets the job (running no function) and loads version 7 at its end
        old = copy.deepcopy(model)
        _perturb(model, 7)
        want = _reference(ref, old, model, 6, ids[:1], params[:1], swap_at=3)
        workers.job_partial = (3, 7)
        gen, box = _in_thread(workers.call, _generate_in_worker, [(ids[0], params[0])], [1.0], None)
        time.sleep(0.3)
        assert gen.is_alive()  # held at step 3
        workers.push_weights(model, 7, defer=True)
        gen.join(30)
        (got,) = box["out"]
        _same(got, want)
        workers.job_partial = None
        assert all(v == [7] * MAX_TOKENS for _, v, _ in _seqs(workers.generate(ids, params, local.generate)))
    finally:
        workers.close()


def _generate_in_worker(ctx, items):
    """A ``call`` job's function (in the worker): each item's sequences, the engine stepped with the job's hook."""
    outs = ctx.llm.generate([i for i, _ in items], [p for _, p in items], between_steps=ctx.between_steps)
    return [_seqs([o]) for o in outs], None


@pytest.fixture()
def reward(tmp_path):
    return write_reward(tmp_path)


def _plain(rec):
    """A record without clocks and without what only the process producer reports (its replicas, its sync's
    bytes: two replicas receive the weights)."""
    drop = ("weight_sync/", "rollout_worker", "replica")
    return without_clocks(rec, drop)


def test_a_partial_run_in_worker_processes_equals_the_thread_producers(tiny_model_dir, tmp_path, reward):
    common = dict(steps=4, save_every=2, max_staleness=1, partial_rollouts=True, partial_swap_step=2)
    _run(_raw(tiny_model_dir, tmp_path / "thread", reward, async_producer="thread", **common))
    proc = tmp_path / "proc"
    raw = _raw(tiny_model_dir, proc, reward, async_producer="process", rollout_workers=2, rollout_balance="count",
               **common)  # fmt: skip
    _run(raw)
    thread, recs = _records(tmp_path / "thread"), _records(proc)
    # each replica's share of batch s (submitted at version s - 1) took version s at its engine step 2: the same
    # tokens and versions as the thread producer's whole batch, so the same rewards, token counts and losses. The
    # floats within 1e-5: a replica's engine batches 8 sequences where the thread's batches 16, and a matmul of
    # another shape may round differently in the last place (on this CPU they came out bit-equal)
    assert [_plain(r).keys() for r in recs] == [_plain(r).keys() for r in thread]
    for r, t in zip(recs, thread):
        assert _plain(r) == pytest.approx(_plain(t), rel=1e-5, abs=1e-5)
        assert r["reward"] == t["reward"] and r["async/tokens_lag0"] == t["async/tokens_lag0"]
    assert recs[0]["async/staleness_max"] == 0.0
    for r in recs[1:]:  # never a token older than K = 1; both lags in every later batch
        assert r["async/staleness_max"] == 1.0 and r["async/mixed_version_samples"] > 0
        assert r["async/tokens_lag0"] > 0 and r["async/tokens_lag1"] > 0 and r["async/stale_dropped_total"] == 0
    assert recs[-1]["async/weight_swaps_total"] == 3.0 and recs[-1]["async/rollout_workers_alive"] == 2.0
    ckpt = proc / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())["data"]["async"]
    samples = state["queue"][0]["samples"]
    assert state["version"] == 2 and state["queue"][0]["step"] == 2 and len(samples) == 16
    for s in samples:  # batch 2: version 1 for its first 2 completion tokens, version 2 after
        v = s["token_versions"]
        assert len(v) == len(s["completion_ids"]) == len(s["logprobs"]) and v == ([1, 1] + [2] * 2)[: len(v)]
    t_state = json.loads((tmp_path / "thread" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    t_samples = t_state["data"]["async"]["queue"][0]["samples"]
    assert [(s["completion_ids"], s["token_versions"]) for s in samples] == [
        (s["completion_ids"], s["token_versions"]) for s in t_samples
    ]
    for s, t in zip(samples, t_samples):  # each token's behaviour log-prob: its own version's, as the thread's
        torch.testing.assert_close(torch.tensor(s["logprobs"]), torch.tensor(t["logprobs"]), atol=1e-5, rtol=0)
    # exact resume: the queued batch carries its versions; the resumed run (the same shares, so the same shapes)
    # equals the uninterrupted one bit for bit
    resumed = tmp_path / "resumed"
    raw2 = json.loads(json.dumps(raw))
    raw2["out"], raw2["resume"] = str(resumed), str(ckpt)
    assert _run(raw2)["resumed_from_step"] == 2
    a, b = recs[2:], _records(resumed)
    assert [r["step"] for r in b] == [3, 4]
    assert [_plain(r) for r in a] == [_plain(r) for r in b]


# the trainer's end of a replica's control pair, in a process of its own: connects, sends a WEIGHTS notice
# (version 1, deferred) when the store says "send", then EXIT
TRAINER_END = """
import datetime, pickle, sys
import torch
import torch.distributed as dist
from polyrl.run.rollout_worker_process import EXIT, TAG_DATA, TAG_HDR, WEIGHTS, control_group

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=60))
pg = control_group(store, "0.0", 0, 60)
store.wait(["send"])
payload = torch.frombuffer(bytearray(pickle.dumps((1, True))), dtype=torch.uint8)
pg.send([torch.tensor([WEIGHTS, payload.numel()], dtype=torch.int64)], 1, TAG_HDR).wait()
pg.send([payload], 1, TAG_DATA).wait()
store.wait(["exit"])
pg.send([torch.tensor([EXIT, 0], dtype=torch.int64)], 1, TAG_HDR).wait()
"""


def test_a_job_hook_waited_on_by_two_threads_loads_its_update_once(setup):
    """A job's hook as an agent proxy's engine driver calls it (``polyrl.agents.remote``): a driver thread whose window
    closed while it waited at step N for the batch's update, and the serving loop's ``finish`` for the same job, both
    waiting; the notice arrives on a real control pair (gloo, the trainer's end in a process of its own): the update
    is loaded once, by the waiting driver, ``finish`` then owes nothing, and both return (without the job's lock one
    of them waits for a second notice that never comes)."""
    import datetime
    import subprocess
    import sys
    from pathlib import Path

    import torch.distributed as dist

    import polyrl
    from polyrl.run.rollout_worker_process import _Inbox, _PartialJob, control_group

    llm = setup[-1](setup[1])
    llm.policy_version = 0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    root = str(Path(polyrl.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_END, str(store.port)], env=env)
    try:
        inbox = _Inbox(control_group(store, "0.0", 1, 60))

        class Loads:  # stands for the weights broadcast: counts the loads
            n = 0

            def sync(self):
                self.n += 1

        loads = Loads()
        job = _PartialJob(inbox, llm, loads, 3, 1)  # takes version 1 at engine step 3
        driver, _ = _in_thread(job, llm, 3)
        time.sleep(0.2)
        finish, _ = _in_thread(job.finish)
        time.sleep(0.2)
        assert driver.is_alive() and finish.is_alive() and loads.n == 0  # both wait for the update
        store.set("send", "1")
        driver.join(60)  # the join timeouts bound a hang only
        finish.join(60)
        assert not driver.is_alive() and not finish.is_alive()
        assert loads.n == 1 and llm.policy_version == 1 and inbox.notice is None
        store.set("exit", "1")
        assert trainer.wait(30) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()


def test_a_batch_picked_up_as_close_begins_never_starts(setup):
    """``close`` while the producer thread has picked up the next batch but not entered it yet (between two batches
    of a run that fails with K >= 2 batches queued): ``close`` reads "not busy", so it stops no workers, and the
    batch must not start then (its jobs would wait at their step N for an update that nobody publishes any more,
    and ``close``, which waits for the producer thread, with them). The pick-up is held at a gate here so that
    ``close`` runs inside that window; the batch's ``produce`` is never called and ``close`` returns."""
    from polyrl.run.async_rollout import RolloutBatch
    from polyrl.run.worker_partial import WorkerPartialRollouts

    llm = setup[-1](setup[1])
    produced = []

    def produce(step, version):
        produced.append(step)
        return RolloutBatch(step, version, [], [], {}, 0)

    src = WorkerPartialRollouts(produce, 2, lambda: None, None, None, llm, 0, swap_step=2)
    picked, gate, run = threading.Event(), threading.Event(), src._run

    def held(*args):
        picked.set()
        gate.wait(120)  # longer than the wait for close below: only the test opens it
        return run(*args)

    src._run = held
    src.submit(1)
    assert picked.wait(60)  # the producer thread holds the batch (its future running), not inside it yet
    closer, _ = _in_thread(src.close)
    deadline = time.monotonic() + 60  # until close has decided (under the producer's lock); bounds a hang only
    while not getattr(src, "_closing", False) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert src._closing  # close began inside the window this test is about
    gate.set()
    closer.join(60)
    assert not closer.is_alive()
    assert produced == []
