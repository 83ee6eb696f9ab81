"""``polyrl bench grpo --async 0,1,2``: asynchronous RL's step time measured with the real run loop (``polyrl train
--algo grpo --max-staleness K``, ``polyrl.run.online``), one run per K (K = 0, synchronous, always runs: the ratios'
reference).

Per K a GRPO run at the bench shape: ``--prompts`` prompts of at most ``--prompt-len`` tokens (before the chat
template), ``--n`` samples each, at most ``--gen-len`` new tokens (EOS is not ignored, as in a real run: random weights
seldom sample it; the row prints the mean length), a deterministic pseudo-random text reward (``bench_reward``,
in-process), one optimizer step per batch, the KV cache kept (``--kv keep``), released (``release``) or as the run
decides (``both`` -> ``"auto"``), and the producer ``--async-producer`` (``thread``: the rollout engine on its own copy
of the weights in a background thread, so generating step s+K overlaps training step s). A run has ``--warmup`` +
``--steps`` + K steps; the timed window is the ``--steps`` steps after the warm-up (the last K steps have nothing left
to generate ahead: run, not timed). Per K: steady step time (wall of the window / steps; the median step is in the
JSON), its ratio to K = 0, the GPU busy fraction of the one (colocated) placement over the window
(``bench/gpu_busy.py``: NVML, else device events, n/a on the CPU), the rollout / log-prob / train split (async: the
rollout runs beside training, ``wait`` is what the step waited for its batch), the weight sync, staleness (mean and
max over tokens) and batches dropped as too stale. ``--rollout-stream on|both`` is an experiment the run loop does
not do: the K > 0 rollouts (``collect``) on a device stream of their own, so that on one GPU their kernels may run
beside training's instead of queueing behind them on the default stream (rows ``thread+stream``).

Not here: the synchronous step split, roofline and TRL baseline (``bench/grpo.py``, ``bench/grpo_trl.py``), the
reward curves (``bench/grpo_curve.py``, which reuses ``TimedRun``); any change to the run loop (it is measured as it
is).

The 1 rollout + 1 train GPU rows (placement ``1+1``): where this machine has 2+ accelerators, each K > 0 of
``--async`` (K = 1 when none) runs again with the run's placement (``polyrl.run.placement``): ``--rollout-devices
cuda:1 --train-devices cuda:0`` and the process producer (a rollout worker process on cuda:1 fed weights over NCCL),
its ratio against the colocated synchronous step (the issue's target: <= 0.55x) and, with NVML, the busy fraction of
the train and of the rollout GPU. With fewer GPUs the output says so and no such row runs.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from polyrl.bench.common import free_memory, print_table
from polyrl.bench.gpu_busy import EventBusy, NvmlBusy, open_busy
from polyrl.errors import ConfigError
from polyrl.models.checkpoint import load_tokenizer
from polyrl.platform import device
from polyrl.run import config as run_config
from polyrl.run.online import OnlineRun


def add_async_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--async",
        dest="async_k",
        default=None,
        metavar="K,..",
        help="asynchronous RL: one real GRPO run per max-staleness K (0 = synchronous) at this shape; prints step "
        "time, ratio to K=0, GPU busy fraction, rollout/train split and staleness per K (bench/grpo_async.py)",
    )
    parser.add_argument(
        "--async-producer",
        choices=["thread", "inline", "process"],
        default="thread",
        help="the async producer of K > 0 (thread: a weight copy generating beside training)",
    )
    parser.add_argument(
        "--rollout-stream",
        choices=["off", "on", "both"],
        default="off",
        help="an experiment the run loop does not do (yet): K > 0 rollouts on a device stream of their own, so their "
        "kernels may overlap training's (both: a row each way); accelerators only",
    )
    parser.add_argument(
        "--task",
        default=None,
        help="reward-curve mode: 'arithmetic' (polyrl demo's task) or a builtin:arithmetic?... spec; sync and each "
        "--async K over the same --curve-samples samples",
    )
    parser.add_argument("--curve-samples", type=int, default=15360, help="samples per K in the reward-curve mode")
    parser.add_argument("--curve-sft-steps", type=int, default=125, help="SFT steps before the curve's GRPO runs")
    parser.add_argument("--curve-out", default="bench_grpo_curve", help="curve mode: writes PATH.json (+ PATH.png)")


def bench_reward(completion: str, example: Any) -> float:
    """Deterministic pseudo-random reward in [0, 1) of a completion text (non-zero group advantages, no work)."""
    return (sum((i + 1) * ord(c) for i, c in enumerate(completion[:64])) % 1000) / 1000.0


def parse_ks(spec: str) -> list[int]:
    """The K values of ``--async`` (sorted, 0 included)."""
    try:
        ks = [int(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or any(k < 0 for k in ks):
        raise ConfigError(f"--async takes comma-separated max-staleness values >= 0 such as 0,1,2; got {spec!r}")
    return sorted(set(ks) | {0})  # K = 0 first: the reference of every ratio


# ---- one timed run -------------------------------------------------------------------------------------------
class TimedRun(OnlineRun):
    """The online run as ``polyrl train`` runs it, keeping each step's wall-clock interval and record; with an
    ``EventBusy`` meter, the rollout (``collect``, in the producer's thread when async) and train (``prepare`` +
    ``update``) phases are bracketed by device events."""

    def __init__(
        self, *a: Any, window: tuple[int, int], meter: Any = None, rollout_stream: bool = False, **kw: Any
    ) -> None:
        self.window, self.meter = window, meter
        api = device.stream_api() if rollout_stream else None
        self.side = api.Stream() if api is not None else None  # --rollout-stream: generation on a stream of its own
        self.intervals: list[tuple[float, float]] = []
        self.records: list[dict[str, Any]] = []
        self.marks: dict[str, Any] = {}
        super().__init__(*a, **kw)

    def _span(self) -> Any:
        return self.meter.span() if isinstance(self.meter, EventBusy) else _null()

    def _stream(self) -> Any:
        if self.side is None:
            return _null()
        api = device.stream_api()
        self.side.wait_stream(api.current_stream())  # after the weight sync queued on the default stream
        return api.stream(self.side)

    def collect(self, step: int) -> Any:
        # the rollout's results reach the host (token ids, log-probs): nothing of the side stream is left pending
        with self._stream(), self._span():
            return super().collect(step)

    def prepare(self, *a: Any, **kw: Any) -> Any:
        with self._span():
            return super().prepare(*a, **kw)

    def update(self, *a: Any, **kw: Any) -> Any:
        with self._span():
            return super().update(*a, **kw)

    def step(self, step: int) -> dict[str, Any]:
        first, last = self.window
        if step == first:
            device.synchronize()  # the window starts with nothing of the warm-up in flight
            if isinstance(self.meter, EventBusy):
                self.marks["w0"] = self.meter.mark()
        t0 = time.perf_counter()
        rec = super().step(step)
        if step == last:
            if isinstance(self.meter, EventBusy):
                self.marks["w1"] = self.meter.mark()
            device.synchronize()  # ... and ends when the last timed step's work has run
        self.intervals.append((t0, time.perf_counter()))
        self.records.append(dict(rec))
        return rec


@contextmanager
def _null() -> Iterator[None]:
    yield


def _mean(recs: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in recs if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def timed_run(
    raw: dict[str, Any], warmup: int, steps: int, rollout_stream: bool = False, busy_devices: list[int] | None = None
) -> dict[str, Any]:
    """Run ``raw`` (a ``polyrl train`` config) and summarise its timed window (steps ``warmup`` .. + ``steps``).
    ``busy_devices``: measure these device indices with NVML (the first is the trainer's; none without NVML) instead
    of the current device alone."""
    cfg = run_config.build(raw)
    meter = open_busy() if busy_devices is None else _nvml_meter(busy_devices)
    window = (warmup, warmup + steps - 1)
    hooks = cfg.spec.hooks(cfg.algo_config)
    run = TimedRun(cfg, hooks, io.StringIO(), window=window, meter=meter, rollout_stream=rollout_stream)
    try:
        run.run()
    finally:
        if meter is not None:
            meter.close()
    ivals, recs = run.intervals[warmup : warmup + steps], run.records[warmup : warmup + steps]
    t0, t1 = ivals[0][0], ivals[-1][1]
    busy = meter.fraction(t0, t1, run.marks.get("w0"), run.marks.get("w1")) if meter is not None else None
    k = raw["grpo"]["max_staleness"]
    res: dict[str, Any] = {
        "k": k,
        "producer": (raw["grpo"]["async_producer"] + ("+stream" if run.side is not None else "")) if k else "sync",
        "steps_timed": len(recs),
        "step_s": (t1 - t0) / len(recs),
        "step_median_s": statistics.median(b - a for a, b in ivals),
        "gpu_busy": busy[0] if busy else None,
        "gpu_busy_rollout": busy[1] if busy and len(busy) > 1 else None,
        "gpu_busy_kind": meter.kind if meter is not None else None,
        "rollout_s": _mean(recs, "rollout_s"),
        "logprob_s": _mean(recs, "logprob_s"),
        "train_s": _mean(recs, "train_s"),
        # synchronous: the step waits for its whole generation
        "wait_s": _mean(recs, "async/wait_s") if k else _mean(recs, "rollout_s"),
        "sync_s": _mean(recs, "async/sync_s") if k else 0.0,
        "staleness_mean": _mean(recs, "async/staleness_mean") if k else 0.0,
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in recs), default=0.0),
        "stale_dropped": recs[-1].get("async/stale_dropped_total", 0.0),
        "response_length": _mean(recs, "response_length"),
        "reward": _mean(recs, "reward"),
        "steps_all": [b - a for a, b in run.intervals],
    }
    del run
    free_memory()
    return res


def _timing_raw(model_dir: Path, data: Path, out: Path, args: argparse.Namespace, k: int) -> dict[str, Any]:
    return {
        "algo": "grpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": str(data)},
        "engine": {"micro_batch_tokens": args.micro_batch_tokens},
        "optim": {"lr": 1e-6},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": args.warmup + args.steps + k, "log_every": 10**6, "save_final_model": False},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "grpo": {
            "reward": f"{__name__}:bench_reward",
            "reward_workers": 0,
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.n,
            "max_new_tokens": args.gen_len,
            "rollout_max_num_seqs": max(512, args.prompts * args.n),
            "rollouts_to_save": 0,
            "release_kv": {"keep": False, "release": True, "both": "auto"}[args.kv],
            "max_staleness": k,
            "async_producer": args.async_producer,
        },
    }


def _prompt_file(model_dir: Path, args: argparse.Namespace, path: Path) -> Path:
    """``--prompts`` distinct texts of at most ``--prompt-len`` tokens (before the chat template), one JSON row each."""
    tok = load_tokenizer(model_dir)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    rows = []
    for i in range(args.prompts):
        text = [f"{i}"] + [words[(i + j) % len(words)] for j in range(args.prompt_len)]
        while len(text) > 1 and len(tok.encode(" ".join(text))) > args.prompt_len:
            text.pop()
        rows.append(json.dumps({"prompt": " ".join(text)}))
    path.write_text("\n".join(rows) + "\n")
    return path


def _stream_variants(mode: str, k: int) -> list[bool]:
    """Whether the K run generates on its own stream: ``--rollout-stream`` off / on / both (K > 0 only)."""
    if k == 0 or not device.is_accelerator():
        return [False]
    return {"off": [False], "on": [True], "both": [False, True]}[mode]


def _nvml_meter(indices: list[int]) -> Any:
    """NVML's busy meter over device ``indices`` (train first), or None where NVML does not import."""
    if not device.is_accelerator():
        return None
    try:
        # lazy: nvidia-ml-py is optional
        import pynvml
    except ImportError:
        return None
    return NvmlBusy(pynvml, list(indices))


def placement_pair() -> tuple[str, str] | None:
    """(rollout_devices, train_devices) of the 1 rollout + 1 train GPU rows: accelerator 1 and 0 where this machine
    has 2 or more, else None (the rows do not run)."""
    if device.is_accelerator() and device.count() >= 2:
        kind = device.device_type()
        return f"{kind}:1", f"{kind}:0"
    return None


def two_gpu_note(pair: tuple[str, str] | None = None) -> str:
    """What the 1 rollout + 1 train GPU line says: the placement its rows ran with, or why none ran."""
    if pair is not None:
        train = pair[1] or "the default device"
        return f"ran with --rollout-devices {pair[0]} --train-devices {train} (process producer): rows '1+1' above"
    have = f"{device.count()} GPU here" if device.is_accelerator() else "no GPU here"
    return f"not run: needs 2 GPUs ({have}); on a 2-GPU machine it runs --rollout-devices cuda:1 --train-devices cuda:0"


def split_rows(
    model_dir: Path, data: Path, work: Path, args: argparse.Namespace, ks: list[int], pair: tuple[str, str]
) -> list[dict[str, Any]]:
    """The rows of placement ``pair`` = (rollout_devices, train_devices): one per K > 0 of ``ks`` (K = 1 if none),
    the process producer (one rollout worker on the rollout device)."""
    rollout, train = pair
    busy = None
    if device.is_accelerator():
        busy = [int(torch.device(d).index or 0) for d in (train or f"{device.device_type()}:0", rollout)]
    rows = []
    for k in [k for k in ks if k > 0] or [1]:
        try:
            raw = _timing_raw(model_dir, data, work / f"k{k}-split", args, k)
            raw["grpo"].update(async_producer="process", rollout_devices=rollout, train_devices=train)
            row = timed_run(raw, args.warmup, args.steps, busy_devices=busy)
        except Exception as exc:  # the colocated rows stand; say why this one is missing
            print(f"# K={k} on 1+1 devices failed: {type(exc).__name__}: {exc}")
            rows.append({"k": k, "placement": "1+1", "producer": f"failed: {type(exc).__name__}", "error": str(exc)})
            free_memory()
            continue
        row["placement"], row["producer"] = "1+1", f"process ({rollout} -> {train or 'default'})"
        rows.append(row)
        steps = ", ".join(f"{s:.2f}" for s in row["steps_all"])
        print(f"# K={k} (1 rollout + 1 train device): steady {row['step_s']:.3f} s/step; step walls {steps} s")
    return rows


def run_async(model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The timing mode: one row per K (see the module docstring)."""
    ks = parse_ks(args.async_k)
    if args.steps < 1:
        raise ConfigError(f"--async needs at least one timed step; got --steps {args.steps}")
    where = device.name() if device.is_accelerator() else "cpu"
    print(
        f"# GRPO step, async: {args.shape} on {where}, {args.prompts} prompts x {args.n} samples x <= "
        f"{args.gen_len} new tokens; per K: {args.warmup} warm-up + {args.steps} timed steps (+K untimed)"
    )
    data = _prompt_file(model_dir, args, work / "prompts.jsonl")
    rows = []
    for k, stream in [(x, s) for x in ks for s in _stream_variants(args.rollout_stream, x)]:
        try:
            raw = _timing_raw(model_dir, data, work / f"k{k}{'s' if stream else ''}", args, k)
            row = timed_run(raw, args.warmup, args.steps, rollout_stream=stream)
        except Exception as exc:  # one K failing (e.g. out of memory) still leaves the others' rows
            print(f"# K={k} failed: {type(exc).__name__}: {exc}")
            rows.append({"k": k, "producer": f"failed: {type(exc).__name__}", "error": str(exc)})
            free_memory()
            continue
        row["placement"] = "1"
        rows.append(row)
        steps = ", ".join(f"{s:.2f}" for s in row["steps_all"])
        timed = f"{args.warmup + 1}..{args.warmup + args.steps}"
        print(f"# K={k} ({row['producer']}): steady {row['step_s']:.3f} s/step; step walls {steps} s (timed: {timed})")
    pair = placement_pair()
    if pair is not None:
        rows += split_rows(model_dir, data, work, args, ks, pair)
    base = rows[0].get("step_s")
    for r in rows:
        if base and r.get("step_s"):
            r["ratio_to_sync"] = r["step_s"] / base
    cols = ["k", "placement", "producer", "step_s", "ratio_to_sync", "gpu_busy", "rollout_s", "logprob_s", "train_s"]
    cols += ["wait_s"] + (["gpu_busy_rollout"] if any(r.get("gpu_busy_rollout") is not None for r in rows) else [])
    cols += ["sync_s", "staleness_mean", "staleness_max", "stale_dropped", "response_length"]
    print_table(rows, cols)
    kind = next((r["gpu_busy_kind"] for r in rows if r.get("gpu_busy_kind")), None)
    print(
        f"# gpu_busy: {kind or 'n/a (CPU)'}; placement 1: rollout and training colocated on one device; 1+1: the "
        "trainer's device (gpu_busy_rollout: the rollout device's, NVML only); ratio_to_sync: against the colocated "
        "synchronous step"
    )
    note = two_gpu_note(pair)
    print(f"1 rollout + 1 train GPU: {note}")
    return {"async_rows": rows, "two_gpu": note}
