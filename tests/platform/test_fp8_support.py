"""FP8 GEMM support: the rule on recorded facts (CUDA capability >= 8.9, ROCm gfx94x/gfx95x), the live check on this
machine, and the ``polyrl env`` line built from the probe's facts."""

from __future__ import annotations

import pytest
import torch

from polyrl.platform import device
from polyrl.platform.fp8 import fp8_gemm_from_facts
from polyrl.platform.report import env_report, env_text


@pytest.mark.parametrize(
    "facts, expected",
    [
        (("cuda", (9, 0)), True),  # H100 / H200
        (("cuda", [8, 9]), True),  # L40S / RTX 4090 (the probe records a list)
        (("cuda", (10, 0)), True),  # B200
        (("cuda", (8, 0)), False),  # A100
        (("cuda", (8, 6)), False),
        (("cuda", None), False),
        (("cpu", None), False),
        (("npu", (9, 0)), False),
        (("cuda", (9, 4), True, "gfx942:sramecc+:xnack-"), True),  # MI300X
        (("cuda", (9, 5), True, "gfx950"), True),  # MI350
        (("cuda", (9, 0), True, "gfx90a"), False),  # MI250: capability numbers mean nothing on ROCm
        (("cuda", (9, 4), True, None), False),
    ],
)
def test_fp8_rule(facts, expected):
    assert fp8_gemm_from_facts(*facts) is expected


def test_live_check_on_this_machine():
    cap = device.capability()
    expected = device.device_type() == "cuda" and (torch.version.hip is not None or (cap is not None and cap >= (8, 9)))
    if torch.version.hip is None:
        assert device.supports_fp8_gemm() is expected
    if device.device_type() == "cpu":
        assert device.supports_fp8_gemm() is False


def _doc(runtime):
    snap = {"torch_runtime": runtime, "torch_version_file": {"version": "2.11.0", "cuda": "12.8"}}
    res = __import__("polyrl.platform.resolve", fromlist=["resolve"]).resolve(snap)
    return env_report(snap, res)


def test_env_report_line():
    h200 = {"ok": True, "device_type": "cuda", "devices": [{"name": "NVIDIA H200", "capability": [9, 0]}]}
    a100 = {"ok": True, "device_type": "cuda", "devices": [{"name": "NVIDIA A100", "capability": [8, 0]}]}
    assert _doc(h200)["torch"]["fp8_gemm"] is True
    assert "fp8 gemm     yes (--precision fp8 runs)" in env_text(_doc(h200))
    assert _doc(a100)["torch"]["fp8_gemm"] is False
    assert "fp8 gemm     no (--precision fp8 is refused)" in env_text(_doc(a100))
    assert _doc({"ok": False, "error": "boom"})["torch"]["fp8_gemm"] is None
