"""The validation environment: what the report's header says about this machine, gathered once per process.

Reuses the platform layer (``probe.collect`` -> ``resolve`` -> ``pitfalls.evaluate`` and the ``polyrl env`` /
``polyrl check`` documents) and adds what a compatibility report quotes: versions (python, torch, the Triton
distribution that provides ``triton`` and its backends, transformers, the device runtime and driver), the
devices and a slug that names the device in ``compat/`` file names.

Not here: judging the installation (``pitfalls``), any device work (levels do that).
"""

from __future__ import annotations

import functools
import os
import platform as _pyplatform
import re
from typing import Any

from polyrl import __version__
from polyrl.platform import pitfalls, probe, report, resolve
from polyrl.validate import smi


@functools.lru_cache(maxsize=1)
def collect() -> dict[str, Any]:
    """``{"env": polyrl.env/1 doc without its snapshot, "check": polyrl.check/1 doc, "versions", "devices",
    "platform", "machine"}`` for this machine (cached: the torch probe subprocess runs once)."""
    snap = probe.collect(deep=False)
    res = resolve.resolve(snap)
    env_doc = report.env_report(snap, res)
    env_doc.pop("snapshot", None)
    check_doc = report.check_report(snap, res, pitfalls.evaluate(snap, res))
    return {
        "env": env_doc,
        "check": check_doc,
        "platform": env_doc["platform"],
        "versions": versions(env_doc),
        "devices": devices(),
        "machine": machine(),
    }


def _dist_version(env_doc: dict[str, Any], name: str) -> str | None:
    for pkg in env_doc.get("vendor_packages", []):
        if pkg["name"] == name:
            return pkg["version"]
    return None


def versions(env_doc: dict[str, Any]) -> dict[str, Any]:
    # lazy: torch loads only when the report is gathered (validate modules stay torch-free on import)
    import torch

    providers = env_doc.get("triton") or []
    triton = None
    if providers:
        p = providers[0]
        triton = {"version": p["version"], "provider": p["dist"], "backends": list(p.get("backends") or [])}
    return {
        "polyrl": __version__,
        "python": _pyplatform.python_version(),
        "torch": torch.__version__,
        "triton": triton,
        "transformers": _dist_version(env_doc, "transformers"),
        "runtime": {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)},
        "driver": smi.driver_version(env_doc["platform"]["id"]),
        "collective_backend": env_doc["collectives"]["expected"],
    }


def devices() -> list[dict[str, Any]]:
    """Device facts from ``polyrl.platform.device`` (the CPU gives one entry with its processor name)."""
    # lazy: torch loads only when the report is gathered (validate modules stay torch-free on import)
    from polyrl.platform import device

    if device.device_type() == "cpu":
        return [{"index": 0, "type": "cpu", "name": device.name(), "cores": os.cpu_count()}]
    out = []
    current = device.current_index()
    for i in range(device.count()):
        entry: dict[str, Any] = {"index": i, "type": device.device_type(), "name": device.name(i)}
        cap = device.capability(i)
        entry["capability"] = f"{cap[0]}.{cap[1]}" if cap else None
        if i == current:
            free, total = device.mem_get_info()
            entry["total_memory_bytes"] = total or None
        out.append(entry)
    return out


def machine() -> dict[str, Any]:
    return {"os": _pyplatform.platform(), "arch": _pyplatform.machine(), "system": _pyplatform.system()}


def slug(text: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200`` (lower case, runs of other characters become one dash)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_slug(devs: list[dict[str, Any]]) -> str:
    return slug(devs[0]["name"]) if devs else "unknown"
