"""bench.common.sweep_settings, the launch-setting sweeps' timing and report (scripts/*_sweep.py), with the graph
timer replaced: the default's share of the bandwidth, the fastest first with their speed-up, failures said."""

from __future__ import annotations

import torch

from polyrl.bench import common


def test_sweep_reports_default_and_fastest_and_says_why_a_setting_failed(monkeypatch, capsys):
    times = {None: 2.0, "a": 1.0, "b": 4.0}

    def fake_time_graph(fn, device, warmup=2, reps=20):
        s = fn()
        return {"error": "too much shared memory"} if s == "bad" else {"median_ms": times[s]}

    monkeypatch.setattr(common, "time_graph", fake_time_graph)
    rows = common.sweep_settings("case", [None, "a", "b", "bad"], lambda s: lambda: s, 4e6, 4e9, torch.device("cpu"))
    assert rows == [(1.0, "a"), (2.0, "default"), (4.0, "b")]
    out = capsys.readouterr().out
    assert "bad: too much shared memory" in out
    assert "case: default 2000.0 us (50% of copy)" in out  # 4 MB in 2 ms = 2 GB/s of 4 GB/s
    assert "x2.00  a" in out and "x0.50  b" in out


def test_sweep_without_a_timed_default_says_so(monkeypatch, capsys):
    monkeypatch.setattr(common, "time_graph", lambda fn, device, warmup=2, reps=20: {"error": "no graphs"})
    assert common.sweep_settings("case", [None], lambda s: lambda: s, 1, 1.0, torch.device("cpu")) == []
    assert "could not be timed" in capsys.readouterr().out
