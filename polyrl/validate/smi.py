"""Device utilisation and driver version from the platform's smi tool, for the validation report.

Which tool a platform has comes from the knowledge base (``Platform.smi_tools``); how to ask a tool for a
number is the data table ``QUERIES`` below (tool name -> query -> arguments, output: one number or string per
device per line). A tool that is absent, or for which no query is known, gives ``None`` and a reason; nothing
here branches on vendor. ``UtilizationSampler`` polls in a background thread while a level trains.

Not here: probing the machine (``polyrl.platform.probe``), judging it (``pitfalls``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from typing import Any

from polyrl.platform import kb

QUERIES: dict[str, dict[str, list[str]]] = {
    "nvidia-smi": {
        "utilization": ["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
        "driver": ["--query-gpu=driver_version", "--format=csv,noheader"],
    },
}
TIMEOUT_S = 5.0


def find_tool(platform_id: str, query: str) -> tuple[str | None, str]:
    """(path of the platform's smi tool that answers ``query``, or None; reason when None)."""
    tools = kb.platform(platform_id).smi_tools
    if not tools:
        return None, f"the {platform_id} platform has no smi tool"
    for tool in tools:
        path = shutil.which(tool)
        if path and query in QUERIES.get(tool, {}):
            return path, ""
    known = [t for t in tools if query in QUERIES.get(t, {})]
    if not known:
        return None, f"no {query} query known for {', '.join(tools)}"
    return None, f"{', '.join(known)} not on PATH"


def _ask(path: str, query: str) -> list[str]:
    args = QUERIES[os.path.basename(path)][query]
    proc = subprocess.run([path, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def driver_version(platform_id: str) -> str | None:
    path, _ = find_tool(platform_id, "driver")
    if path is None:
        return None
    try:
        lines = _ask(path, "driver")
    except (OSError, subprocess.SubprocessError):
        return None
    return lines[0] if lines else None


class UtilizationSampler:
    """``with UtilizationSampler(platform_id, index) as s: ...``; then ``s.summary()`` gives mean/max percent
    of device ``index`` over the samples, or ``{"status": "skipped", "reason": ...}``."""

    def __init__(self, platform_id: str, index: int = 0, interval_s: float = 0.2) -> None:
        self.index = index
        self.interval_s = interval_s
        self.path, self.reason = find_tool(platform_id, "utilization")
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                lines = _ask(self.path, "utilization")  # type: ignore[arg-type]
                if len(lines) > self.index:
                    self.samples.append(float(lines[self.index].split()[0]))
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> UtilizationSampler:
        if self.path is not None:
            self._thread = threading.Thread(target=self._loop, name="polyrl-smi", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S + 1)

    def summary(self) -> dict[str, Any]:
        if self.path is None:
            return {"status": "skipped", "reason": self.reason}
        if not self.samples:
            return {"status": "skipped", "reason": "the smi tool returned no utilisation samples"}
        return {
            "status": "measured",
            "mean_percent": sum(self.samples) / len(self.samples),
            "max_percent": max(self.samples),
            "samples": len(self.samples),
        }
