"""`polyrl env` and `polyrl check`: golden text and JSON, exit codes, the real CPU machine, user errors.

Regenerate goldens after an intended wording change with POLYRL_UPDATE_GOLDEN=1 (then review the diff).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _platform_fixtures import GOLDEN, load_base, merge, pitfall_case

from polyrl.cli.main import main
from polyrl.platform import envvars, report, resolve

PPU_DEEP = {
    "deep": True,
    "smi": {"nvidia-smi": {"header": "| PPU-SMI 1.6.0   Driver Version: 1.6.0   CUDA Version: 12.9 |"}},
}
GOLDEN_CASES = {
    "cpu": lambda: load_base("cpu"),
    "ppu": lambda: merge(load_base("ppu"), PPU_DEEP),
    "musa-replaced": lambda: pitfall_case("vendor-torch-replaced", "fires"),
    "ascend-shims": lambda: merge(pitfall_case("cuda-alias-shim", "fires"), {"env": {"CUDA_VISIBLE_DEVICES": "0"}}),
}


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _compare(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("POLYRL_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; create it with POLYRL_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden file"


def _normalise(doc: dict) -> str:
    doc = dict(doc, polyrl="<version>")
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_check_golden(case, tmp_path, capsys):
    snap_file = tmp_path / "snap.json"
    snap_file.write_text(json.dumps(GOLDEN_CASES[case]()))
    rc, text, _ = _run(["check", "--snapshot", str(snap_file)], capsys)
    _compare(f"check_{case}.txt", text)
    rc_json, out, _ = _run(["check", "--json", "--snapshot", str(snap_file)], capsys)
    doc = json.loads(out)
    _compare(f"check_{case}.json", _normalise(doc))
    assert doc["schema"] == report.CHECK_SCHEMA
    assert rc == rc_json == (0 if doc["ready"] else 1)
    assert sum(doc["counts"].values()) == len(doc["rows"])


def test_check_exit_codes(tmp_path, capsys):
    ok, bad = tmp_path / "ok.json", tmp_path / "bad.json"
    ok.write_text(json.dumps(load_base("ppu")))
    bad.write_text(json.dumps(pitfall_case("vendor-torch-replaced", "fires")))
    assert _run(["check", "--snapshot", str(ok)], capsys)[0] == 0
    rc, text, _ = _run(["check", "--snapshot", str(bad)], capsys)
    assert rc == 1 and "FAIL  vendor-torch-replaced" in text and "result: NOT READY" in text


def test_unknown_forced_platform_is_a_user_error(tmp_path, capsys):
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(merge(load_base("cpu"), {"env": {"POLYRL_PLATFORM": "tpu"}})))
    rc, _, err = _run(["check", "--snapshot", str(snap)], capsys)
    assert rc == 2 and err.startswith("error: POLYRL_PLATFORM='tpu' is not a known platform") and "ascend" in err


def test_bad_snapshot_file_is_a_user_error(tmp_path, capsys):
    snap = tmp_path / "snap.json"
    snap.write_text('{"schema": 1}')
    rc, _, err = _run(["check", "--snapshot", str(snap)], capsys)
    assert rc == 2 and "holds no probe snapshot" in err


def test_env_report_schema():
    snap = merge(load_base("musa"), {"env": {"POLYRL_KERNELS": "reference"}})
    doc = report.env_report(snap, resolve.resolve(snap))
    assert doc["schema"] == report.ENV_SCHEMA
    for key in ("polyrl", "python", "os", "platform", "torch", "devices", "vendor_packages", "triton", "collectives"):
        assert doc[key] is not None, key
    assert doc["platform"]["id"] == "musa" and doc["platform"]["evidence"]
    assert doc["collectives"] == {"expected": "mccl", "library": "MCCL", "available": ["gloo", "mccl"]}
    assert {"name": "torch-musa", "version": "2.9.1+musa5.2.0", "local": "musa5.2.0"} in doc["vendor_packages"]
    assert [v["name"] for v in doc["polyrl_variables"]] == [v.name for v in envvars.ALL]
    assert doc["polyrl_variables"][0]["value"] == "reference" and doc["variables"]["MUSA_HOME"] == "/usr/local/musa"
    text = report.env_text(doc)
    assert "Moore Threads MUSA (musa)" in text and "MTT S5000, capability 3.1, 80.0 GiB" in text


def test_real_machine_env_and_check(tmp_path):
    """This CPU machine: `polyrl env --json` resolves to cpu and `polyrl check` on it is ready (exit 0)."""
    cmd = [sys.executable, "-m", "polyrl.cli.main"]
    env_run = subprocess.run([*cmd, "env", "--json"], capture_output=True, text=True, timeout=120, check=True)
    doc = json.loads(env_run.stdout)
    if doc["torch"]["device_type"] not in ("cpu", None):
        pytest.skip(f"this machine has an accelerator ({doc['torch']['device_type']}); the CPU case does not apply")
    assert doc["platform"]["id"] == "cpu" and doc["torch"]["import_ok"] is True
    assert doc["snapshot"]["torch_runtime"]["device_type"] == "cpu"
    snap_file = tmp_path / "env.json"
    snap_file.write_text(env_run.stdout)
    check_run = subprocess.run(
        [*cmd, "check", "--snapshot", str(snap_file)], capture_output=True, text=True, timeout=120
    )
    assert check_run.returncode == 0, check_run.stdout + check_run.stderr
    assert check_run.stdout.startswith("polyrl check: CPU (cpu)") and "result: READY" in check_run.stdout
