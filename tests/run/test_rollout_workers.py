"""Rollout worker processes (``polyrl.run.rollout_workers``) on the CPU with gloo and the tiny preset: a worker killed
mid-run (between calls, or while it generates its share) is covered by the trainer's engine in that call (every
output equal to the no-failure outputs, seeds per prompt), restarted on its device, and rejoins at the next weight
push with the trainer's current weights (its outputs then equal a reference engine's on those weights, not the model
folder's); past ``max_restarts`` it is dropped for good; a worker that cannot start is an error naming it; the
restart option reaches the config and the CLI. A replica that hangs (SIGSTOP: alive, never answering) is found by the
reply deadline (``reply_timeout_s``), killed, covered by the trainer's engine in that call, and restarted; one
that hangs during a weight push is found by the same deadline on the broadcast's buckets, the other replica synced
in that push; the deadline option reaches the config and the CLI. Load balancing: a replica made slow (the
test-only per-prompt delay) gets a smaller share once its speed is measured, the outputs still those of one
engine; a dead replica's speed is forgotten; the balance option reaches the config and the CLI."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import pytest
import torch

from polyrl.errors import ConfigError

N_PROMPTS = 6


@pytest.fixture()
def setup(tiny_model_dir):
    """The trainer's side: its model (perturbed later, as training would), a reference engine on it (the
    ``local`` fallback and the expected outputs), the prompts and their per-prompt seeded sampling."""
    from polyrl.infer.config import RolloutConfig
    from polyrl.infer.llm import LLM
    from polyrl.infer.sampling_params import SamplingParams
    from polyrl.models.checkpoint import load_model, load_tokenizer

    cfg = RolloutConfig(num_blocks=512, block_size=4, max_num_seqs=8)
    model = load_model(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu")).eval()
    llm = LLM(model, load_tokenizer(str(tiny_model_dir)), cfg)
    ids = [[5 + i, 6 + i, 7 + 2 * i] for i in range(N_PROMPTS)]
    params = [SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=100 + i) for i in range(N_PROMPTS)]
    return cfg, model, llm, ids, params


def _tokens(outs):
    return [[(c.index, list(c.token_ids)) for c in o.outputs] for o in outs]


def _expected(llm, ids, params):
    llm.reset_prefix_cache()
    with torch.no_grad():
        return _tokens(llm.generate(ids, params))


def _perturb(model, seed):
    """A training step's worth of change: every floating weight moves, so the outputs change."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def _kill(workers, w):
    os.kill(workers.procs[w].pid, signal.SIGKILL)
    workers.procs[w].join()


def test_a_killed_replica_is_restarted_with_the_current_weights(tiny_model_dir, setup, caplog):
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg, model, llm, ids, params = setup
    # balance "count": the shares by index (prompt i to replica i mod 2), whatever the replies' timings
    workers = RolloutWorkers(
        str(tiny_model_dir), str(tiny_model_dir), cfg, 2, timeout_s=120, max_restarts=2, balance="count"
    )
    local_calls = []

    def local(i, p, **kw):
        local_calls.append(len(i))
        return llm.generate(i, p, **kw)

    try:
        _perturb(model, 1)  # version 1: the folder's weights are no longer the policy
        workers.push_weights(model)
        v1 = _expected(llm, ids, params)
        assert _tokens(workers.generate(ids, params, local)) == v1 and local_calls == []
        _kill(workers, 1)
        caplog.set_level(logging.WARNING, logger="polyrl.run.rollout_workers")
        # the call in which replica 1 is found dead: its share (prompts 1, 3, 5) comes from the trainer's engine
        assert _tokens(workers.generate(ids, params, local)) == v1 and local_calls == [N_PROMPTS // 2]
        assert (workers.failures, workers.restarts, workers.num_alive) == (1, 1, 1)
        assert "rollout replica 1 (cpu) died" in caplog.text and "restarting it (restart 1 of 2)" in caplog.text
        # until it rejoins (it loads the folder meanwhile) the trainer's engine keeps covering it
        _perturb(model, 2)  # version 2, pushed after the restart: the new replica must get these weights
        v2 = _expected(llm, ids, params)
        assert v2 != v1
        assert workers.wait_for_restarts(60)
        assert workers.num_alive == 1  # ready, not yet connected: it joins at the next push
        stats = workers.push_weights(model)
        assert workers.num_alive == 2 and workers.restarts == 1 and workers.failures == 1
        assert "rollout replica 1 (cpu) is back (restart 1 of 2)" in caplog.text
        assert stats.bytes == 2 * workers._syncs[0].nbytes  # both replicas synced
        local_calls.clear()
        # both replicas generate with version 2: the restarted one took the pushed weights, not the folder's
        assert _tokens(workers.generate(ids, params, local)) == v2 and local_calls == []
        # its own share alone (prompts 1, 3, 5 of the split), to be sure the restarted replica produced them
        odd = [1, 3, 5]
        assert workers.ctl[1] is not None and workers.procs[1].is_alive()
        workers.alive[0] = False  # every prompt to replica 1 (replica 0 set aside for this call)
        try:
            got = _tokens(workers.generate([ids[i] for i in odd], [params[i] for i in odd], local))
        finally:
            workers.alive[0] = True
        assert got == [v2[i] for i in odd] and local_calls == []
        # a general job (``call``, as an agentic run's episodes): items split as prompts (i mod 2), results in item
        # order, the state kept across a replica's jobs; a job raising in a replica raises here, and the pairs stay
        # in step (the next call's replies are its own)
        metas = []
        out = workers.call(_double, list(range(5)), [1.0] * 5, lambda missing: [None] * len(missing), ("a",),
                           metas.append)  # fmt: skip
        assert out == [(i % 2, 2 * i, "a", 1) for i in range(5)]
        assert sorted(metas) == [(0, 3), (1, 2)] and workers.last_share == {0: 0.6, 1: 0.4}
        with pytest.raises(ValueError, match="item 1 is odd") as err:
            workers.call(_fail_on_odd, list(range(5)), [1.0] * 5, lambda missing: [None] * len(missing))
        assert "_fail_on_odd raised in rollout replica 1" in str(err.value.__cause__)
        again = workers.call(_double, [7, 8], [1.0, 1.0], lambda missing: [None] * len(missing), ("b",))
        assert again == [(0, 14, "b", 2), (1, 16, "b", 2)]
        assert workers.num_alive == 2 and workers.failures == 1
    finally:
        workers.close()
    assert not any(p.is_alive() for p in workers.procs)


def _double(ctx, items, tag):
    """A ``RolloutWorkers.call`` job: (replica, 2 x item, tag, how many jobs this replica ran) per item."""
    ctx.state["jobs"] = ctx.state.get("jobs", 0) + 1
    return [(ctx.replica, 2 * x, tag, ctx.state["jobs"]) for x in items], (ctx.replica, len(items))


def _fail_on_odd(ctx, items):
    for x in items:
        if x % 2:
            raise ValueError(f"item {x} is odd")
    return list(items), None


def test_a_replica_killed_while_it_generates(tiny_model_dir, setup, caplog):
    """The connection fails in the middle of the call (the worker dies while it generates its share, after the
    job was sent): the call still returns every output, and the replica is restarted. The default balance
    ("work"): the two replicas, unmeasured, get equal estimated work, one long prompt and more besides each."""
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg, model, llm, ids, params = setup
    # the odd prompts are long: replica 1 is still generating its long one when killed, right after the jobs went
    params = [p.clone(max_tokens=100 if i % 2 else 1, ignore_eos=True) for i, p in enumerate(params)]
    workers = RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 2, timeout_s=120)
    try:
        workers.push_weights(model)
        want = _expected(llm, ids, params)
        assert workers.split(ids, params, [0, 1]) == [[1, 5], [0, 2, 3, 4]]
        post = workers._post_reply

        def kill_before_replica_1_replies(w):
            if w == 1:
                _kill(workers, 1)
            return post(w)

        workers._post_reply = kill_before_replica_1_replies
        caplog.set_level(logging.WARNING, logger="polyrl.run.rollout_workers")
        assert _tokens(workers.generate(ids, params, llm.generate)) == want
        assert (workers.failures, workers.restarts, workers.num_alive, workers.starting) == (1, 1, 1, {1})
        assert "rollout replica 1 (cpu) died (its connection failed)" in caplog.text  # found by the failed receive
        assert workers.speeds.measured[1] is None and workers.speeds.measured[0] is not None  # forgotten
        workers._post_reply = post
        assert workers.wait_for_restarts(60)
        workers.push_weights(model)
        assert workers.num_alive == 2
        assert _tokens(workers.generate(ids, params, llm.generate)) == want
    finally:
        workers.close()


def test_a_hung_replica_misses_the_reply_deadline_and_is_restarted(tiny_model_dir, setup, caplog):
    """Replica 0 is stopped (SIGSTOP: its process is alive, its connection open, it never answers): the call waits
    for its reply about ``reply_timeout_s``, not the groups' 120 s, then kills it, has the trainer's engine generate
    its share, and restarts it; after it rejoins it serves the next call. Replica 0's reply is waited for first, so
    the deadline has passed when replica 1's is looked at: replica 1 answered in time and must not be dropped. The
    healthy calls run under a generous deadline (a loaded CI machine may take seconds for a first call); the short
    one is set for the hung call only."""
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg, model, llm, ids, params = setup
    deadline_s, healthy_s = 4.0, 90.0
    workers = RolloutWorkers(
        str(tiny_model_dir), str(tiny_model_dir), cfg, 2, timeout_s=120, max_restarts=1, reply_timeout_s=healthy_s,
        balance="count",
    )  # fmt: skip
    local_calls = []

    def local(i, p, **kw):
        local_calls.append(len(i))
        return llm.generate(i, p, **kw)

    try:
        _perturb(model, 4)
        workers.push_weights(model)
        want = _expected(llm, ids, params)
        assert _tokens(workers.generate(ids, params, local)) == want and local_calls == []  # healthy: in time
        hung = workers.procs[0]
        os.kill(hung.pid, signal.SIGSTOP)
        caplog.set_level(logging.WARNING, logger="polyrl.run.rollout_workers")
        workers.reply_timeout_s = deadline_s
        t0 = time.monotonic()
        got = _tokens(workers.generate(ids, params, local))
        took = time.monotonic() - t0
        workers.reply_timeout_s = healthy_s
        assert got == want and local_calls == [N_PROMPTS // 2]  # its share (prompts 0, 2, 4) by the trainer's engine
        assert deadline_s - 0.1 <= took < deadline_s + 15, took  # the deadline, plus killing it and the local share
        assert (workers.failures, workers.restarts, workers.num_alive, workers.starting) == (1, 1, 1, {0})
        assert (
            workers.alive[1] and not hung.is_alive() and workers.procs[0] is not hung
        )  # the stopped process killed, a new one spawned
        assert "did not answer within reply_timeout_s = 4 s (hung)" in caplog.text
        assert "restarting it (restart 1 of 1)" in caplog.text
        assert workers.wait_for_restarts(60)
        workers.push_weights(model)
        assert workers.num_alive == 2
        local_calls.clear()
        assert _tokens(workers.generate(ids, params, local)) == want and local_calls == []  # the new one serves
        assert workers.failures == 1
    finally:
        workers.close()


def test_a_replica_that_hangs_during_a_weight_push_is_dropped_at_the_deadline(tiny_model_dir, setup, caplog):
    """Replica 0 is stopped (SIGSTOP) right after it was sent the WEIGHTS header. gloo sends a bucket only once the
    receiver has posted its receive, and a receiver posts at most two before it needs data (two bucket buffers), so
    the push's broadcast to it stops at bucket 1, 2 or 3 of the tiny model's 9 (buckets of 0.05 MiB):
    ``push_weights`` returns after about ``reply_timeout_s``, not the groups' 120 s, with replica 1 synced; replica 0
    is counted, killed and restarted, and the next push gives it the current weights."""
    from polyrl.run.rollout_worker_process import TAG_HDR, WEIGHTS
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg, model, llm, ids, params = setup
    deadline_s, healthy_s = 4.0, 90.0
    workers = RolloutWorkers(
        str(tiny_model_dir), str(tiny_model_dir), cfg, 2, timeout_s=120, max_restarts=1, reply_timeout_s=healthy_s,
        bucket_mb=0.05,
    )  # fmt: skip
    local_calls = []

    def local(i, p, **kw):
        local_calls.append(len(i))
        return llm.generate(i, p, **kw)

    def only(w):
        """Every prompt to replica ``w`` (the other set aside for this call): its outputs alone."""
        other = 1 - w
        was, workers.alive[other] = workers.alive[other], False
        try:
            return _tokens(workers.generate(ids, params, local))
        finally:
            workers.alive[other] = was

    try:
        _perturb(model, 5)
        workers.push_weights(model)
        assert len(workers._syncs[0].buckets) == 9
        v1 = _expected(llm, ids, params)
        assert _tokens(workers.generate(ids, params, local)) == v1 and local_calls == []
        _perturb(model, 6)  # version 2: what the hung push carries
        v2 = _expected(llm, ids, params)
        assert v2 != v1
        hung, send = workers.procs[0], workers._send

        def stop_after_the_weights_header(t, w, tag):
            ok = send(t, w, tag)
            if ok and w == 0 and tag == TAG_HDR and int(t[0]) == WEIGHTS:
                os.kill(hung.pid, signal.SIGSTOP)
            return ok

        workers._send = stop_after_the_weights_header
        caplog.set_level(logging.WARNING, logger="polyrl.run.rollout_workers")
        workers.reply_timeout_s = deadline_s
        t0 = time.monotonic()
        stats = workers.push_weights(model)
        took = time.monotonic() - t0
        workers._send, workers.reply_timeout_s = send, healthy_s
        assert deadline_s - 0.1 <= took < deadline_s + 10, took  # the deadline, plus killing the stopped process
        assert (workers.failures, workers.restarts, workers.num_alive, workers.starting) == (1, 1, 1, {0})
        assert not hung.is_alive() and workers.procs[0] is not hung and workers.alive[1]
        assert re.search(
            r"rollout replica 0 \(cpu\) died \(its weight sync stalled: bucket [123] of 9 \(\d+ bytes\) did not "
            r"complete within reply_timeout_s = 4 s \(hung\)\); restarting it \(restart 1 of 1\)",
            caplog.text,
        ), caplog.text
        assert len(workers._retired[-1][2].abandoned) == 1  # the stuck sync, its timed-out broadcast kept with it
        assert stats.bytes == workers._syncs[1].nbytes  # replica 1 alone synced
        # replica 1 took version 2 in that push: every prompt to it, none to the trainer's engine
        assert only(1) == v2 and local_calls == []
        assert workers.wait_for_restarts(60)
        workers.push_weights(model)
        assert workers.num_alive == 2 and workers.failures == 1
        assert "rollout replica 0 (cpu) is back (restart 1 of 1)" in caplog.text
        assert _tokens(workers.generate(ids, params, local)) == v2 and local_calls == []
        assert only(0) == v2 and local_calls == []  # the restarted replica has the current weights, not the folder's
    finally:
        workers.close()


def test_past_max_restarts_a_replica_is_dropped_for_good(tiny_model_dir, setup, caplog):
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg, model, llm, ids, params = setup
    workers = RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 1, timeout_s=120, max_restarts=1)
    try:
        _perturb(model, 3)
        workers.push_weights(model)
        want = _expected(llm, ids, params)
        caplog.set_level(logging.WARNING, logger="polyrl.run.rollout_workers")
        _kill(workers, 0)
        workers.check()  # found dead between steps: restarted (1 of 1)
        assert (workers.failures, workers.restarts) == (1, 1) and workers.starting == {0}
        assert workers.wait_for_restarts(60)
        workers.push_weights(model)
        assert workers.num_alive == 1
        assert _tokens(workers.generate(ids, params, llm.generate)) == want
        _kill(workers, 0)
        # the second death: no restart left; this call and every later one run on the trainer's engine
        assert _tokens(workers.generate(ids, params, llm.generate)) == want
        assert (workers.failures, workers.restarts, workers.num_alive) == (2, 1, 0) and not workers.starting
        assert "after 1 restarts (max_restarts 1): dropped for good" in caplog.text
        assert workers.wait_for_restarts(1)
        workers.push_weights(model)
        assert workers.num_alive == 0 and workers.restarts == 1
        assert _tokens(workers.generate(ids, params, llm.generate)) == want
    finally:
        workers.close()


def test_max_restarts_zero_drops_at_once_and_bad_values_are_refused(tiny_model_dir, setup):
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg, model, llm, ids, params = setup
    with pytest.raises(ConfigError, match="max_restarts must be an integer >= 0"):
        RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 1, max_restarts=-1)
    for bad in (0, -2.5, True, "10"):
        with pytest.raises(ConfigError, match="reply_timeout_s must be a number of seconds > 0"):
            RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 1, reply_timeout_s=bad)
    with pytest.raises(ConfigError, match='balance must be "work" or "count"'):
        RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 1, balance="speed")
    workers = RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 1, timeout_s=120, max_restarts=0)
    try:
        _kill(workers, 0)
        workers.push_weights(model)
        assert (workers.failures, workers.restarts, workers.num_alive, workers.starting) == (1, 0, 0, set())
        assert _tokens(workers.generate(ids, params, llm.generate)) == _expected(llm, ids, params)
    finally:
        workers.close()


def test_a_worker_that_cannot_start_is_a_clear_error(tmp_path, setup):
    from polyrl.run.rollout_workers import RolloutWorkers

    cfg = setup[0]
    with pytest.raises(RuntimeError, match=r"rollout worker 0 \(cpu\) exited with code 1 while loading"):
        RolloutWorkers(str(tmp_path / "missing"), str(tmp_path / "missing"), cfg, 1, timeout_s=60)


def test_restart_and_timeout_options_in_the_config_and_the_cli():
    import argparse

    from polyrl.algorithms.grpo import GRPOConfig
    from polyrl.cli import train

    assert GRPOConfig().rollout_worker_restarts == 3
    assert GRPOConfig(rollout_worker_restarts=0).rollout_worker_restarts == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="rollout_worker_restarts must be an integer >= 0"):
            GRPOConfig(rollout_worker_restarts=bad)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert parser.parse_args(["--rollout-worker-restarts", "5"]).rollout_worker_restarts == 5
    assert train.RL_FLAG_KEYS["rollout_worker_restarts"] == "rollout_worker_restarts"
    assert GRPOConfig().rollout_worker_timeout_s is None
    assert GRPOConfig(rollout_worker_timeout_s=30).rollout_worker_timeout_s == 30
    assert GRPOConfig(rollout_worker_timeout_s=0.5).rollout_worker_timeout_s == 0.5
    for bad in (0, -1.0, True, "30"):
        with pytest.raises(ConfigError, match=r"rollout_worker_timeout_s must be a number of seconds > 0"):
            GRPOConfig(rollout_worker_timeout_s=bad)
    args = parser.parse_args(["--algo", "grpo", "--rollout-worker-timeout", "90"])
    assert args.rollout_worker_timeout == 90.0 and parser.parse_args([]).rollout_worker_timeout is None
    assert train.RL_FLAG_KEYS["rollout_worker_timeout"] == "rollout_worker_timeout_s"
    assert dict(train.overrides_from_args(args))["grpo.rollout_worker_timeout_s"] == 90.0


def test_a_slow_replica_gets_a_smaller_share(tiny_model_dir, setup, monkeypatch):
    """Replica 1 sleeps 0.8 s per prompt before replying (``SLOW_REPLICA_ENV``): the first call splits evenly (no
    speed measured yet), its replies measure replica 1 well below replica 0, and the next call gives replica 1 less
    than half the work, by ``split_by_work`` on the measured speeds; every call's outputs equal one engine's (seeds
    per prompt). Killed, replica 1's speed is forgotten (it counts at the others' mean when it is back)."""
    from polyrl.run.replica_balance import prompt_cost, split_by_work
    from polyrl.run.rollout_workers import SLOW_REPLICA_ENV, RolloutWorkers

    cfg, model, llm, ids, params = setup
    monkeypatch.setenv(SLOW_REPLICA_ENV, "1:0.8")
    workers = RolloutWorkers(str(tiny_model_dir), str(tiny_model_dir), cfg, 2, timeout_s=120)
    local_calls = []

    def local(i, p, **kw):
        local_calls.append(len(i))
        return llm.generate(i, p, **kw)

    try:
        workers.push_weights(model)
        want = _expected(llm, ids, params)
        assert workers.split(ids, params, [0, 1]) == [[0, 2, 4], [1, 3, 5]]  # equal speeds: i mod 2
        assert _tokens(workers.generate(ids, params, local)) == want and local_calls == []
        assert workers.last_share == {0: pytest.approx(0.5), 1: pytest.approx(0.5)}
        fast, slow = workers.speeds.measured
        assert slow < fast / 2, (fast, slow)  # replica 1 took >= 2.4 s for its 3 prompts
        shares = workers.split(ids, params, [0, 1])
        assert shares == split_by_work([prompt_cost(len(i), p) for i, p in zip(ids, params)], [fast, slow])
        assert len(shares[1]) < N_PROMPTS // 2 and sorted(shares[0] + shares[1]) == list(range(N_PROMPTS))
        assert _tokens(workers.generate(ids, params, local)) == want and local_calls == []
        assert workers.last_share[1] == pytest.approx(len(shares[1]) / N_PROMPTS)
        m = workers.balance_metrics()
        assert m["async/replica_share_max"] == pytest.approx(len(shares[0]) / N_PROMPTS) and len(shares[0]) > 3
        assert m["async/replica0_work_per_s"] > m["async/replica1_work_per_s"] > 0
        _kill(workers, 1)
        workers.check()  # found dead: restarted, its speed forgotten (the others' mean until it replies again)
        assert workers.speeds.measured[1] is None and workers.starting == {1}
        assert workers.speeds.effective([0, 1]) == [workers.speeds.measured[0]] * 2
    finally:
        workers.close()


def test_balance_option_in_the_config_and_the_cli():
    import argparse

    from polyrl.algorithms.grpo import GRPOConfig
    from polyrl.cli import train

    assert GRPOConfig().rollout_balance == "work" and GRPOConfig(rollout_balance="count").rollout_balance == "count"
    with pytest.raises(ConfigError, match='rollout_balance must be "work" or "count"'):
        GRPOConfig(rollout_balance="speed")
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--algo", "grpo", "--rollout-balance", "count"])
    assert dict(train.overrides_from_args(args))["grpo.rollout_balance"] == "count"
    assert parser.parse_args([]).rollout_balance is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--rollout-balance", "speed"])


def test_a_timed_reply_wait_never_ends_before_its_deadline_and_says_it_timed_out():
    """gloo takes a wait's timeout in whole milliseconds and truncates it, so a wait for the time left (12.3 ms) ended
    up to a millisecond before the deadline, and a hung replica read as one whose connection failed (CI saw it). The
    wait is rounded up to whole ms, and gloo's timeout is told from a lost peer by its message; here on a real gloo
    pair (two ranks in threads): a receive nobody sends times out at or after the deadline with a "timed out" error,
    and one whose peer's group is torn down fails with another."""
    import datetime
    import threading

    import torch.distributed as dist

    from polyrl.run.rollout_workers import _timed_out, _whole_ms_until

    now = time.monotonic()
    assert _whole_ms_until(now + 0.0123) >= datetime.timedelta(milliseconds=13)
    assert _whole_ms_until(now - 1.0) == datetime.timedelta(milliseconds=1)  # passed: the shortest wait, not none

    def pair() -> dict[int, dist.ProcessGroupGloo]:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        groups: dict[int, dist.ProcessGroupGloo] = {}

        def join(rank: int) -> None:
            groups[rank] = dist.ProcessGroupGloo(
                dist.TCPStore("127.0.0.1", store.port, 2, False), rank, 2, datetime.timedelta(seconds=30)
            )

        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(groups) == [0, 1]
        return groups

    buf = torch.empty(4)
    groups = pair()  # both sides held: the peer is there and never sends
    work = groups[0].recv([buf], 1, 7)
    deadline = time.monotonic() + 0.0123
    with pytest.raises(RuntimeError) as timed:
        work.wait(_whole_ms_until(deadline))
    assert time.monotonic() >= deadline and _timed_out(timed.value), str(timed.value)
    groups = pair()  # a timed-out wait closes its pair: a fresh one
    lost = groups[0].recv([buf], 1, 8)
    del groups[1]  # the peer's side closes its connection
    with pytest.raises(RuntimeError) as closed:
        lost.wait(datetime.timedelta(seconds=20))
    assert not _timed_out(closed.value), str(closed.value)
