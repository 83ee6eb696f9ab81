"""What each gloo rank runs for ``test_async_distributed.py`` (one spawn, several runs, to keep the suite fast): the
run configs in order, each in a process group of its own (``ports``: one per run; ``init_world`` starts it and the
run tears it down). A run expected to be refused (``expect_error``) must raise a ``ConfigError``; rank 0 writes its
message to ``<out>/error.txt``; a ``probe`` run is only built (``policy_probe``); a ``pool_probe`` episode run is
trained and writes whether each rank built an environment pool (``_pool_probed``); a ``steps_probe`` episode run
is trained and writes what each rank trained at every step (``_steps_probed``); a ``batch_probe`` run (plain
completions) likewise writes each rank's per-step samples and records (``_batches_probed``). Agentic runs (an
``[agent]`` table, ``test_agentic_distributed.py``) register their table first, as the CLI does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError


def async_runs_worker(rank: int, world_size: int, runs: list[dict[str, Any]], ports: list[int]) -> None:
    from polyrl import run as runner
    from polyrl.run import config as rc

    if any("agent" in spec["raw"] for spec in runs):
        import polyrl.agents  # noqa: F401  (registers the [agent] table)

    for spec, port in zip(runs, ports):
        os.environ["MASTER_PORT"] = str(port)
        raw = spec["raw"]
        if spec.get("probe"):  # the run built, not trained: what each rank's policy holds
            policy_probe(rank, raw)
            continue
        if spec.get("pool_probe"):  # an episode run, trained as usual, recording whether this rank built a pool
            from polyrl.run.online import run_online

            run_online(rc.build(raw), None, _pool_probed(rank, Path(raw["out"])))
            continue
        if spec.get("steps_probe"):  # an episode run, trained as usual, recording each rank's batches and records
            from polyrl.run.online import run_online

            run_online(rc.build(raw), None, _steps_probed(rank, Path(raw["out"])))
            continue
        if spec.get("batch_probe"):  # a completions run, trained as usual, recording each rank's batches and records
            from polyrl.run.online import run_online

            run_online(rc.build(raw), None, _batches_probed(rank, Path(raw["out"])))
            continue
        if not spec.get("expect_error"):
            runner.run(rc.build(raw))
            continue
        try:
            runner.run(rc.build(raw))
        except ConfigError as exc:
            if rank == 0:
                Path(raw["out"]).mkdir(parents=True, exist_ok=True)
                (Path(raw["out"]) / "error.txt").write_text(str(exc))
        else:
            raise AssertionError(f"{raw['out']}: the run was not refused")


def _pool_probed(rank: int, out: Path) -> type:
    """An ``OnlineRun`` whose ``run`` first writes ``<out>/pool<rank>.json``: whether this rank's episode steps built
    an environment pool (``EpisodeSteps.env_pool``) and its failure totals' kinds."""
    import json

    from polyrl.run.online import OnlineRun

    class PoolProbed(OnlineRun):
        def run(self) -> dict[str, Any]:
            facts = {"pool": self.env_pool is not None, "totals": sorted(self._failure_counts())}
            out.mkdir(parents=True, exist_ok=True)
            (out / f"pool{rank}.json").write_text(json.dumps(facts))
            return super().run()

    return PoolProbed


def _steps_probed(rank: int, out: Path) -> type:
    """An ``OnlineRun`` that writes ``<out>/steps<rank>.json`` at its end: per step the digest of the episodes this
    rank trained on (every field of each, as the batch's transcripts carry them), their per-token policy versions
    (partial rollouts; else None each) and this rank's metrics record (JSON numbers only); then this process's id,
    whether it started an agent proxy, the examples its own loop or proxy ran (``local_episodes``: a dead worker's
    share) and its failure totals once every batch was trained."""
    import dataclasses
    import hashlib
    import json
    import os

    from polyrl.run.online import OnlineRun

    class StepsProbed(OnlineRun):
        def step(self, step: int) -> dict[str, Any]:
            rec = super().step(step)
            eps = json.dumps([dataclasses.asdict(e) for e in self._step_episodes], sort_keys=True)
            plain = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            versions = [e.versions for e in self._step_episodes]
            self._probed.append({"batch": hashlib.sha256(eps.encode()).hexdigest(), "record": plain,
                                 "versions": versions})  # fmt: skip
            return rec

        def run(self) -> dict[str, Any]:
            self._probed: list[dict[str, Any]] = []
            local: list[int] = []
            own = self.local_episodes  # EpisodeSteps' (placed before this class): wrapped on the instance

            def counted(examples: list[dict], *args: Any) -> Any:
                local.append(len(examples))
                return own(examples, *args)

            self.local_episodes = counted
            try:
                return super().run()
            finally:
                facts = {"steps": self._probed, "pid": os.getpid(), "proxy": self.proxy is not None, "local": local,
                         "failures": self.failure_totals}  # fmt: skip
                out.mkdir(parents=True, exist_ok=True)
                (out / f"steps{rank}.json").write_text(json.dumps(facts))

    return StepsProbed


def _batches_probed(rank: int, out: Path) -> type:
    """An ``OnlineRun`` that writes ``<out>/batches<rank>.json`` at its end: per step the digest of the samples this
    rank trained on (prompt and completion ids, behaviour log-probs, per-token and sample versions, groups) with their
    advantages, each sample's per-token versions, and this rank's metrics record (JSON numbers only)."""
    import hashlib
    import json

    from polyrl.run.online import OnlineRun

    class BatchesProbed(OnlineRun):
        def prepare(self, step: int, samples: list, adv: list, keep: list) -> Any:
            fields = [
                [s.prompt_ids, s.completion_ids, s.logprobs, s.token_versions, s.policy_version, s.group]
                for s in samples
            ]
            blob = json.dumps([fields, [float(a) for a in adv], list(keep)])
            self._probed.append({"batch": hashlib.sha256(blob.encode()).hexdigest(),
                                 "versions": [s.token_versions for s in samples]})  # fmt: skip
            return super().prepare(step, samples, adv, keep)

        def step(self, step: int) -> dict[str, Any]:
            n = len(self._probed)
            rec = super().step(step)
            if len(self._probed) == n:  # no update this step (every advantage 0): nothing prepared
                self._probed.append({"batch": None, "versions": None})
            plain = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self._probed[-1]["record"] = plain
            return rec

        def run(self) -> dict[str, Any]:
            self._probed: list[dict[str, Any]] = []
            try:
                return super().run()
            finally:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"batches{rank}.json").write_text(json.dumps(self._probed))

    return BatchesProbed


def policy_probe(rank: int, raw: dict[str, Any]) -> None:
    """Build the run of ``raw`` (not train it) and write what this rank's policy holds to ``<out>/probe<rank>.json``:
    a rollout copy apart from the trained model, a KV cache, rollout worker processes."""
    import io
    import json

    import torch.distributed as dist

    from polyrl.run import config as rc
    from polyrl.run.online import OnlineRun

    cfg = rc.build(raw)
    run = OnlineRun(cfg, cfg.spec.hooks(cfg.algo_config), io.StringIO())
    try:
        p = run.policy
        facts = {"copy": p.rollout_net is not p.model, "kv": p.llm.kv.allocated, "workers": p.remote is not None}
        Path(raw["out"]).mkdir(parents=True, exist_ok=True)
        (Path(raw["out"]) / f"probe{rank}.json").write_text(json.dumps(facts))
    finally:
        run.source.close()
        if run.policy.remote is not None:
            run.policy.remote.close()
        if run.pool is not None:
            run.pool.close()
        dist.destroy_process_group()


def failing_rank_worker(rank: int, world_size: int, raw: dict[str, Any]) -> None:
    """A run whose rank 1 fails in its trainer's thread at step 2, after taking batch 2 and submitting batch 3 (which
    takes the next update at its engine step 2, so its producer waits for it inside that batch); rank 1 writes
    whether batch 3 was in flight when it raised to ``<out>/in_flight.txt``. The step is wrapped here, in the test's
    own worker: the run itself is not changed."""
    import time

    from polyrl import run as runner
    from polyrl.run import config as rc
    from polyrl.run import online

    if "agent" in raw:
        import polyrl.agents  # noqa: F401  (registers the [agent] table)

    real_step = online.OnlineRun.step

    def step(self: Any, s: int) -> Any:
        if rank == 1 and s == 2:
            self.source.get(2)
            self.source.submit(3)
            time.sleep(0.5)  # the producer reaches batch 3's swap step
            in_flight = self.source._futures[3].running()
            (Path(raw["out"]) / "in_flight.txt").write_text(str(in_flight))
            raise RuntimeError("rank 1 fails at step 2")
        return real_step(self, s)

    online.OnlineRun.step = step
    runner.run(rc.build(raw))
