"""The resolver on every platform fixture and on the hard cases of issue 2."""

from __future__ import annotations

import copy

import pytest
from _platform_fixtures import REAL, SNAPSHOTS, evaluate, load_base, merge

from polyrl.errors import UserError
from polyrl.platform import kb, resolve


def _recorded():
    cases = [(p.stem, p) for p in sorted(SNAPSHOTS.glob("*.json"))]
    return cases + [(None, p) for p in sorted(REAL.glob("*.json"))]


@pytest.mark.parametrize("expected,path", _recorded(), ids=lambda x: getattr(x, "name", str(x)))
def test_fixture_resolves_and_is_ready(expected, path):
    """Every platform fixture (and every real machine snapshot in fixtures/platform/real) resolves as recorded."""
    import json

    doc = json.loads(path.read_text())
    snap = doc.get("snapshot", doc)
    expected = expected or doc["platform"]["id"]
    res, rows = evaluate(snap)
    assert res.platform == expected, res.to_dict()
    assert res.confidence in ("high", "medium")
    assert res.evidence
    fails = [(r.id, r.message) for r in rows if r.status == "FAIL"]
    assert not fails, fails


def test_resolve_is_pure():
    snap = load_base("ppu")
    before = copy.deepcopy(snap)
    assert resolve.resolve(snap).platform == resolve.resolve(snap).platform == "ppu"
    assert snap == before


def test_ppu_is_not_nvidia_even_with_nvidia_smi_and_nodes():
    """PPU-ZW810E, capability 8.0, an nvidia-smi whose header is not the NVIDIA one, /dev/nvidia* nodes."""
    header = "+------+\n| PPU-SMI 1.6.0   Driver Version: 1.6.0   CUDA Version: 12.9 |"
    snap = merge(
        load_base("ppu"),
        {"deep": True, "smi": {"nvidia-smi": {"header": header}}, "device_nodes": ["/dev/nvidia0", "/dev/nvidiactl"]},
    )
    res = resolve.resolve(snap)
    assert res.platform == "ppu"
    assert res.scores["nvidia"] < 0 < res.scores["ppu"]
    assert any("PPU-ZW810E" in e for e in res.evidence)
    # a header that names no vendor still counts against NVIDIA; the device name decides
    anon = merge(snap, {"smi": {"nvidia-smi": {"header": "Accelerator SMI 3.1  CUDA Version: 12.9"}}})
    assert resolve.resolve(anon).platform == "ppu"


def test_real_nvidia_smi_header_supports_nvidia():
    header = "| NVIDIA-SMI 575.57.08     Driver Version: 575.57.08    CUDA Version: 12.9 |"
    snap = merge(load_base("nvidia"), {"deep": True, "smi": {"nvidia-smi": {"header": header}}})
    res = resolve.resolve(snap)
    assert res.platform == "nvidia" and res.confidence == "high"
    assert res.scores["nvidia"] > resolve.resolve(load_base("nvidia")).scores["nvidia"]


def test_unknown_cuda_device_is_cuda_compatible_even_with_nvidia_smi():
    snap = merge(load_base("cuda-compatible"), {"smi": {"nvidia-smi": {"path": "/usr/bin/nvidia-smi", "header": None}}})
    res = resolve.resolve(snap)
    assert res.platform == "cuda-compatible"
    assert kb.platform(res.platform).device_type == "cuda"  # the generic CUDA path


def test_hygon_vs_rocm():
    hygon, rocm = resolve.resolve(load_base("hygon-dcu")), resolve.resolve(load_base("rocm"))
    assert (hygon.platform, rocm.platform) == ("hygon-dcu", "rocm")
    assert hygon.scores["rocm"] < hygon.scores["hygon-dcu"] and rocm.scores["hygon-dcu"] < rocm.scores["rocm"]
    # a Hygon box whose torch cannot see the devices still resolves by nodes, smi tool, DTK path and wheel label
    blind = merge(load_base("hygon-dcu"), {"torch_runtime": {"device_type": "cpu", "count": 0, "devices": []}})
    assert resolve.resolve(blind).platform == "hygon-dcu"
    assert any("unverified" in e for e in resolve.resolve(blind).evidence)


def test_ascend_with_cuda_alias_shims_is_ascend():
    snap = merge(
        load_base("ascend"),
        {
            "loaded_shims": ["torch_npu.contrib.transfer_to_npu"],
            "torch_runtime": {"cuda_available": True, "cuda_alias": True},
        },
    )
    res, rows = evaluate(snap)
    assert res.platform == "ascend"
    shim = next(r for r in rows if r.id == "cuda-alias-shim")
    assert shim.status == "WARN" and "transfer_to_npu" in shim.message and "'npu'" in shim.message


def test_musa_with_public_torch_is_musa_and_not_ready():
    snap = merge(
        load_base("musa"),
        {
            "distributions": {"torch": {"version": "2.9.1+cu128", "local": "cu128"}},
            "torch_version_file": {"version": "2.9.1+cu128", "cuda": "12.8"},
            "torch_runtime": {"version": "2.9.1+cu128", "device_type": "cpu", "count": 0, "devices": []},
        },
    )
    res, rows = evaluate(snap)
    assert res.platform == "musa"
    statuses = {r.id: r.status for r in rows}
    assert statuses["vendor-torch-replaced"] == "FAIL"
    assert statuses["accelerator-invisible"] == "OK"  # the replaced torch is the cause, reported once


def test_polyrl_platform_overrides_and_rejects_unknown():
    snap = merge(load_base("cpu"), {"env": {"POLYRL_PLATFORM": "ppu"}})
    res = resolve.resolve(snap)
    assert (res.platform, res.confidence) == ("ppu", "forced")
    with pytest.raises(UserError, match="POLYRL_PLATFORM='tpu'.*nvidia, rocm"):
        resolve.resolve(merge(load_base("cpu"), {"env": {"POLYRL_PLATFORM": "tpu"}}))


def test_torch_import_failure_still_resolves_from_hardware():
    snap = merge(load_base("nvidia"), {"torch_runtime": {"ok": False, "error": "ImportError: boom"}})
    res = resolve.resolve(snap)
    assert res.platform == "nvidia"
    nothing = merge(load_base("cpu"), {"torch_runtime": {"ok": False, "error": "ImportError: boom"}})
    assert resolve.resolve(nothing).to_dict()["platform"] == "cpu" and resolve.resolve(nothing).confidence == "low"


def test_mps_needs_darwin():
    linux = merge(load_base("mps"), {"os": {"system": "Linux"}})
    assert "mps" not in resolve._score(linux).table  # an OS the platform does not exist on excludes it
