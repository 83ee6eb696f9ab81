"""The knowledge base loads, covers the platforms issue 2 names, and every platform and rule has fixtures."""

from __future__ import annotations

import json

import pytest
from _platform_fixtures import PITFALLS, SNAPSHOTS

from polyrl.platform import kb, pitfalls

REQUIRED = {
    "nvidia",
    "rocm",
    "hygon-dcu",
    "metax",
    "ppu",
    "ascend",
    "musa",
    "mlu",
    "xpu",
    "mps",
    "cpu",
    "cuda-compatible",
}


def test_required_platforms_present():
    assert REQUIRED <= set(kb.platforms())


def test_at_least_15_rules_each_with_a_check_and_next_step():
    rules = kb.rules()
    assert len(rules) >= 15
    assert {r.id for r in rules} == set(pitfalls.CHECKS), "rules and registered checks differ"
    for r in rules:
        assert r.next_step and r.message and r.severity in ("fail", "warn")


def test_every_platform_has_a_snapshot_fixture():
    missing = [pid for pid in kb.platforms() if not (SNAPSHOTS / f"{pid}.json").exists()]
    assert not missing, f"platforms without a snapshot fixture in {SNAPSHOTS}: {missing}"


def test_every_rule_has_a_firing_and_a_passing_fixture():
    missing = []
    for r in kb.rules():
        path = PITFALLS / f"{r.id}.json"
        if not path.exists():
            missing.append(r.id)
            continue
        case = json.loads(path.read_text())
        assert case["rule"] == r.id
        assert {"fires", "passes"} <= set(case), f"{path} needs both a 'fires' and a 'passes' case"
    assert not missing, f"rules without a fixture in {PITFALLS}: {missing}"


def test_no_stray_fixtures():
    rule_ids = {r.id for r in kb.rules()}
    assert {p.stem for p in PITFALLS.glob("*.json")} <= rule_ids
    assert {p.stem for p in SNAPSHOTS.glob("*.json")} <= set(kb.platforms())


def test_verified_flags_and_hedge():
    ppu = kb.platform("ppu")
    assert ppu.verified("device_name") and not ppu.verified("smi_tools")
    assert ppu.hedge("device_name") == "" and ppu.hedge("device_name", "smi_tools") == "reportedly "
    assert kb.platform("nvidia").unverified == frozenset()
    with pytest.raises(KeyError):
        ppu.verified("no_such_fact")
    with pytest.raises(KeyError, match="valid: nvidia"):
        kb.platform("nope")


def test_facts_from_the_seed():
    ascend, musa, metax = kb.platform("ascend"), kb.platform("musa"), kb.platform("metax")
    assert (ascend.device_type, ascend.collective_backend, ascend.vendor_extension) == ("npu", "hccl", "torch_npu")
    assert ascend.visible_devices == ("ASCEND_RT_VISIBLE_DEVICES",) and ascend.triton_dists == ("triton-ascend",)
    assert (musa.device_type, musa.collective_backend, musa.smi_tools) == ("musa", "mccl", ("mthreads-gmi",))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in musa.allocator_env
    assert metax.wheel_suffix_required and "/dev/mxcd" in metax.device_nodes
    assert kb.platform("rocm").torch_hip and kb.platform("rocm").device_type == "cuda"
    assert kb.platform("cuda-compatible").generic and kb.platform("cuda-compatible").device_type == "cuda"
