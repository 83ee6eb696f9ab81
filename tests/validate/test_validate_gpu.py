"""`polyrl validate` on an accelerator (H200): every single-device level passes in bf16, with device numbers (the
``eval`` level's accuracy gate included: the engine's prompt log-probs against the reference forward in bf16).

Run on the GPU machine: ``python -m pytest tests/validate/test_validate_gpu.py -m gpu -q``. The multi-device
collectives test needs two or more devices (``-m multi_gpu``)."""

from __future__ import annotations

import argparse
import json

import pytest

from polyrl.platform import device


@pytest.mark.gpu
def test_validate_single_device_levels_in_bf16(tmp_path, capsys):
    from polyrl.cli.main import main

    if not device.is_accelerator():
        pytest.fail("marked gpu but no accelerator is visible")
    out = tmp_path / "v"
    levels_arg = "platform,ops,sft,rl,serve,eval"
    rc = main(["validate", "--preset", "tiny", "--levels", levels_arg, "--quick", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads((out / "report.json").read_text())
    levels = doc["levels"]
    assert list(levels) == levels_arg.split(",")
    assert {n: r["status"] for n, r in levels.items()} == dict.fromkeys(levels, "passed")
    assert levels["sft"]["metrics"]["compute_dtype"] == "bfloat16"
    assert levels["sft"]["metrics"]["peak_memory_bytes"] > 0
    assert levels["rl"]["metrics"]["compute_dtype"] == "bfloat16"
    assert levels["rl"]["metrics"]["logprob_mean_abs_diff"] < 0.05  # bf16 rollout vs trainer, reported
    assert levels["eval"]["metrics"]["compute_dtype"] == "bfloat16"
    gate = {c["name"]: c["status"] for c in levels["eval"]["checks"]}
    assert gate["same choice as the reference (margin > tolerance)"] == "pass"  # gated, not informational
    assert gate["per-request log-likelihood max abs diff"] == "pass"  # bf16: 0.05 per continuation token
    assert doc["versions"]["runtime"]["cuda"] or doc["versions"]["runtime"]["hip"]
    assert any(r["impl"] == "triton" and r["status"] == "pass" for r in levels["ops"]["rows"])


@pytest.mark.multi_gpu
def test_collectives_across_devices():
    from polyrl.validate import collectives

    if device.count() < 2:
        pytest.fail("marked multi_gpu but fewer than 2 devices are visible")
    result = collectives.run_level(argparse.Namespace(collectives_cpu_procs=0))
    assert result["status"] == "passed", result
    assert result["metrics"]["world_size"] == device.count() and result["metrics"]["all_reduce_busbw_gbps"] > 1
