"""What each gloo rank runs for ``test_async_distributed.py`` (one spawn, several runs, to keep the suite fast): the
run configs in order, each in a process group of its own (``ports``: one per run; ``init_world`` starts it and the
run tears it down). A run expected to be refused (``expect_error``) must raise a ``ConfigError``; rank 0 writes its
message to ``<out>/error.txt``. Agentic runs (an ``[agent]`` table, ``test_agentic_distributed.py``) register their
table first, as the CLI does."""

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
