"""Placements of an online RL run: which devices hold the rollout replicas and which the trainer.

The settings are ``rollout_devices`` and ``train_devices`` of the algorithm's table (``[grpo]`` ...; flags
``--rollout-devices cuda:1,cuda:2 --train-devices cuda:0``). Empty ``rollout_devices`` is the default colocated
placement (the trainer's process rolls out: on the shared weights, or with ``async_producer = "thread"`` on a copy
of its own). Set, each listed device gets one rollout worker process (``rollout_workers``) with a whole rollout
engine, fed prompts by the trainer and weights by ``weight_sync`` (NCCL between CUDA devices, gloo otherwise); it
needs the process producer (``max_staleness >= 1``, ``async_producer = "process"``, checked by ``OnlineConfig``).

- ``parse_devices(spec)``: ``"cuda:1,cuda:2"`` -> devices; ``cpu`` may repeat (several CPU replicas); an
  accelerator may appear once over both lists; an index must exist on this machine.
- ``resolve_placement(rollout, train)`` -> ``Placement`` (validated; ``ConfigError`` says what to change).
- ``Placement.apply()``: makes the train device this process's current device (before the model loads).
- ``check_torchrun_rollout(placement)``: under torchrun, no rollout replica on a rank's own accelerator;
  ``check_torchrun_placement(...)``: that and no ``train_devices`` (also before a launch, from the settings).

Not here: spawning the workers (``rollout_workers``), moving weights (``weight_sync``), several train devices in
one process (data-parallel training is ``torchrun --nproc-per-node``; its ranks take devices 0..N-1 of the node,
so ``check_torchrun_rollout`` refuses rollout devices among those).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from polyrl.errors import ConfigError
from polyrl.platform import device

_DEVICE = re.compile(r"^(cpu|[a-z]+)(?::(\d+))?$")


def parse_devices(spec: str, what: str = "rollout_devices") -> list[torch.device]:
    """Devices of a comma list (``cpu``, ``cuda:1``; a bare accelerator type means index 0), checked against this
    machine: the type must be the CPU or this machine's accelerator, the index must exist."""
    out: list[torch.device] = []
    have = device.device_type()
    for item in (x.strip() for x in spec.split(",")):
        m = _DEVICE.match(item)
        if not item or m is None:
            raise ConfigError(f"{what}: {item!r} is not a device; write e.g. cuda:1,cuda:2 or cpu,cpu")
        kind, index = m.group(1), m.group(2)
        if kind == "cpu":
            if index not in (None, "0"):
                raise ConfigError(f"{what}: write cpu, not {item!r} (CPU replicas are listed as cpu,cpu)")
            out.append(torch.device("cpu"))
            continue
        i = int(index or 0)
        if kind != have:
            if have == "cpu":  # cpu:N is refused above: the one fix is cpu, repeated per replica
                raise ConfigError(
                    f"{what}: {item} does not exist on this machine (it has no accelerator); list cpu (cpu,cpu for "
                    "two CPU replicas)"
                )
            raise ConfigError(
                f"{what}: {item} does not exist on this machine (its accelerator is {have}); list cpu or {have}:N"
            )
        if i >= device.count():
            raise ConfigError(
                f"{what}: {item} does not exist: this machine has {device.count()} {have} device(s) "
                f"({have}:0..{have}:{device.count() - 1})"
            )
        out.append(torch.device(kind, i))
    return out


@dataclass(frozen=True)
class Placement:
    """``rollout``: one device per rollout replica (empty: colocated); ``train``: the trainer's device (None: the
    default one)."""

    rollout: tuple[torch.device, ...] = ()
    train: torch.device | None = None

    @property
    def colocated(self) -> bool:
        return not self.rollout

    def apply(self) -> None:
        """Make the train device current (an accelerator index), so the model loads there."""
        if self.train is not None and self.train.type != "cpu":
            device.set_device(self.train.index or 0)

    def describe(self) -> str:
        if self.colocated:
            return "colocated"
        train = str(self.train) if self.train is not None else "default device"
        return f"trainer on {train}, {len(self.rollout)} rollout replica(s) on {','.join(map(str, self.rollout))}"


def resolve_placement(rollout_devices: str = "", train_devices: str = "") -> Placement:
    """The validated placement of the two settings (see the module docstring)."""
    rollout = parse_devices(rollout_devices, "rollout_devices") if rollout_devices.strip() else []
    train = parse_devices(train_devices, "train_devices") if train_devices.strip() else []
    if len(train) > 1:
        raise ConfigError(
            f"train_devices lists {len(train)} devices; one trainer process trains on one device (several: "
            "torchrun --nproc-per-node, each rank on its own device, without train_devices): give one, e.g. "
            "--train-devices cuda:0"
        )
    if train and train[0].type == "cpu" and device.is_accelerator():
        raise ConfigError(
            f"train_devices = cpu on a machine with {device.device_type()} devices: the trainer follows the machine's "
            f"accelerator; give {device.device_type()}:N"
        )
    seen: dict[torch.device, str] = {}
    for what, devs in (("rollout_devices", rollout), ("train_devices", train)):
        for d in devs:
            if d.type == "cpu":
                continue
            if d in seen:
                raise ConfigError(
                    f"{d} is listed twice ({seen[d]} and {what}); each accelerator holds one rollout replica or "
                    "the trainer: list each device once"
                )
            seen[d] = what
    return Placement(tuple(rollout), train[0] if train else None)


def check_torchrun_placement(rollout_devices: str, train_devices: str, table: str, ranks: int | None = None) -> None:
    """The placement settings of a run under torchrun (``ranks`` local ranks; None: read from the environment), each
    refused with its fix: any ``ConfigError`` of ``resolve_placement``, ``train_devices`` (each rank takes its own
    device), a replica on a rank's device (``check_torchrun_rollout``). ``polyrl train --nproc-per-node N`` calls it
    before launching, so a bad placement is one error of the launcher rather than one per rank."""
    placement = resolve_placement(rollout_devices, train_devices)
    if placement.train is not None:
        n = f" (--nproc-per-node {ranks})" if ranks is not None else ""
        raise ConfigError(
            f"{table}.train_devices is for one-process runs; under torchrun{n} each rank takes its own device: drop "
            "--train-devices"
        )
    check_torchrun_rollout(placement, table, ranks)


def check_torchrun_rollout(placement: Placement, table: str = "grpo", ranks: int | None = None) -> None:
    """Under torchrun: the rollout replicas (``rollout_devices``, rank 0's worker processes) must not sit on a rank's
    own device. Local rank r binds accelerator r of this node (``LOCAL_WORLD_SIZE`` ranks: 0..N-1; ``ranks`` gives N
    before the launch), so an accelerator index below N is refused (``ConfigError`` with the fix); CPU replicas need
    no check."""
    if ranks is None:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    taken = [d for d in placement.rollout if d.type != "cpu" and (d.index or 0) < ranks]
    if taken:
        kind = taken[0].type
        raise ConfigError(
            f"{table}.rollout_devices lists {', '.join(map(str, taken))}, a rank's own device under torchrun "
            f"(--nproc-per-node {ranks}: local rank r trains on {kind}:r, {kind}:0..{kind}:{ranks - 1}); list the "
            f"devices after them (e.g. --rollout-devices {kind}:{ranks}), or lower --nproc-per-node"
        )


__all__ = ["Placement", "check_torchrun_placement", "check_torchrun_rollout", "parse_devices", "resolve_placement"]
