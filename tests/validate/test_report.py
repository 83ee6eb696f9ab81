"""The validation report: schema ``polyrl.validate/1`` (required keys, types, version), ``report.md`` in the shape of
the seed report, the matrix row, and ``docs/compatibility.md`` rendered from fixture reports (tiers, rows, dates,
latest report per device, knowledge-base platforms without a report)."""

from __future__ import annotations

import copy
import json

import pytest

from polyrl.cli.main import main
from polyrl.platform import kb
from polyrl.validate import compat, markdown, report
from polyrl.validate.result import check, level_result, skipped


def _env(platform_id: str, device: str, cuda: str | None) -> dict:
    p = kb.platform(platform_id)
    dev = {"index": 0, "type": p.device_type, "name": device}
    if p.device_type == "cpu":
        dev["cores"] = 2
    else:
        dev["capability"] = "9.0"
    return {
        "platform": {"id": p.id, "name": p.name, "vendor": p.vendor, "device_type": p.device_type,
                     "cuda_compatible": p.cuda_compatible, "confidence": "high", "evidence": ["fixture"]},
        "versions": {"polyrl": "0.1.0", "python": "3.11.7", "torch": "2.11.0+cu128" if cuda else "2.13.0+cpu",
                     "triton": {"version": "3.6.0", "provider": "triton", "backends": ["nvidia"]},
                     "transformers": "5.24.0", "runtime": {"cuda": cuda, "hip": None},
                     "driver": "570.1" if cuda else None, "collective_backend": p.collective_backend},
        "devices": [dev] if p.device_type == "cpu" else [dev, dict(dev, index=1)],
        "machine": {"os": "Linux", "arch": "x86_64", "system": "Linux"},
    }  # fmt: skip


def _ops_level(status: str = "pass") -> dict:
    rows = [
        {"op": "rmsnorm", "impl": "triton", "dtype": "bfloat16", "shape": "T=7,H=127", "check": "out:y",
         "max_abs": 0.01, "rel_l2": 2.5e-3, "finite": True, "tol_rel_l2": 2e-2, "status": status, "reason": ""},
        {"op": "rmsnorm", "impl": "triton", "dtype": "bfloat16", "shape": "T=7,H=127", "check": "grad:x",
         "max_abs": 0.02, "rel_l2": 3.1e-3, "finite": True, "tol_rel_l2": 2e-2, "status": "pass", "reason": ""},
        {"op": "rope", "impl": "cuda", "dtype": "float32", "shape": "-", "check": "-", "max_abs": None,
         "rel_l2": None, "finite": None, "tol_rel_l2": None, "status": "skipped", "reason": "declared for npu"},
        {"op": "matmul_tf32", "impl": "torch", "dtype": "float32", "shape": "1024x1024x1024", "check": "tf32 vs fp32",
         "max_abs": 0.05, "rel_l2": 2.9e-4, "finite": True, "tol_rel_l2": None, "status": "info",
         "reason": "vs fp64: tf32 2.9e-04, fp32 1.0e-07"},
    ]  # fmt: skip
    from polyrl.validate.ops_level import representative

    ok = status == "pass"
    return {"level": "ops", "status": "passed" if ok else "failed", "passed": ok,
            "reason": "" if ok else "1 failing row(s)", "summary": {"pass": 2, "skipped": 1, "info": 1},
            "metrics": {"representative": representative(rows)}, "checks": [], "rows": rows, "notes": []}  # fmt: skip


def _doc(platform_id="cpu", device="x86_64", cuda=None, when=1_790_000_000.0, ops_status="pass") -> dict:
    sft = level_result(
        "sft",
        [check("loss falls (last-5 mean / first-5 mean)", True, 0.41, "< 0.9", "7.0 -> 2.9")],
        {"tokens_per_s_median": 1234.5, "losses": [7.0, 2.9]},
    )
    levels = {
        "platform": level_result("platform", [check("polyrl check: no FAIL rows", True, 0, "0 FAIL")],
                                 {"check_counts": {"OK": 23, "WARN": 1}},
                                 check_rows=[{"id": "triton-x", "status": "WARN", "title": "a warning"}]),
        "ops": _ops_level(ops_status),
        "collectives": skipped("collectives", "1 visible cuda device(s); collectives need at least 2"),
        "sft": sft,
    }  # fmt: skip
    for r in levels.values():
        r["time_s"] = 1.5
    options = {"levels": list(levels), "model": "preset tiny (random weights)", "quick": True}
    all_levels = ["platform", "ops", "collectives", "sft", "rl", "serve"]
    return report.build(levels, _env(platform_id, device, cuda), options, all_levels, now=when)


def test_report_follows_the_schema_and_is_json():
    doc = json.loads(json.dumps(_doc()))
    assert report.validate(doc) == []
    assert doc["schema"] == "polyrl.validate/1" and doc["date"] == "2026-09-21" and doc["passed"] is True
    assert doc["versions"]["triton"] == {"version": "3.6.0", "provider": "triton", "backends": ["nvidia"]}
    nv = doc["not_validated"]
    assert "collectives level: skipped -- 1 visible cuda device(s); collectives need at least 2" in nv
    assert "rl level: not requested in this run" in nv and "serve level: not requested in this run" in nv
    assert "kernel implementations not run on this device: rope/cuda" in nv
    assert any(item.startswith("multi-node") for item in nv) and any("convergence" in item for item in nv)
    row = doc["matrix_row"]
    assert row["levels"] == {"platform": "passed", "ops": "passed", "collectives": "skipped", "sft": "passed"}
    assert row["passed"] == ["ops", "platform", "sft"] and row["device_count"] == 0
    assert report.file_name(doc) == "cpu-x86-64-2026-09-21.json"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema="polyrl.validate/0"), "expected 'polyrl.validate/1'"),
        (lambda d: d.pop("levels"), "levels missing"),
        (lambda d: d.update(passed="yes"), "passed should be bool"),
        (lambda d: d["versions"].pop("torch"), "versions.torch missing"),
        (lambda d: d["levels"]["sft"].update(status="ok"), "levels.sft.status is 'ok'"),
        (lambda d: d["levels"]["collectives"].update(reason=""), "levels.collectives is skipped without a reason"),
        (lambda d: d["levels"]["sft"].pop("checks"), "levels.sft.checks missing"),
        (lambda d: d.update(date="21/09/2026"), "not YYYY-MM-DD"),
    ],
)
def test_schema_violations_are_named(mutate, message):
    doc = copy.deepcopy(_doc())
    mutate(doc)
    problems = report.validate(doc)
    assert any(message in p for p in problems), problems


def test_markdown_has_the_seed_reports_sections():
    md = markdown.render(_doc(platform_id="nvidia", device="NVIDIA H200", cuda="12.8"))
    for heading in ("## Validation environment", "## Installation check", "## Operator validation",
                    "## End-to-end results", "## Not validated", "## Matrix row"):  # fmt: skip
        assert heading in md
    assert md.startswith("# polyrl validation: NVIDIA H200 (NVIDIA CUDA)")
    assert "- torch.version.cuda: 12.8" in md and "- Visible devices: 2" in md and "- Driver: 570.1" in md
    assert "| rmsnorm | triton | bfloat16 | 2 | 0.0031 | 0.02 | 0.0031 | yes | pass |" in md
    assert "- TF32: fp32 matmul with TF32 allowed vs disallowed differs by rel L2 2.90e-04" in md
    assert "- rmsnorm (triton) bfloat16: rel L2 0.0031, gradients 0.0031, max abs 0.02" in md
    assert "- WARN `triton-x`: a warning" in md
    assert "| loss falls (last-5 mean / first-5 mean) | 0.41 (7.0 -> 2.9) | < 0.9 | pass |" in md
    assert "- tokens_per_s_median: 1234" in md
    row = json.loads(md.split("```json\n")[1].split("\n```")[0])
    assert row["device"] == "NVIDIA H200" and row["runtime"] == "CUDA 12.8"


def _write(folder, doc):
    path = folder / report.file_name(doc)
    path.write_text(json.dumps(doc))
    return path.name


def test_compatibility_matrix_from_fixture_reports(tmp_path):
    compat_dir = tmp_path / "compat"
    compat_dir.mkdir()
    cpu = _write(compat_dir, _doc())
    old_h200 = _write(compat_dir, _doc("nvidia", "NVIDIA H200", "12.8", when=1_780_000_000.0, ops_status="fail"))
    new_h200 = _write(compat_dir, _doc("nvidia", "NVIDIA H200", "12.8", when=1_795_000_000.0))
    broken = _write(compat_dir, _doc("rocm", "AMD Instinct MI300X", None, ops_status="fail"))
    reports = compat.load_reports(compat_dir)
    assert len(reports) == 4 and [n for n, _ in compat.latest(reports)] == [cpu, new_h200, broken]
    md = compat.render(reports)
    lines = md.splitlines()
    tier = {h: lines.index(h) for h in ("## Tested in our CI", "## Validated on real hardware",
                                        "## Known not to work", "## Matrix")}  # fmt: skip
    assert list(tier) == sorted(tier, key=tier.get)
    validated = lines[tier["## Validated on real hardware"] : tier["## Known not to work"]]
    assert (
        "- NVIDIA CUDA, NVIDIA H200 (2026-11-18): platform, ops, sft on 2 device(s), preset tiny (random weights)"
        in validated
    )
    known_bad = lines[tier["## Known not to work"] : tier["## Matrix"]]
    assert any(
        line.startswith("- AMD ROCm, AMD Instinct MI300X (2026-09-21): ops: 1 failing row(s)") for line in known_bad
    )
    table = [line for line in lines[tier["## Matrix"] :] if line.startswith("| ")]
    rows = {line.split(" | ")[0][2:]: line for line in table[1:]}
    assert rows["NVIDIA CUDA"].startswith(
        "| NVIDIA CUDA | NVIDIA H200 | 2026-11-18 | 0.1.0 | 2.11.0+cu128 | 3.6.0 (triton) | CUDA 12.8 / 570.1 "
        "| pass | pass | skip | pass | - | - |"
    )
    assert f"[{new_h200}](../compat/{new_h200})" in rows["NVIDIA CUDA"] and old_h200 not in md
    assert "| **FAIL** |" in rows["AMD ROCm"]
    for pid, p in kb.platforms().items():  # every KB platform has a row
        assert p.name in rows, pid
        if pid not in ("cpu", "nvidia", "rocm"):
            assert "not yet validated" in rows[p.name]
    assert len(table) == 1 + len(kb.platforms())  # header + one row per platform (one device each here)


def test_cli_compat_render_and_bad_reports(tmp_path, capsys):
    compat_dir = tmp_path / "compat"
    compat_dir.mkdir()
    _write(compat_dir, _doc())
    out = tmp_path / "docs" / "compatibility.md"
    assert main(["compat", "render", "--compat-dir", str(compat_dir), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| CPU | x86_64 | 2026-09-21 |" in text and "](../compat/cpu-x86-64-2026-09-21.json)" in text
    (compat_dir / "bad.json").write_text(json.dumps({"schema": "polyrl.validate/1", "levels": {}}))
    assert main(["compat", "render", "--compat-dir", str(compat_dir), "--out", str(out)]) == 2
    assert "bad.json: not a polyrl.validate/1 report" in capsys.readouterr().err
    assert main(["compat", "render", "--compat-dir", str(tmp_path / "none")]) == 2


def test_committed_matrix_is_rendered_from_the_committed_reports():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    reports = compat.load_reports(root / "compat")
    assert reports, "compat/ holds no report"
    committed = (root / "docs" / "compatibility.md").read_text()
    assert compat.render(reports) == committed, "re-run `polyrl compat render` after adding a report to compat/"


def test_the_compatibility_matrix_has_a_column_per_validate_level():
    from polyrl.validate import LEVELS
    from polyrl.validate.compat import LEVEL_ORDER

    assert LEVEL_ORDER == tuple(LEVELS)
