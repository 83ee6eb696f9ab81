"""The probe on real mechanisms: fake *.dist-info directories and packages on an injected path, fake smi scripts on
PATH, fake device nodes under an injected root, fake modules in sys.modules, and a torch subprocess that imports a
fake torch, fails to import, hangs, or (with the real torch) fails to auto-load a device-backend plugin."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path

import pytest

from polyrl.platform import pitfalls, probe, resolve

FAKE_TORCH = '''"""A stand-in torch for probe tests: just the attributes the probe subprocess reads."""
import types

__version__ = {version!r}


class _T:
    def __matmul__(self, other):
        return self

    def sum(self):
        return self

    def item(self):
        return 262144.0


def ones(*args, **kwargs):
    return _T()


def _device(names, cap, mem):
    return types.SimpleNamespace(
        is_available=lambda: bool(names),
        device_count=lambda: len(names),
        get_device_name=lambda i: names[i],
        get_device_capability=lambda i: cap,
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=mem),
        is_bf16_supported=lambda: True,
    )


cuda = _device({cuda_names!r}, (8, 0), 96 * 2**30)
{vendor_line}
backends = types.SimpleNamespace(mps=None)
'''
FAKE_DIST = """is_available = lambda: True
is_gloo_available = lambda: True


class Backend:
    backend_list = {backends!r}
"""


def write_dist(site: Path, name: str, version: str, files=(), top_level=None, entry_points=None) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    if top_level:
        (info / "top_level.txt").write_text(top_level + "\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


def write_torch(site: Path, version: str, cuda=None, cuda_names=(), vendor=None, backends=("gloo",)) -> None:
    pkg = site / "torch"
    pkg.mkdir(parents=True)
    vendor_line = ""
    if vendor:
        vname, vnames = vendor
        vendor_line = f"{vname} = _device({list(vnames)!r}, None, 64 * 2**30)"
    (pkg / "__init__.py").write_text(
        FAKE_TORCH.format(version=version, cuda_names=list(cuda_names), vendor_line=vendor_line)
    )
    (pkg / "distributed.py").write_text(FAKE_DIST.format(backends=list(backends)))
    (pkg / "version.py").write_text(
        f"__version__ = {version!r}\ndebug = False\ncuda = {cuda!r}\nhip = None\ngit_version = 'abc123'\n"
    )
    write_dist(site, "torch", version, files=["torch/__init__.py", "torch/version.py"])


def write_smi(bindir: Path, tool: str, header: str) -> None:
    bindir.mkdir(exist_ok=True)
    script = bindir / tool
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' '{header}'\n")  # a shell builtin: PATH holds only the fakes
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def make_root(tmp: Path, nodes=(), dirs=()) -> Path:
    root = tmp / "root"
    for node in nodes:
        (root / node.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / node.lstrip("/")).touch()
    for d in dirs:
        (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    root.mkdir(exist_ok=True)
    return root


def base_env(tmp: Path, site: Path, **extra: str) -> dict[str, str]:
    env = {"PATH": str(tmp / "bin"), "PYTHONPATH": str(site), "HOME": str(tmp)}
    env.update(extra)
    return env


def collect(tmp: Path, site: Path, env: dict[str, str], root: Path, **kw):
    return probe.collect(env, [str(site)], root=str(root), cwd=str(tmp), home=str(tmp), **kw)


def test_fake_ascend_machine_end_to_end(tmp_path):
    site = tmp_path / "site"
    write_torch(site, "2.10.0", vendor=("npu", ["Ascend910B2", "Ascend910B2"]), backends=["gloo", "hccl"])
    write_dist(site, "torch-npu", "2.10.0.post4", files=["torch_npu/__init__.py"])
    (site / "torch_npu").mkdir()
    (site / "torch_npu" / "__init__.py").write_text("")
    # two Triton distributions sharing the namespace: upstream (RECORD) and the Ascend fork (top_level.txt)
    write_dist(site, "triton", "3.2.0", files=["triton/__init__.py", "triton/backends/nvidia/__init__.py"])
    write_dist(site, "triton-ascend", "3.2.2", top_level="triton")
    write_smi(tmp_path / "bin", "npu-smi", "+------ npu-smi 24.1.0   Version: 24.1.0 ------+")
    root = make_root(
        tmp_path, nodes=["/dev/davinci0", "/dev/davinci1", "/dev/davinci_manager"], dirs=["/usr/local/Ascend"]
    )
    env = base_env(tmp_path, site, ASCEND_HOME_PATH="/usr/local/Ascend/ascend-toolkit/latest", CUDA_VISIBLE_DEVICES="0")
    snap = collect(
        tmp_path, site, env, root, deep=True, modules={"torch_npu.contrib.transfer_to_npu": types.ModuleType("x")}
    )

    assert snap["device_nodes"] == ["/dev/davinci0", "/dev/davinci1", "/dev/davinci_manager"]
    assert snap["sdk_paths"] == ["/usr/local/Ascend"]
    assert "npu-smi 24.1.0" in snap["smi"]["npu-smi"]["header"]
    assert snap["distributions"]["torch-npu"]["version"] == "2.10.0.post4"
    assert sorted(p["dist"] for p in snap["triton_providers"]) == ["triton", "triton-ascend"]
    assert next(p for p in snap["triton_providers"] if p["dist"] == "triton")["backends"] == ["nvidia"]
    assert snap["modules"]["torch_npu"]["found"] and not snap["modules"]["torch_musa"]["found"]
    assert snap["loaded_shims"] == ["torch_npu.contrib.transfer_to_npu"]
    assert snap["torch_version_file"]["version"] == "2.10.0"
    rt = snap["torch_runtime"]
    assert rt["ok"] and rt["device_type"] == "npu" and rt["count"] == 2 and rt["collectives"] == ["gloo", "hccl"]
    assert rt["smoke"]["ok"] and rt["devices"][0]["total_memory"] == 64 * 2**30
    assert snap["env"] == {"ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/latest", "CUDA_VISIBLE_DEVICES": "0"}
    assert snap["compilers"] == {}

    res = resolve.resolve(snap)
    assert res.platform == "ascend" and res.confidence == "high"
    status = {r.id: r.status for r in pitfalls.evaluate(snap, res)}
    assert status["triton-multiple-providers"] == "FAIL"
    assert status["cuda-alias-shim"] == "WARN"
    assert status["foreign-visible-devices"] == "WARN"
    assert status["no-compiler-for-triton"] == "WARN"
    assert status["vendor-extension-mismatch"] == status["sdk-env-not-sourced"] == status["device-smoke-failed"] == "OK"


def test_ppu_mechanism_is_not_nvidia(tmp_path):
    """A PPU image: torch.cuda answers with PPU-ZW810E, capability 8.0; nvidia-smi exists with its own header."""
    site = tmp_path / "site"
    write_torch(site, "2.8.0", cuda="12.9", cuda_names=["PPU-ZW810E"] * 4, backends=["gloo", "nccl"])
    write_dist(site, "triton", "3.4.0", files=["triton/__init__.py", "triton/backends/nvidia/__init__.py"])
    write_smi(tmp_path / "bin", "nvidia-smi", "| PPU-SMI 1.6.0    Driver Version: 1.6.0    CUDA Version: 12.9 |")
    root = make_root(tmp_path)
    snap = collect(tmp_path, site, base_env(tmp_path, site), root, deep=True)
    dev = snap["torch_runtime"]["devices"][0]
    assert (dev["name"], dev["capability"]) == ("PPU-ZW810E", [8, 0])
    res = resolve.resolve(snap)
    assert res.platform == "ppu" and res.scores["nvidia"] < 0
    rows = pitfalls.evaluate(snap, res)
    text = " ".join(r.message + r.next_step + r.title for r in rows) + " ".join(res.evidence)
    assert "NVIDIA" not in text
    assert {r.id: r.status for r in rows}["driver-older-than-runtime"] == "OK"


def test_musa_torch_replaced_by_public_wheel(tmp_path):
    site = tmp_path / "site"
    write_torch(site, "2.9.1+cu128", cuda="12.8", backends=["gloo", "nccl"])  # public wheel: no MUSA device
    write_dist(site, "torch-musa", "2.9.1+musa5.2.0", files=["torch_musa/__init__.py"])
    (site / "torch_musa").mkdir()
    (site / "torch_musa" / "__init__.py").write_text("")
    write_smi(tmp_path / "bin", "mthreads-gmi", "mthreads-gmi: version 2.1.0")
    root = make_root(tmp_path, nodes=["/dev/mtgpu0", "/dev/mtgpu1"])
    snap = collect(tmp_path, site, base_env(tmp_path, site), root)
    assert snap["torch_runtime"]["device_type"] == "cpu"
    res = resolve.resolve(snap)
    assert res.platform == "musa"
    rows = {r.id: r for r in pitfalls.evaluate(snap, res)}
    assert rows["vendor-torch-replaced"].status == "FAIL" and "2.9.1+cu128" in rows["vendor-torch-replaced"].message
    assert not pitfalls.ready(list(rows.values()))


def test_import_torch_failure_is_reported_not_raised(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        "raise ImportError('libcudart.so.12: cannot open shared object file: No such file or directory')\n"
    )
    (site / "torch" / "version.py").write_text("__version__ = '2.7.1+cu126'\ncuda = '12.6'\nhip = None\n")
    write_dist(site, "torch", "2.7.1+cu126")
    snap = collect(
        tmp_path, site, base_env(tmp_path, site), make_root(tmp_path, nodes=["/dev/nvidia0", "/dev/nvidiactl"])
    )
    rt = snap["torch_runtime"]
    assert rt["ok"] is False and "libcudart.so.12" in rt["error"]
    assert snap["torch_version_file"]["cuda"] == "12.6"  # read as text even though import fails
    res = resolve.resolve(snap)
    assert res.platform == "nvidia"
    row = next(r for r in pitfalls.evaluate(snap, res) if r.id == "torch-import-failed")
    assert row.status == "FAIL" and "libcudart.so.12" in row.message


def test_torch_probe_timeout(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    rt = probe.probe_torch_runtime(base_env(tmp_path, site), timeout=1.0)
    assert rt["ok"] is False and rt["timed_out"] is True and "within 1 s" in rt["error"]


def test_plugin_autoload_failure_with_real_torch(tmp_path):
    """The real torch auto-loads `torch.backends` entry points; a broken plugin makes `import torch` fail."""
    pytest.importorskip("torch")
    site = tmp_path / "site"
    site.mkdir()
    (site / "brokenplug.py").write_text(
        "def autoload():\n    raise ImportError('libbrokenplug.so: undefined symbol: _ZN3c1010TensorImpl')\n"
    )
    write_dist(site, "brokenplug", "0.1", entry_points="[torch.backends]\nbrokenplug = brokenplug:autoload\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    rt = probe.probe_torch_runtime(env)
    assert rt["ok"] is False and "brokenplug" in rt["error"]
    snap = {"torch_runtime": rt, "env": {}, "python": {"version": "3.11.0"}}
    rows = {r.id: r for r in pitfalls.evaluate(snap, resolve.resolve(snap))}
    row = rows["torch-plugin-autoload-failed"]
    assert row.status == "FAIL" and "'brokenplug'" in row.message and "undefined symbol" in row.message
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in row.next_step and rows["torch-import-failed"].status == "OK"
    # the suggestion works: with auto-loading off, torch imports
    assert probe.probe_torch_runtime(dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))["ok"] is True


def test_loaded_shims_read_from_sys_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchada", types.ModuleType("torchada"))
    assert probe.probe_loaded_shims(sys.modules) == ["torchada"]
    monkeypatch.delitem(sys.modules, "torchada")
    assert probe.probe_loaded_shims(sys.modules) == []


def test_env_records_only_relevant_variables():
    env = {"CUDA_VISIBLE_DEVICES": "0", "SECRET_TOKEN": "x", "POLYRL_KERNELS": "reference", "MUSA_HOME": "/m"}
    assert probe.probe_env(env) == {"CUDA_VISIBLE_DEVICES": "0", "MUSA_HOME": "/m", "POLYRL_KERNELS": "reference"}


def test_writable_checks_nearest_existing_parent(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        out = probe.probe_writable({"TRITON_CACHE_DIR": str(ro / "a" / "b")}, cwd=str(tmp_path), home=str(tmp_path))
        writable_ro = os.access(ro, os.W_OK)  # root ignores permission bits
        assert out["triton_cache"]["writable"] is writable_ro
        assert out["hf_cache"]["writable"] is True and out["output"]["writable"] is True
    finally:
        ro.chmod(0o755)


def test_local_label():
    assert probe.local_label("2.6.0+metax2.32.0.3") == "metax2.32.0.3" and probe.local_label("2.10.0") is None
