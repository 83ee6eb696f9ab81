"""The process group of a data-parallel run: who am I (rank), how many are we, which device is mine.

``init_world()`` reads the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), binds this process to the accelerator of its local rank and starts the
default process group with the platform's collective backend (``device.collective_backend()``: nccl, hccl,
mccl, ...; gloo on the CPU). Without those variables it returns the single-process ``World`` and starts
nothing, so every caller can hold a ``World`` and ask ``world.distributed``.

The reductions here (``all_reduce_sum``, ``all_gather_object``, ``barrier``) are no-ops in one process.
They run on the default process group, or, within ``collectives_on(group)``, on ``group`` for the calling thread
only: async RL's producer thread (``polyrl.run.online``) generates and gathers rollouts on a gloo group of its own
(``World.new_group()``, made once on every rank in the same order) while the trainer's thread runs FSDP's
collectives on the default group, so the two streams of collectives never interleave on one group.
This module does not shard models (``fsdp.py``) or write checkpoints (``checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from polyrl.errors import ConfigError
from polyrl.platform import device

_GROUP = threading.local()  # the calling thread's group for World's collectives (collectives_on); unset: default


def _group() -> Any:
    return getattr(_GROUP, "group", None)


@contextlib.contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """Within the block, this thread's ``World`` collectives run on ``group`` (a gloo ``ProcessGroup``: their
    tensors live on the CPU); ``group`` None changes nothing. Other threads keep theirs."""
    before = _group()
    _GROUP.group = group if group is not None else before
    try:
        yield
    finally:
        _GROUP.group = before


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """This process's place in the run. ``distributed`` is True when a process group is up (also for a
    torchrun world of size 1, so the sharded code path and checkpoint format are the same at any size)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- collectives (no-ops in one process; on this thread's group, see collectives_on) ----------
    def new_group(self) -> Any:
        """A gloo process group over every rank (None in one process). Every rank must call it, in the same order
        as the other groups it makes."""
        return dist.new_group(backend="gloo") if self.distributed else None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=_group())

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (fp32/fp64/int tensors on ``self.device``; on the CPU
        within ``collectives_on``)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_group())
        return tensor

    def sum_float(self, value: float) -> float:
        """Sum a Python number over ranks (fp64, so token counts stay exact)."""
        if not self.distributed:
            return float(value)
        dev = self.device if _group() is None else torch.device("cpu")
        t = torch.tensor([float(value)], dtype=torch.float64, device=dev)
        return float(self.all_reduce_sum(t).item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``[obj of rank 0, obj of rank 1, ...]`` (picklable objects)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=_group())
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (``src``: the global rank; the groups here hold every rank)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=_group())
        return box[0]


def launched() -> bool:
    """True when this process was started by torchrun (or another launcher setting ``WORLD_SIZE``)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"{name} is not set; start the run with torchrun (see docs/distributed.md)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; check the launcher's environment") from None


def init_world(backend: str | None = None, timeout_s: float = 1800.0) -> World:
    """The ``World`` of this process: starts the default process group when launched by torchrun (or
    returns the existing one), else the single-process world. ``backend`` overrides the platform's."""
    if dist.is_available() and dist.is_initialized():
        return _current_world()
    if not launched():
        return World(device=device.torch_device())
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world_size}; check the launcher's environment")
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; install a build with distributed support")
    dev = _bind_device(local_rank)
    backend = backend or device.collective_backend()
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if dev.type != "cpu":
        kwargs["device_id"] = dev  # eager NCCL-style init bound to our device
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return World(rank, world_size, local_rank, backend, dev)


def _bind_device(local_rank: int) -> torch.device:
    if not device.is_accelerator():
        return torch.device("cpu")
    n = device.count()
    if local_rank >= n:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this node shows {n} device(s); use --nproc-per-node <= {n} "
            f"or check the visible-devices variable ({', '.join(device.visible_devices()) or 'none set'})"
        )
    device.set_device(local_rank)
    return device.torch_device(local_rank)


def _current_world() -> World:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cpu") if not device.is_accelerator() else device.torch_device(local_rank)
    return World(rank, world_size, local_rank, dist.get_backend(), dev)


def destroy_world(world: World) -> None:
    """Tear the process group down (call once at the end of a run; harmless in one process)."""
    if world.distributed:
        if dist.is_initialized():
            dist.destroy_process_group()
