"""The ``collectives`` validation level: all_reduce, all_gather, broadcast and reduce_scatter correctness.

One process per visible device (``torch.multiprocessing`` spawn, world size = device count) through the
platform's collective backend (``polyrl.platform.device.collective_backend()``), a TCP rendezvous on
127.0.0.1 (the store's server in the calling process, on a port it binds itself; the ranks its clients). Each
rank fills tensors with rank-dependent values whose exact results are known (small integers, exact in fp32), runs
every op and compares; rank 0 also times an all_reduce of a larger buffer (bus bandwidth as NCCL-tests define it:
``2 (n-1)/n * bytes / time``). Ranks write their answers as JSON files, so a hung or crashed rank is a failed level
with its error, not a hung validation.

With one device the level is skipped; ``--collectives-cpu-procs N`` runs N CPU processes over gloo instead
(the CI test does, with 2). Not here: multi-node (polyrl never validates it here), FSDP.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from polyrl.validate.arg_types import int_at_least
from polyrl.validate.result import LevelSkipped, check, level_result

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
TIMEOUT_S = 180.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("collectives level")
    group.add_argument(
        "--collectives-cpu-procs",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="run the collectives on N CPU processes over gloo instead of the devices (e.g. 2 on a CPU machine)",
    )


def _checks_on_rank(rank: int, world: int, dev: Any, bench_numel: int) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch
    import torch.distributed as dist

    n = 1031  # not a multiple of any vector width
    out: dict[str, Any] = {}

    def record(name: str, fn) -> None:
        try:
            got, want = fn()
            diff = float((got.double() - want.double()).abs().max().item())
            out[name] = {"ok": diff == 0.0, "max_abs": diff}
        except Exception as exc:  # noqa: BLE001 - an unsupported op is a result
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}

    base = torch.arange(n, dtype=torch.float32, device=dev)

    def all_reduce():
        x = base + rank
        dist.all_reduce(x)
        return x, base * world + world * (world - 1) / 2

    def all_gather():
        parts = [torch.empty(n, device=dev) for _ in range(world)]
        dist.all_gather(parts, base * (rank + 1))
        return torch.stack(parts), torch.stack([base * (r + 1) for r in range(world)])

    def broadcast():
        x = base * 3 if rank == 0 else torch.zeros(n, device=dev)
        dist.broadcast(x, src=0)
        return x, base * 3

    def reduce_scatter():
        chunks = [torch.full((n,), float(rank * world + j), device=dev) for j in range(world)]
        y = torch.empty(n, device=dev)
        dist.reduce_scatter(y, chunks)
        want = sum(float(r * world + rank) for r in range(world))
        return y, torch.full((n,), want, device=dev)

    for name, fn in zip(OPS, (all_reduce, all_gather, broadcast, reduce_scatter)):
        record(name, fn)
    out["bench"] = _bench(dev, bench_numel, world)
    return out


def _bench(dev: Any, numel: int, world: int) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch
    import torch.distributed as dist

    from polyrl.platform import device

    x = torch.ones(numel, dtype=torch.float32, device=dev)
    for _ in range(2):
        dist.all_reduce(x)
    iters = 5
    dist.barrier()
    if dev.type != "cpu":
        device.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if dev.type != "cpu":
        device.synchronize()
    dt = (time.perf_counter() - t0) / iters
    nbytes = numel * 4
    return {"bytes": nbytes, "time_s": dt, "busbw_gbps": 2 * (world - 1) / world * nbytes / dt / 1e9}


def _worker(rank: int, world: int, backend: str, port: int, use_cpu: bool, result_dir: str) -> None:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch
    import torch.distributed as dist

    from polyrl.platform import device

    path = Path(result_dir) / f"rank{rank}.json"
    try:
        if use_cpu:
            dev = torch.device("cpu")
        else:
            device.set_device(rank)
            dev = device.torch_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        bench_numel = (1 << 20) if use_cpu else (1 << 24)
        out = _checks_on_rank(rank, world, dev, bench_numel)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - report, never hang the parent
        out = {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-2000:]}
    path.write_text(json.dumps(out))


def _spawn(world: int, backend: str, use_cpu: bool) -> list[dict[str, Any]]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # the rendezvous store's server here, on a port it binds itself (a port probed free and bound later by rank 0
    # may be taken by another process in between); every rank is its client
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="polyrl-coll-") as tmp:
        ctx = mp.start_processes(
            _worker, args=(world, backend, server.port, use_cpu, tmp), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"collectives did not finish within {TIMEOUT_S:.0f} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        results = []
        for rank in range(world):
            f = Path(tmp) / f"rank{rank}.json"
            results.append(json.loads(f.read_text()) if f.exists() else {"error": "rank wrote no result"})
        return results


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    from polyrl.platform import device

    procs = int(getattr(args, "collectives_cpu_procs", 0) or 0)
    if procs == 1 or procs < 0:
        raise LevelSkipped("--collectives-cpu-procs needs at least 2 processes")
    use_cpu = procs >= 2
    world = procs if use_cpu else device.count()
    backend = "gloo" if use_cpu else device.collective_backend()
    if world < 2:
        raise LevelSkipped(
            f"{world} visible {device.device_type()} device(s); collectives need at least 2 "
            "(run on a multi-device machine, or pass --collectives-cpu-procs 2 to exercise gloo on the CPU)"
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned ranks on a small CPU must not oversubscribe it
    ranks = _spawn(world, backend, use_cpu)
    checks = []
    for op in OPS:
        per_rank = [r.get(op) or {"ok": False, "error": r.get("error", "missing")} for r in ranks]
        errors = sorted({p["error"] for p in per_rank if "error" in p})
        worst = max((p.get("max_abs", 0.0) for p in per_rank), default=0.0)
        ok = all(p["ok"] for p in per_rank)
        checks.append(check(f"{op} exact on {world} ranks", ok, worst, "max abs 0", "; ".join(errors)))
    bench = ranks[0].get("bench") or {}
    where = f"{world} CPU processes" if use_cpu else f"{world} {device.name()}"
    metrics = {
        "backend": backend,
        "world_size": world,
        "ranks_on": where,
        "all_reduce_bytes": bench.get("bytes"),
        "all_reduce_busbw_gbps": bench.get("busbw_gbps"),
    }
    return level_result("collectives", checks, metrics)
