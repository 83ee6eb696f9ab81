"""The worker process of ``rollout_workers`` (``async_producer = "process"``): its entry point (``worker_main``, the
target ``RolloutWorkers`` spawns), what it builds (``WorkerSpec``), what a general job's function gets
(``WorkerContext``), its end of the control channel (``_Inbox``), the partial-rollout hook between its engine's
decode steps (``_PartialJob``) and its serving loop (``_serve``); and what both ends share: the command and tag
numbers of the control wire format and the two pair groups (``control_group``, ``weights_group``).

The wire format, the connection protocol, restarts and partial rollouts are described from the trainer's side in
``polyrl.run.rollout_workers``' docstring; the ordering of a partial-rollout update in ``polyrl.run.worker_partial``.
Not here: the trainer's side (``RolloutWorkers``), the weight broadcast itself (``weight_sync``).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import pickle
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from polyrl.platform import device
from polyrl.run.weight_sync import DEFAULT_BUCKET_MB, BucketedBroadcast

EXIT, WEIGHTS, JOB, CALL = 0, 1, 2, 3  # control commands (a header's first value)
TAG_HDR, TAG_DATA = 1, 2  # the control group's message tags: a header int64 [cmd, nbytes], then its payload
HOST = "127.0.0.1"  # the TCPStore of the trainer (replicas on other hosts are not built)
# how long a loaded worker waits for the trainer to connect it: a restarted one until the next push_weights, which
# may be a whole RL step (an evaluation included) away
JOIN_WAIT = datetime.timedelta(hours=24)
# test only: "<replica>:<seconds>" makes that replica's workers sleep this long per prompt of a job before replying (a
# slow replica for the load-balancing tests); read by the worker when it is spawned
SLOW_REPLICA_ENV = "POLYRL_TEST_SLOW_REPLICA"


@dataclasses.dataclass
class WorkerSpec:
    """What a worker builds: the model folder in ``dtype`` on ``device`` (``lora``: with the run's adapters,
    ``seed``: their initial values), its engine, and its end of the weight sync."""

    model_path: str
    tokenizer_path: str
    rollout_cfg: Any
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    trainer_device: str = "cpu"
    wire_dtype: str = "auto"
    bucket_mb: float = DEFAULT_BUCKET_MB
    lora: Any = None
    seed: int = 0


@dataclasses.dataclass
class WorkerContext:
    """What a ``RolloutWorkers.call`` job's function gets in the worker: its engine (``llm``), tokenizer, replica
    index and spec, and ``state``, kept across the jobs of this incarnation (an agentic run keeps its environment
    pool there); each value of ``state`` with a ``close()`` is closed when the worker stops. ``between_steps``: with
    partial rollouts, the job's hook (``_PartialJob``) that a function stepping the engine itself calls between
    two engine steps as ``between_steps(llm, steps)`` (as ``LLM.generate`` does; the episode loop takes it as its
    ``between_steps``); None otherwise (and outside a job)."""

    llm: Any
    tokenizer: Any
    replica: int
    spec: WorkerSpec
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    between_steps: Any = None

    def close(self) -> None:
        for value in self.state.values():
            if callable(getattr(value, "close", None)):
                value.close()
        self.state.clear()


@dataclasses.dataclass
class RaisedInWorker:
    """A ``call`` job's function raised in the worker: the exception (a RuntimeError with its text when it does not
    pickle) and the worker's traceback."""

    exc: BaseException
    traceback: str


def raised_in_worker(exc: Exception) -> RaisedInWorker:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception that does not survive the trip
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return RaisedInWorker(exc, tb)


def _send_obj(pg: Any, obj: Any, dst: int) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    pg.send([torch.tensor([JOB, data.numel()], dtype=torch.int64)], dst, TAG_HDR).wait()
    pg.send([data], dst, TAG_DATA).wait()


def weights_group(
    store: Any, worker: int | str, me: int, trainer_device: str, worker_device: str, timeout_s: float
) -> tuple[Any, torch.device]:
    """The pair group (rank 0 the trainer, rank 1 the worker) of replica ``worker`` (an index, or a replica's
    ``"<replica>.<incarnation>"`` name) and where its bucket buffers live: NCCL on this side's CUDA device when both
    ends are CUDA devices, else gloo on the CPU."""
    prefixed = dist.PrefixStore(f"weights{worker}", store)
    here = torch.device(trainer_device if me == 0 else worker_device)
    if torch.device(trainer_device).type == "cuda" and torch.device(worker_device).type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, me, 2, opts), here
    return dist.ProcessGroupGloo(prefixed, me, 2, datetime.timedelta(seconds=timeout_s)), torch.device("cpu")


def control_group(store: Any, name: str, me: int, timeout_s: float) -> Any:
    """The gloo pair group (rank 0 the trainer, rank 1 the worker) that carries replica ``name``'s commands."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"ctl{name}", store), me, 2, datetime.timedelta(seconds=timeout_s))


def _load(spec: WorkerSpec) -> nn.Module:
    # lazy: the worker process builds the model only after it is spawned
    from polyrl.models.checkpoint import load_model
    from polyrl.models.lora import load_lora_model

    dev = torch.device(spec.device)
    if spec.lora is not None:
        model = load_lora_model(spec.model_path, spec.lora, spec.dtype, dev, seed=spec.seed)
    else:
        model = load_model(spec.model_path, dtype=spec.dtype, device=dev)
    return model.eval().requires_grad_(False)


def worker_main(port: int, name: str, spec: WorkerSpec, timeout_s: float) -> None:
    """A rollout worker: set the device, load the model folder, build the engine, say it is ready, wait for the
    trainer to connect its pair groups, then serve commands until EXIT."""
    # lazy: the engine is built only in the spawned worker
    from polyrl.algorithms.workers import shelter_from_stop_signal
    from polyrl.infer.llm import LLM
    from polyrl.models.checkpoint import load_tokenizer

    torch.set_num_threads(1)
    shelter_from_stop_signal()  # the trainer finishes its step on a SIGTERM to its whole group: this worker too
    # daemonic only so that the trainer's exit stops it: a worker may start processes of its own (an agentic run's
    # environment workers), which multiprocessing refuses a daemonic process; they end when its pipes close
    mp.current_process().daemon = False
    slow = os.environ.get(SLOW_REPLICA_ENV, "").split(":")
    delay_s = float(slow[1]) if len(slow) == 2 and slow[0] == name.split(".")[0] else 0.0
    if torch.device(spec.device).type != "cpu":
        device.set_device(torch.device(spec.device).index or 0)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=120))
    model = _load(spec)
    llm = LLM(model, load_tokenizer(spec.tokenizer_path), spec.rollout_cfg)
    store.set(f"ready{name}", "1")
    store.wait([f"go{name}"], JOIN_WAIT)
    pg = control_group(store, name, 1, timeout_s)
    wpg, wdev = weights_group(store, name, 1, spec.trainer_device, spec.device, timeout_s)
    sync = BucketedBroadcast(model, wpg, 0, 1, wdev, spec.wire_dtype, spec.bucket_mb, lora_only=spec.lora is not None)
    ctx = WorkerContext(llm, llm.tokenizer, int(name.split(".")[0]), spec)
    try:
        _serve(pg, llm, sync, ctx, delay_s)
    finally:
        ctx.close()


class _Inbox:
    """The worker's end of its control channel: a listener thread receives every message as soon as it is sent (so
    the trainer's sends never wait for a busy engine) and hands it to the serving thread. Jobs, calls and EXIT queue
    in order; a ``WEIGHTS`` notice is kept aside (``notice``: ``(version, defer)``, at most one pending, since the
    trainer pushes one update at a time and waits for it), read by the idle loop and, with partial rollouts,
    between the engine's decode steps (``_PartialJob``). The trainer's end closing (its process gone) reads as
    EXIT."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.cv = threading.Condition()
        self.queue: collections.deque[tuple[int, Any]] = collections.deque()
        self.notice: tuple[int | None, bool] | None = None
        self.closed = False
        threading.Thread(target=self._listen, name="polyrl-worker-inbox", daemon=True).start()

    def _listen(self) -> None:
        try:
            while True:
                hdr = torch.zeros(2, dtype=torch.int64)
                self.pg.recv([hdr], 0, TAG_HDR).wait()
                cmd, n = int(hdr[0]), int(hdr[1])
                payload = None
                if n:
                    buf = torch.empty(n, dtype=torch.uint8)
                    self.pg.recv([buf], 0, TAG_DATA).wait()
                    try:
                        payload = pickle.loads(buf.numpy().tobytes())
                    except Exception as exc:  # noqa: BLE001 - a call's function that does not import here
                        payload = raised_in_worker(exc)
                with self.cv:
                    if cmd == WEIGHTS:  # plain (no version: no partial rollouts) or (version, defer)
                        self.notice = payload if payload is not None else (None, False)
                    else:
                        self.queue.append((cmd, payload))
                    self.closed = cmd == EXIT
                    self.cv.notify_all()
                if cmd == EXIT:
                    return
        except Exception:  # noqa: BLE001 - the trainer's end closed (or worse): the worker stops, seen as dead
            with self.cv:
                self.queue.append((EXIT, None))
                self.closed = True
                self.cv.notify_all()

    def next(self) -> tuple[int, Any]:
        """The idle loop's next message: an update to take now (``WEIGHTS``, its notice) before any queued job (a
        restarted worker's first weights come before its first job), else the oldest queued message. A deferred
        notice (``defer``: the job that takes it is not here yet) waits for that job."""
        with self.cv:
            while True:
                if self.notice is not None and not self.notice[1]:
                    notice, self.notice = self.notice, None
                    return WEIGHTS, notice
                if self.queue:
                    return self.queue.popleft()
                self.cv.wait()

    def take(self, takes: int | None, wait: bool) -> int | None | bool:
        """The pending update a job in flight may load now: one to take now, or (``takes``: the version this job
        takes) that version or a newer one, deferred or not; with ``wait``, block until it comes (False: the
        trainer's end closed meanwhile). ``False`` when there is none."""
        with self.cv:
            while True:
                n = self.notice
                if n is not None and (not n[1] or (takes is not None and n[0] is not None and n[0] >= takes)):
                    self.notice = None
                    return n[0]
                if not wait or self.closed:
                    return False
                self.cv.wait()


class _WorkerGone(Exception):
    """The trainer's end closed while a job waited for an update: the worker stops."""


class _PartialJob:
    """A job's ``between_steps`` with partial rollouts (its ``(swap_step, takes)``): at each decode-step boundary an
    update to take now is loaded (``LLM.swap_weights``: the sequences in flight go on, their KV kept); with
    ``swap_step`` N > 0 the job takes version ``takes`` at its engine step N, waiting there for the notice, or after
    its end when it is shorter (``finish``). The hook may be called from a thread other than the serving loop's (an
    agent proxy's engine driver, ``polyrl.agents.remote``), and one whose window ended may still wait in it while
    the serving loop calls ``finish``: a lock makes the two one at a time, so the update is loaded once and
    ``finish``, after the waiting call loaded it, owes nothing."""

    def __init__(self, inbox: _Inbox, llm: Any, sync: BucketedBroadcast, swap_step: int, takes: int | None) -> None:
        self.inbox, self.llm, self.sync, self.swap_step, self.takes = inbox, llm, sync, swap_step, takes
        self.lock = threading.Lock()

    def _owed(self) -> bool:
        v = self.llm.policy_version
        return self.swap_step > 0 and self.takes is not None and (v is None or v < self.takes)

    def _load(self, version: int | None | bool) -> None:
        if version is False:
            raise _WorkerGone
        self.llm.swap_weights(self.sync.sync, version if version is not None else self.llm.policy_version)

    def __call__(self, llm: Any, steps: int) -> None:
        with self.lock:
            if steps == self.swap_step and self._owed():
                self._load(self.inbox.take(self.takes, wait=True))
            else:  # an update to take at once (swap_step 0; a restarted worker's first weights come before its jobs)
                version = self.inbox.take(None, wait=False)
                if version is not False:
                    self._load(version)

    def finish(self) -> None:
        with self.lock:
            if self._owed():  # a job shorter than swap_step: takes its update after its end, before it replies
                self._load(self.inbox.take(self.takes, wait=True))


def _serve(pg: Any, llm: Any, sync: BucketedBroadcast, ctx: WorkerContext, delay_s: float) -> None:
    """The worker's command loop (``worker_main``) until EXIT (or the trainer's end closing)."""
    inbox = _Inbox(pg)
    while True:
        cmd, payload = inbox.next()
        if cmd == EXIT:
            return
        if cmd == WEIGHTS:
            version = payload[0]
            if version is None:
                sync.sync()
                llm.reset_prefix_cache()
            else:  # partial rollouts: the engine stamps its tokens with the version of its weights
                llm.swap_weights(sync.sync, version)
            continue
        if cmd == CALL:  # a general job (an agentic run's episode loop): fn(ctx, items, *args) -> (results, meta)
            if isinstance(payload, RaisedInWorker):  # its function did not unpickle here: the error goes back
                _send_obj(pg, payload, 0)
                continue
            fn, items, args, partial = payload
            hook = _PartialJob(inbox, llm, sync, *partial) if partial is not None else None
            ctx.between_steps = hook
            try:
                with torch.no_grad():
                    # an empty share (partial rollouts: every replica gets the job that takes an update) runs nothing
                    reply = fn(ctx, items, *args) if items else ([], None)
            except _WorkerGone:
                return
            except Exception as exc:  # noqa: BLE001 - raised again in the trainer (a bug, not a dead replica)
                reply = raised_in_worker(exc)
            finally:
                ctx.between_steps = None
            try:
                if hook is not None:  # as for JOB: a job shorter than its swap step takes the update before replying
                    with torch.no_grad():
                        hook.finish()
            except _WorkerGone:
                return
            if delay_s:
                time.sleep(delay_s * len(items))
            _send_obj(pg, reply, 0)
            continue
        ids, plist, partial = payload
        hook = _PartialJob(inbox, llm, sync, *partial) if partial is not None else None
        try:
            with torch.no_grad():
                outs = llm.generate(ids, plist, between_steps=hook) if ids else []
                if hook is not None:
                    hook.finish()
        except _WorkerGone:
            return
        if delay_s:
            time.sleep(delay_s * len(ids))
        reply = [
            (list(o.prompt_token_ids), [
                (c.index, list(c.token_ids), list(c.logprobs), c.finish_reason, c.text,
                 getattr(c, "masked_logmass", None), c.token_versions)
                for c in o.outputs
            ])
            for o in outs
        ]  # fmt: skip
        _send_obj(pg, reply, 0)


__all__ = [
    "CALL",
    "EXIT",
    "HOST",
    "JOB",
    "JOIN_WAIT",
    "SLOW_REPLICA_ENV",
    "TAG_DATA",
    "TAG_HDR",
    "WEIGHTS",
    "RaisedInWorker",
    "WorkerContext",
    "WorkerSpec",
    "control_group",
    "raised_in_worker",
    "weights_group",
    "worker_main",
]
