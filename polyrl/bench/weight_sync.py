"""``polyrl bench weight-sync``: trainer -> rollout weight sync (``polyrl.run.weight_sync``) at real model shapes.

Rows, per ``--shape`` (random weights of a preset shape in ``--dtype``):
- ``in-process``: ``InProcessSync`` from the trained model into a separate rollout copy on one device (async RL's
  threaded producer);
- ``broadcast``: ``BucketedBroadcast`` from a trainer process on device 0 to a rollout process on device 1 over a
  pair group (``rollout_workers``' groups): NCCL when 2+ CUDA devices are visible; on a machine with fewer the row
  says why it is skipped; ``--backend gloo`` runs it between two CPU processes instead (the CPU test path).
Each row: seconds per sync (median of ``--reps`` after ``--warmup``), payload bytes, GB/s, and for the broadcast
whether the receiver's weights equal the sender's afterwards (a checksum over every tensor). Targets (issue 27, H200
NVLink): qwen3-0.6b <= 0.2 s, qwen3-8b <= 1.5 s per sync. ``--json`` writes the rows. This module measures; it
asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polyrl.bench.common import print_table
from polyrl.models.decoder import build_model
from polyrl.models.presets import PRESETS, preset_config
from polyrl.platform import device
from polyrl.run.rollout_workers import weights_group
from polyrl.run.weight_sync import BucketedBroadcast, InProcessSync

TARGET_S = {"qwen3-0.6b": 0.2, "qwen3-8b": 1.5}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-0.6b", help="comma list of model presets, e.g. qwen3-0.6b,qwen3-8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weights and wire dtype")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="broadcast bucket size in MiB")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="broadcast row: auto = NCCL when 2+ CUDA devices are visible (else skipped)")  # fmt: skip
    parser.add_argument("--no-broadcast", action="store_true", help="in-process rows only")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _model(shape: str, dtype: torch.dtype, dev: torch.device, seed: int) -> torch.nn.Module:
    name = shape if shape in PRESETS else f"{shape}-shape"
    return build_model(preset_config(name), dtype=dtype, device=dev, seed=seed).requires_grad_(False)


def _row(shape: str, mode: str, dtype: str, times: list[float], nbytes: int, on_gpu: bool, **extra) -> dict:
    """A result row; the issue's target applies to GPU rows only (it is stated for H200 NVLink)."""
    s = statistics.median(times)
    target = TARGET_S.get(shape) if on_gpu else None
    return {
        "shape": shape, "mode": mode, "dtype": dtype, "seconds": s, "gb": nbytes / 1e9, "gbps": nbytes / s / 1e9,
        "target_s": target, "meets_target": (s <= target) if target is not None else None, **extra,
    }  # fmt: skip


def _in_process(shape: str, args: argparse.Namespace, dev: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    src, dst = _model(shape, dtype, dev, 0), _model(shape, dtype, dev, 1)
    sync = InProcessSync(src, dst)
    times = [sync.sync().seconds for _ in range(args.warmup + args.reps)][args.warmup :]
    row = _row(shape, f"in-process {dev}", args.dtype, times, sync.nbytes, dev.type != "cpu")
    del src, dst, sync
    device.empty_cache()
    return row


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(t.sum(dtype=torch.float64).item() for t in [*model.parameters(), *model.buffers()]))


def _broadcast_rank(rank: int, port: int, backend: str, shape: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    devs = ("cuda:0", "cuda:1") if backend == "nccl" else ("cpu", "cpu")
    here = torch.device(devs[rank])
    if here.type == "cuda":
        device.set_device(here.index or 0)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=300))
    group, buf_dev = weights_group(store, 1, rank, devs[0], devs[1], 300)
    model = _model(shape, DTYPES[args["dtype"]], here, seed=rank)  # different weights on the two sides
    sync = BucketedBroadcast(model, group, 0, rank, buf_dev, args["dtype"], args["bucket_mb"])
    times = [sync.sync().seconds for _ in range(args["warmup"] + args["reps"])][args["warmup"] :]
    torch.save({"times": times, "bytes": sync.nbytes, "buckets": len(sync.buckets), "sum": _checksum(model)}, out)


def _broadcast(shape: str, args: argparse.Namespace, backend: str) -> dict:
    # the store's server here, on a port it binds itself (a port probed free and bound later by a rank may be
    # taken by another process in between); both ranks are its clients
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    port = int(server.port)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{r}.pt") for r in (0, 1)]
        ctx = mp.get_context("spawn")
        kw = {k: getattr(args, k) for k in ("dtype", "bucket_mb", "warmup", "reps")}
        procs = [ctx.Process(target=_broadcast_rank, args=(r, port, backend, shape, kw, outs[r])) for r in (0, 1)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 600
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            procs[0].join(0.5)
            if any(p.exitcode not in (None, 0) for p in procs):  # one side failed: the other would wait for it
                break
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            return {"shape": shape, "mode": f"broadcast {backend}", "status": f"failed: exit codes {codes}"}
        send, recv = (torch.load(o) for o in outs)
    mode = "broadcast nccl cuda:0->cuda:1" if backend == "nccl" else "broadcast gloo cpu->cpu"
    return _row(shape, mode, args.dtype, send["times"], send["bytes"], backend == "nccl", buckets=send["buckets"],
                receiver_equal=send["sum"] == recv["sum"], status="ok")  # fmt: skip


def _broadcast_backend(args: argparse.Namespace) -> tuple[str | None, str]:
    if args.backend == "gloo":
        return "gloo", ""
    n = device.count() if device.device_type() == "cuda" else 0
    if n >= 2 and dist.is_nccl_available():
        return "nccl", ""
    why = f"skipped: NCCL broadcast needs 2+ CUDA devices, this machine shows {n}"
    if n >= 2:
        why = "skipped: this torch build has no NCCL"
    return None, why


def run(args: argparse.Namespace) -> int:
    dev = device.torch_device()
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    backend, why = _broadcast_backend(args)
    rows = []
    for shape in shapes:
        rows.append(_in_process(shape, args, dev))
        if args.no_broadcast:
            continue
        if backend is None:
            rows.append({"shape": shape, "mode": "broadcast nccl cuda:0->cuda:1", "status": why})
        else:
            rows.append(_broadcast(shape, args, backend))
    print(
        f"weight sync: {args.dtype} weights, bucket {args.bucket_mb:g} MiB, median of {args.reps} after {args.warmup}"
    )
    cols = ["shape", "mode", "dtype", "gb", "seconds", "gbps", "target_s", "meets_target", "receiver_equal", "status"]
    print_table(rows, cols, ["shape", "mode", "dtype", "GB", "s/sync", "GB/s", "target s", "meets", "equal", "status"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": device.name() if device.is_accelerator() else "cpu"}, f, indent=2)
    return 0


__all__ = ["add_arguments", "run"]
