"""The ``platform`` validation level: resolved platform with evidence, versions, device facts, ``polyrl check``.

Passes when ``polyrl check`` finds no FAIL row (the installation is ready) and a tensor op on the resolved
device gives the exact answer. WARN rows are listed, not failed. The data come from
``polyrl.validate.environment`` (the platform layer's probe, resolution and pitfalls); this module only turns
them into checks and a table. Not here: kernel numerics (the ``ops`` level).
"""

from __future__ import annotations

import argparse
from typing import Any

from polyrl.validate import environment
from polyrl.validate.result import check, level_result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own."""


def _smoke() -> tuple[bool, Any, str]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch

    from polyrl.platform import device

    dev = device.torch_device()
    try:
        x = torch.ones(64, 64, device=dev)
        value = float((x @ x).sum().item())
    except Exception as exc:  # noqa: BLE001 - a broken device is this check's answer
        return False, None, f"{type(exc).__name__}: {exc}"[:200]
    return value == 64.0**3, value, f"ones(64,64) @ ones(64,64) summed on {dev}"


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    from polyrl.platform import device

    env = environment.collect()
    plat, chk = env["platform"], env["check"]
    ok, value, detail = _smoke()
    counts = chk["counts"]
    problems = [f"{r['status']} {r['id']}: {r['title']}" for r in chk["rows"] if r["status"] in ("FAIL", "WARN")]
    checks = [
        check("polyrl check: no FAIL rows", chk["ready"], counts.get("FAIL", 0), "0 FAIL", ", ".join(problems)),
        check("tensor op on the device", ok, value, f"{64.0**3:g}", detail),
        check(
            "runtime device type matches the platform",
            device.device_type() == plat["device_type"],
            device.device_type(),
            plat["device_type"],
        ),
    ]
    metrics = {
        "platform": f"{plat['name']} ({plat['id']})",
        "confidence": plat["confidence"],
        "evidence": plat["evidence"],
        "device_type": device.device_type(),
        "device_count": device.count(),
        "devices": [d["name"] for d in env["devices"]],
        "check_counts": counts,
        "bf16": device.supports_bf16(),
        "collective_backend": device.collective_backend(),
    }
    return level_result("platform", checks, metrics, check_rows=chk["rows"])
