"""What each gloo rank runs for ``test_keep_best_distributed.py`` (one spawn of two processes, four runs in turn,
each in a process group of its own: ``ports``, one per run): an SFT run, its resume, a GRPO run, its resume, every
one with ``train.keep_best``. After each run every rank writes the state of its own ``BestKeeper`` to
``<workdir>/<name>.rank<r>.json`` (so the test sees whether the ranks agree); after a first run rank 0 copies its
``final`` folder aside (the resume overwrites it). Before the GRPO resume rank 0 (the rank that scores) sets the
reward's offset file to 0, so every evaluation of the resumed run is worse than any of the first run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def keep_best_worker(rank: int, world_size: int, workdir: str, runs: list[dict[str, Any]], ports: list[int]) -> None:
    import torch.distributed as dist

    from polyrl.run import config as rc
    from polyrl.run.offline import OfflineRun
    from polyrl.run.online import OnlineRun
    from polyrl.train import parallel as par

    work = Path(workdir)
    for spec, port in zip(runs, ports):
        os.environ["MASTER_PORT"] = str(port)
        if rank == 0 and "offset" in spec:
            (work / "offset.txt").write_text(str(spec["offset"]))
        cfg = rc.build(spec["raw"])
        if cfg.algo == "sft":
            world = par.init_world()
            try:
                run: Any = OfflineRun(cfg, None, world)
                run.train()
            finally:
                par.destroy_world(world)
        else:
            try:
                run = OnlineRun(cfg, cfg.spec.hooks(cfg.algo_config))
                run.run()
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        (work / f"{spec['name']}.rank{rank}.json").write_text(json.dumps(run.best.state_dict()))
        if rank == 0 and spec.get("copy_final"):
            shutil.copytree(Path(cfg.out) / "final", work / f"{spec['name']}-final")
