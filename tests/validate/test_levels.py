"""`polyrl validate` levels on the CPU: the quick platform+ops+sft run end to end through the CLI (report files,
schema, numbers), collectives over 2 gloo processes, and levels that report skipped / failed with a reason."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from polyrl.cli.main import main
from polyrl.validate import LEVELS, collectives, report, serve_level
from polyrl.validate.result import LevelSkipped


def test_quick_cpu_validation_passes_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "v"
    argv = ["validate", "--preset", "tiny", "--levels", "platform,ops,sft", "--quick", "--dtypes", "fp32,bf16"]
    rc = main([*argv, "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "validate: PASS (platform passed, ops passed, sft passed)" in text
    doc = json.loads((out / "report.json").read_text())
    assert report.validate(doc) == []
    assert doc["platform"]["id"] == "cpu" and doc["options"]["quick"] is True
    assert list(doc["levels"]) == ["platform", "ops", "sft"]
    assert all(r["time_s"] > 0 for r in doc["levels"].values())
    sft = doc["levels"]["sft"]
    m = sft["metrics"]
    assert m["steps"] == 12 and len(m["losses"]) == 12 and m["tokens_per_s_median"] > 0
    assert m["loss_last5_mean"] < 0.9 * m["loss_first5_mean"]  # the stated margin, on real numbers
    assert 7.0 < m["loss_first"] < 8.5  # ~ln(2048) for random weights
    reload = next(c for c in sft["checks"] if c["name"].startswith("save, reload"))
    assert reload["status"] == "pass" and reload["value"] == 0.0
    assert any("no smi tool" in n for n in sft["notes"])  # utilisation skipped with its reason
    ops = doc["levels"]["ops"]
    assert {r["shape"] for r in ops["rows"] if r["shape"] != "-"} <= {  # quick: tiny shapes only
        s.name for c in __import__("polyrl.validate.ops", fromlist=["CASES"]).CASES.values() for s in c.shapes
        if s.size == "tiny"
    } | {"1024x1024x1024"}  # fmt: skip
    assert doc["matrix_row"] == json.loads((out / "matrix_row.json").read_text())
    md = (out / "report.md").read_text()
    assert "## Operator validation" in md and "### End-to-end SFT" in md
    assert "- collectives level: not requested in this run" in md


def test_collectives_over_two_gloo_processes():
    result = collectives.run_level(argparse.Namespace(collectives_cpu_procs=2))
    assert result["status"] == "passed", result
    names = [c["name"] for c in result["checks"]]
    assert names == [f"{op} exact on 2 ranks" for op in collectives.OPS]
    assert all(c["value"] == 0.0 for c in result["checks"])
    assert result["metrics"]["backend"] == "gloo" and result["metrics"]["all_reduce_busbw_gbps"] > 0


def test_collectives_skip_on_one_device_with_the_way_out():
    with pytest.raises(LevelSkipped, match="--collectives-cpu-procs 2"):
        collectives.run_level(argparse.Namespace(collectives_cpu_procs=0))
    with pytest.raises(LevelSkipped, match="at least 2 processes"):
        collectives.run_level(argparse.Namespace(collectives_cpu_procs=1))


def test_serve_skips_when_a_dependency_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` now raises ImportError
    assert "openai not installed" in serve_level.missing_dependency()
    rc = main(["validate", "serve", "collectives", "--json", str(tmp_path / "r.json")])
    assert rc == 0  # skipped levels do not fail the run
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["levels"]["serve"]["status"] == "skipped"
    assert doc["levels"]["serve"]["reason"].startswith("openai not installed")
    assert doc["levels"]["collectives"]["status"] == "skipped"
    assert "serve level: skipped -- openai not installed" in " ".join(doc["not_validated"])
    assert "validate: PASS (collectives skipped, serve skipped)" in capsys.readouterr().out


def test_a_crashing_level_fails_with_its_error_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    (tmp_path / "broken_level_for_tests.py").write_text(
        "def add_arguments(parser):\n    pass\n\ndef run_level(args):\n    raise RuntimeError('device fell over')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(LEVELS, "broken", ("broken_level_for_tests", "a level that crashes"))
    rc = main(["validate", "broken", "collectives", "--json", str(tmp_path / "r.json")])
    assert rc == 1
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["levels"]["broken"]["status"] == "failed" and doc["passed"] is False
    assert doc["levels"]["broken"]["reason"] == "RuntimeError: device fell over"
    assert doc["levels"]["collectives"]["status"] == "skipped"
    assert "broken: FAILED" in capsys.readouterr().out
