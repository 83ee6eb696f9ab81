"""scripts/pyspy_summary.py (gpu_stage.sh serve-profile): samples per thread and the top functions of a py-spy raw
recording."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _load():
    path = Path(__file__).resolve().parents[2] / "scripts" / "pyspy_summary.py"
    spec = importlib.util.spec_from_file_location("pyspy_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_counts_samples_per_thread_and_function(tmp_path, capsys):
    raw = tmp_path / "x.raw"
    raw.write_text(
        "thread (1): engine;run (a.py:1);score (a.py:2) 6\n"
        "thread (1): engine;run (a.py:1) 2\n"
        "thread (2): loop;write (b.py:3) 2\n"
    )
    assert _load().main([str(raw), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("10 samples")
    assert "       8  80.0%  thread (1): engine" in out
    assert "       2  20.0%  thread (2): loop" in out
    own = out.split("--- self")[1].split("--- inclusive")[0]
    assert own.splitlines()[1].split()[:2] == ["6", "60.0%"] and "score (a.py:2)" in own
    inclusive = out.split("--- inclusive")[1]
    assert "run (a.py:1)" in inclusive.splitlines()[1] and inclusive.splitlines()[1].split()[:2] == ["8", "80.0%"]
