"""Trainer -> rollout weights: the one module that moves the trained weights into a rollout engine's tensors.

- ``sync_tensors(model, lora_only)``: what a sync moves, in a fixed order both sides agree on: every parameter and
  buffer (``named_parameters`` + ``named_buffers``; a tied tensor once), or with ``lora_only`` the LoRA adapter
  tensors alone (``polyrl.models.lora.adapter_parameters``: the frozen base is already on the rollout side).
- ``InProcessSync(src, dst)``: a separate rollout copy in the same process (async RL's threaded producer):
  ``copy_`` into the copy's own tensors (dtype cast on the fly), no allocation.
- ``BucketedBroadcast(model, group, src, ...)``: the same tensors over a ``torch.distributed`` process group (NCCL
  between CUDA devices, gloo on the CPU). The tensors are packed, in order, into flat buckets of ``bucket_mb`` MiB
  (default 256) of the wire dtype, one ``broadcast`` per bucket, and unpacked into the receivers' tensors in place.
  Two bucket buffers alternate, so packing bucket k+1 overlaps the broadcast of bucket k. A tensor larger than a
  bucket is sent alone, straight from (and into) the tensor when it is contiguous and already in the wire dtype.
  Wire dtype: ``bf16`` or ``fp32`` for floating parameters (default ``auto``: the dtype of the local floating
  parameters, i.e. the rollout's; the sender must be given the rollout's dtype); buffers and integer tensors
  travel in their own dtype. Every side builds the bucket plan from its own model; the first sync compares a
  fingerprint of the plans and raises on a mismatch (different shapes, dtypes or tensor sets).
- A progress deadline (``deadline_s``, default None: none): on a gloo group every wait of a sync (the plan check,
  each bucket's broadcast) must end within ``deadline_s`` of when this side started waiting for it, else the sync
  raises ``SyncTimeout`` (gloo's timed ``Work.wait``): a peer that stopped (a hung process) is found in about
  ``deadline_s``, while a slow sync that makes progress bucket by bucket is not cut short. The group is unusable
  afterwards (the timed-out broadcast stays posted in it, its buffers kept alive in ``abandoned``); the caller
  drops the peer. NCCL groups refuse it (``ConfigError``): a broadcast whose peer hangs sits in this side's CUDA
  stream, a timed wait does not take it out (aborting the communicator would), and it is untested without 2 GPUs.
- ``SyncStats``: what a sync cost (``seconds``, ``bytes`` on the wire, ``gbps``); ``metrics()`` gives the step
  metrics ``weight_sync/seconds``, ``weight_sync/bytes``, ``weight_sync/gbps``.

Deliberately not here: who talks to whom (``rollout_workers`` builds a pair group per rollout replica, so a dead
replica breaks only its own group), sharded (FSDP2) sources (``polyrl.train.parallel.sync_rollout_weights``
all-gathers those into the plain rollout copy on every rank; under torchrun rank 0 broadcasts that copy to its
rollout workers, ``ColocatedPolicy.push_source``), and any recovery of a broadcast that fails halfway (the caller
drops that receiver, and ``rollout_workers`` restarts it with new groups).
"""

from __future__ import annotations

import datetime
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyrl.errors import ConfigError

DEFAULT_BUCKET_MB = 256
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class SyncStats:
    """One sync: wall seconds (device work finished), payload bytes moved, tensors moved."""

    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self, prefix: str = "weight_sync") -> dict[str, float]:
        return {f"{prefix}/seconds": self.seconds, f"{prefix}/bytes": float(self.bytes), f"{prefix}/gbps": self.gbps}

    def __add__(self, other: SyncStats) -> SyncStats:
        return SyncStats(self.seconds + other.seconds, self.bytes + other.bytes, self.tensors + other.tensors)


def sync_tensors(model: nn.Module, lora_only: bool = False) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_buffer)`` of what a sync moves, in module order (see the module docstring)."""
    named = [(n, t, False) for n, t in model.named_parameters()] + [(n, t, True) for n, t in model.named_buffers()]
    if not lora_only:
        return named
    # lazy: only LoRA syncs need the adapter lookup
    from polyrl.models.lora import adapter_parameters

    adapters = {id(t) for t in adapter_parameters(model).values()}
    if not adapters:
        raise ConfigError("a LoRA-only weight sync needs a model with LoRA adapters; this one has none")
    return [(n, t, b) for n, t, b in named if id(t) in adapters]


def wire_dtype(setting: str | torch.dtype | None, model: nn.Module) -> torch.dtype:
    """The wire dtype of floating parameters: ``bf16`` / ``fp32`` / a dtype, or ``auto`` / None = the dtype of the
    model's floating parameters (the first one)."""
    if isinstance(setting, torch.dtype):
        return setting
    if setting in (None, "auto"):
        for t in model.parameters():
            if t.is_floating_point():
                return t.dtype
        return torch.float32
    if setting not in WIRE_DTYPES:
        raise ConfigError(f"weight sync dtype must be auto, bf16 or fp32, got {setting!r}")
    return WIRE_DTYPES[setting]


def is_gloo(group: Any) -> bool:
    """Whether ``group`` runs on gloo (a ``ProcessGroupGloo``, or a ``ProcessGroup`` whose backend is gloo)."""
    if isinstance(group, dist.ProcessGroupGloo):
        return True
    name = getattr(group, "name", None)
    return callable(name) and name() == "gloo"


def _sync_device(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        mod = getattr(torch, t.device.type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize(t.device)


def _copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i: one fused launch where the device has it, a loop otherwise."""
    if not dst:
        return
    try:
        torch._foreach_copy_(list(dst), list(src))
    except (RuntimeError, TypeError, NotImplementedError):  # mixed devices / dtypes on some backends
        for d, s in zip(dst, src):
            d.copy_(s)


class InProcessSync:
    """Copy ``src``'s parameters and buffers into ``dst``'s own tensors (matched by name), in place."""

    def __init__(self, src: nn.Module, dst: nn.Module, lora_only: bool = False) -> None:
        source = {n: t for n, t, _ in sync_tensors(src, lora_only)}
        self.dst, self.src = [], []
        for n, t, _ in sync_tensors(dst, lora_only):
            if n not in source or source[n].shape != t.shape:
                got = tuple(source[n].shape) if n in source else "nothing"
                raise ValueError(f"weight sync: the rollout copy's {n} {tuple(t.shape)} has {got} in the trainer")
            self.dst.append(t)
            self.src.append(source[n])
        self.nbytes = sum(t.numel() * t.element_size() for t in self.dst)

    @torch.no_grad()
    def sync(self) -> SyncStats:
        t0 = time.perf_counter()
        _copy_all(self.dst, self.src)
        if self.dst:
            _sync_device(self.dst[0])
        return SyncStats(time.perf_counter() - t0, self.nbytes, len(self.dst))


@dataclass(frozen=True)
class Bucket:
    """One broadcast: tensors ``items`` (indices into the sync's list) at ``offsets`` of a flat ``dtype`` buffer."""

    dtype: torch.dtype
    items: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


def plan_buckets(tensors: Sequence[tuple[torch.Size, torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Buckets over ``(shape, wire dtype)`` in order: consecutive tensors of one wire dtype share a bucket up to
    ``bucket_bytes``; a tensor larger than that is a bucket alone. Pure: both sides compute the same plan."""
    out: list[Bucket] = []
    cur: list[int] = []
    offs: list[int] = []
    cur_dtype: torch.dtype | None = None
    filled = 0

    def close() -> None:
        nonlocal cur, offs, filled
        if cur:
            out.append(Bucket(cur_dtype, tuple(cur), tuple(offs), filled))  # type: ignore[arg-type]
        cur, offs, filled = [], [], 0

    for i, (shape, dt) in enumerate(tensors):
        n = shape.numel()
        size = torch.empty(0, dtype=dt).element_size()
        if n * size > bucket_bytes:  # oversize: alone
            close()
            out.append(Bucket(dt, (i,), (0,), n))
            continue
        if dt != cur_dtype or (filled + n) * size > bucket_bytes:
            close()
            cur_dtype = dt
        cur.append(i)
        offs.append(filled)
        filled += n
    close()
    return out


class SyncTimeout(RuntimeError):
    """A sync's wait passed its ``deadline_s`` (the peer is not taking part: hung, or gone without closing);
    ``what``: the transfer that did not complete (``"bucket 3 of 40 (1048576 bytes)"``, ``"the plan check"``)."""

    def __init__(self, what: str, deadline_s: float) -> None:
        super().__init__(f"weight sync: {what} did not complete within deadline_s = {deadline_s:g} s (the peer hangs)")
        self.what, self.deadline_s = what, deadline_s


@dataclass
class _Flight:
    work: Any
    bucket: Bucket
    buf: torch.Tensor
    direct: bool
    k: int = 0  # the bucket's index in the plan


@dataclass
class BucketedBroadcast:
    """Broadcast ``model``'s sync tensors from rank ``src`` of ``group`` (a ``torch.distributed`` process group or
    backend: ``ProcessGroupGloo`` / ``ProcessGroupNCCL``) to every other rank, bucketed (module docstring).

    ``rank``: this process's rank in ``group``; ``device``: where the bucket buffers live (the CPU for gloo, this
    process's CUDA device for NCCL); ``dtype``: the wire dtype of floating parameters (``auto`` / ``bf16`` /
    ``fp32``; the sender passes the rollout's)."""

    model: nn.Module
    group: Any
    src: int
    rank: int
    device: torch.device | str = "cpu"
    dtype: str | torch.dtype | None = "auto"
    bucket_mb: float = DEFAULT_BUCKET_MB
    lora_only: bool = False
    deadline_s: float | None = None
    _checked: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ConfigError(f"weight sync bucket size must be > 0 MiB, got {self.bucket_mb}")
        self.device = torch.device(self.device)
        wire = wire_dtype(self.dtype, self.model)
        entries = sync_tensors(self.model, self.lora_only)
        self.tensors = [t for _, t, _ in entries]
        self.wire = [wire if (t.is_floating_point() and not is_buf) else t.dtype for _, t, is_buf in entries]
        self.bucket_bytes = int(self.bucket_mb * 2**20)
        self.buckets = plan_buckets([(t.shape, d) for t, d in zip(self.tensors, self.wire)], self.bucket_bytes)
        self.nbytes = sum(b.nbytes for b in self.buckets)
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.abandoned: list[Any] = []  # what a timed-out sync left posted in the group: kept alive, never reused
        self._check_deadline()

    def _check_deadline(self) -> None:
        d = self.deadline_s
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, int | float) or not d > 0:
            raise ConfigError(f"weight sync deadline_s must be a number of seconds > 0 (None: no deadline), got {d!r}")
        if not is_gloo(self.group):
            raise ConfigError(
                "weight sync deadline_s needs a gloo group (a timed wait does not free an NCCL broadcast whose peer "
                "hangs); leave it None on NCCL"
            )

    def _wait(self, work: Any, what: str, keep: Any) -> None:
        """Wait for ``work`` (``what``: for the error), at most ``deadline_s`` from now when it is set; on the
        deadline ``keep`` (the work's buffers) goes to ``abandoned`` and ``SyncTimeout`` is raised."""
        if self.deadline_s is None:
            work.wait()
            return
        try:
            # whole milliseconds (0 would mean no timeout)
            work.wait(datetime.timedelta(seconds=max(self.deadline_s, 0.001)))
        except RuntimeError as exc:
            if work.is_completed():  # it ended meanwhile: its own outcome (an error when the peer's connection closed)
                work.wait()
                return
            self.abandoned.append((work, keep))
            raise SyncTimeout(what, self.deadline_s) from exc

    @property
    def sending(self) -> bool:
        return self.rank == self.src

    def fingerprint(self) -> int:
        """A 63-bit hash of the plan (every tensor's shape and wire dtype, the bucket split)."""
        sig = repr([(tuple(t.shape), str(d)) for t, d in zip(self.tensors, self.wire)] + [self.bucket_bytes])
        return zlib.crc32(sig.encode()) | (len(self.tensors) << 32)

    def _broadcast(self, t: torch.Tensor) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.src
        return self.group.broadcast([t], opts)

    def _check_plan(self) -> None:
        """First sync: every rank must have built the same plan (else the buckets would be mis-assigned)."""
        mine = self.fingerprint()
        t = torch.tensor([mine, -mine], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        # [max, -min]: every rank learns whether any plan differs
        self._wait(self.group.allreduce([t], opts), "the plan check", t)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(
                "weight sync: the trainer's and this rollout model's tensors differ (shapes, dtypes or the set of "
                "tensors, e.g. LoRA adapters on one side only); load the same model folder with the same settings"
            )
        self._checked = True

    def _buffer(self, slot: int, b: Bucket) -> torch.Tensor:
        """Slot ``slot``'s reusable buffer of ``b``'s dtype (sized to the largest bucket of that dtype that fits the
        bucket size), or for an oversize tensor that cannot travel as it is, a buffer of its own for this sync."""
        if b.nbytes > self.bucket_bytes:
            return torch.empty(b.numel, dtype=b.dtype, device=self.device)
        key = (slot, b.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            cap = max(x.numel for x in self.buckets if x.dtype == b.dtype and x.nbytes <= self.bucket_bytes)
            buf = self._buffers[key] = torch.empty(cap, dtype=b.dtype, device=self.device)
        return buf[: b.numel]

    def _direct(self, b: Bucket) -> torch.Tensor | None:
        """The tensor itself when a bucket holds one tensor that can go on the wire as it is."""
        if len(b.items) != 1:
            return None
        t = self.tensors[b.items[0]]
        ok = t.is_contiguous() and t.dtype == b.dtype and t.device == self.device
        return t.view(-1) if ok else None

    def _views(self, b: Bucket, buf: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ts = [self.tensors[i] for i in b.items]
        views = [buf[o : o + t.numel()].view(t.shape) for o, t in zip(b.offsets, ts)]
        return ts, views

    def _finish(self, f: _Flight, pending: Sequence[_Flight] = ()) -> None:
        """Wait for ``f`` and unpack it (a receiver); ``pending``: the flights posted after it (kept with it on a
        timeout)."""
        self._wait(f.work, f"bucket {f.k + 1} of {len(self.buckets)} ({f.bucket.nbytes} bytes)", [f, *pending])
        if not self.sending and not f.direct:
            ts, views = self._views(f.bucket, f.buf)
            _copy_all(ts, views)  # unflatten into the rollout's own tensors (cast from the wire dtype)

    @torch.no_grad()
    def sync(self) -> SyncStats:
        """One sync (a collective: every rank of ``group`` calls it); the stats of this side. With ``deadline_s``:
        ``SyncTimeout`` when a wait passes it (the group is unusable afterwards)."""
        self._check_deadline()
        t0 = time.perf_counter()
        if not self._checked:
            self._check_plan()
        flights: list[_Flight] = []
        for k, b in enumerate(self.buckets):
            buf = self._direct(b)
            direct = buf is not None
            if buf is None:
                while len(flights) > 1:  # the buffer of slot k % 2 was bucket k-2's: finish it first
                    self._finish(flights.pop(0), flights)
                buf = self._buffer(k % 2, b)
                if self.sending:
                    ts, views = self._views(b, buf)
                    _copy_all(views, ts)  # flatten (cast to the wire dtype)
            flights.append(_Flight(self._broadcast(buf), b, buf, direct, k))
        for i, f in enumerate(flights):
            self._finish(f, flights[i + 1 :])
        if self.tensors:
            _sync_device(self.tensors[0])
        return SyncStats(time.perf_counter() - t0, self.nbytes, len(self.tensors))


__all__ = [
    "DEFAULT_BUCKET_MB",
    "WIRE_DTYPES",
    "Bucket",
    "BucketedBroadcast",
    "InProcessSync",
    "SyncStats",
    "SyncTimeout",
    "is_gloo",
    "plan_buckets",
    "sync_tensors",
    "wire_dtype",
]
