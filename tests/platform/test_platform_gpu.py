"""On an accelerator machine (the H200): the real probe, resolution and check, and the snapshot as a fixture.

Run:  POLYRL_SNAPSHOT_OUT=tests/fixtures/platform/real/h200.json .venv/bin/python -m pytest -m gpu \
      tests/platform/test_platform_gpu.py -q
The written file is a `polyrl env --json --deep` document; test_platform_resolve replays every file in
tests/fixtures/platform/real/ on CPU and requires the same platform and no FAIL.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polyrl.platform import pitfalls, probe, report, resolve


@pytest.mark.gpu
def test_real_accelerator_snapshot():
    snap = probe.collect(deep=True)
    res = resolve.resolve(snap)
    doc = report.env_report(snap, res)
    out = os.environ.get("POLYRL_SNAPSHOT_OUT")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report.to_json(doc) + "\n")
    rt = snap["torch_runtime"]
    assert rt["ok"], rt.get("error")
    assert rt["device_type"] != "cpu" and rt["count"] >= 1
    assert res.platform not in ("cpu", "cuda-compatible") and res.confidence == "high", res.to_dict()
    assert rt["smoke"]["ok"], rt["smoke"]
    rows = pitfalls.evaluate(snap, res)
    assert pitfalls.ready(rows), [(r.id, r.message) for r in rows if r.status == "FAIL"]
    name = rt["devices"][0]["name"]
    if "H200" in name:
        assert res.platform == "nvidia"
        assert rt["devices"][0]["capability"] == [9, 0] and "nccl" in rt["collectives"] and rt["bf16"] is True
        assert "nvidia-smi" in snap["smi"] and "CUDA Version" in (snap["smi"]["nvidia-smi"]["header"] or "")
