"""scripts/fp8_loss_curves.py (run on the GPU by gpu_stage.sh fp8-loss-seeds) at the tiny preset on the CPU, FP8
emulated by the reference GEMM: the seeds protocol end to end (JSON fields, paired differences recomputed from the
runs, the held-out curve, the markov floor, reuse and the time budget), and its statistics on hand-made numbers."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

EMULATE = "fp8_scaled_mm:reference"
DATA = "builtin:markov?n=96&vocab=16&order=1&branch=4&mean_len=8&max_len=24&prompt_words=4"


def _script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "fp8_loss_curves.py"
    spec = importlib.util.spec_from_file_location("fp8_loss_curves", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seeds_protocol_end_to_end(tmp_path, monkeypatch, capsys):
    mod = _script()
    monkeypatch.setenv("POLYRL_KERNELS", EMULATE)
    out = tmp_path / "c"
    common = ["--preset", "tiny", "--steps", "4", "--eval-every", "2", "--eval-rows", "16", "--data", DATA]
    common += ["--micro-batch-tokens", "512", "--max-seq-len", "128", "--lr", "1e-3", "--warmup-steps", "1"]
    rc = mod.main([*common, "--seeds", "0,1", "--out", str(out)])
    s = json.loads((out / "fp8_loss_curves.json").read_text())
    assert s["seeds"] == [0, 1] and s["metric"] == "final_eval"
    assert set(s["runs"]) == {"bf16-s0", "fp8-s0", "bf16-s1", "fp8-s1"}
    for r in s["runs"].values():
        assert len(r["losses"]) == 4 and r["eval_steps"] == [2, 4] and r["final_eval"] == r["eval_losses"][-1]
        assert r["final_loss"] == pytest.approx(statistics.fmean(r["losses"]))  # window 10 > 4 steps: all of them
        assert math.isfinite(r["final_eval"]) and r["wall_s"] > 0 and r["epochs"] > 0
    runs = s["runs"]
    # the variants of a seed start from the same weights on the same data: step 1's loss agrees to FP8 rounding
    for seed in (0, 1):
        b, f = runs[f"bf16-s{seed}"], runs[f"fp8-s{seed}"]
        assert b["losses"][0] == pytest.approx(f["losses"][0], rel=1e-2) and b["losses"] != f["losses"]
    assert runs["bf16-s0"]["losses"][0] != runs["bf16-s1"]["losses"][0]  # another seed: other weights and order
    for metric in ("final_eval", "final_loss"):
        p = s["paired"]["fp8"][metric]
        diffs = [runs[f"fp8-s{k}"][metric] - runs[f"bf16-s{k}"][metric] for k in (0, 1)]
        base = statistics.fmean(runs[f"bf16-s{k}"][metric] for k in (0, 1))
        assert p["seeds"] == [0, 1] and p["diffs"] == pytest.approx(diffs, abs=1e-12)
        assert p["mean"] == pytest.approx(statistics.fmean(diffs))
        assert p["std"] == pytest.approx(statistics.stdev(diffs))
        assert p["rel_diff"] == pytest.approx(statistics.fmean(diffs) / base)
        assert p["ci95"] == pytest.approx(12.706 * statistics.stdev(diffs) / math.sqrt(2))
        values = [runs[f"fp8-s{k}"][metric] for k in (0, 1)]
        assert s["per_variant"]["fp8"][metric]["mean"] == pytest.approx(statistics.fmean(values))
        assert s["per_variant"]["fp8"][metric]["std"] == pytest.approx(statistics.stdev(values))
    assert s["rel_diff"] == s["paired"]["fp8"]["final_eval"]["rel_diff"]
    assert s["verdict"] == mod.verdict(s["paired"]["fp8"]["final_eval"], 0.01)
    assert (rc == 0) == (s["verdict"] == "within")
    floor = s["floor"]
    assert 0 < floor["nats_per_token"] < floor["nats_per_word"] and floor["rows"] == 16
    assert min(r["final_eval"] for r in runs.values()) > floor["nats_per_token"]  # 4 steps from random weights
    excess = s["per_variant"]["bf16"]["excess_eval"]["mean"]
    assert excess == pytest.approx(s["per_variant"]["bf16"]["final_eval"]["mean"] - floor["nats_per_token"])
    assert (out / "data" / "test.jsonl").read_text().count("\n") == 16 and (out / "fp8_loss_curves.png").stat().st_size
    text = capsys.readouterr().out
    assert "fp8 - bf16, final_eval: s0 " in text and "floor:" in text and "the 1.0% bar" in text

    # --reuse takes finished runs by name; --budget-s starts no seed that would end past it
    again = tmp_path / "again"
    mod.main([*common, "--seeds", "0,1", "--out", str(again), "--reuse", str(out / "fp8_loss_curves.json"),
              "--budget-s", "1e-6"])  # fmt: skip
    s2 = json.loads((again / "fp8_loss_curves.json").read_text())
    assert s2["seeds"] == [0] and s2["runs"]["fp8-s0"]["losses"] == runs["fp8-s0"]["losses"]
    assert not (again / "bf16-s0").exists() and "seed 1 not started" in capsys.readouterr().out


def test_paired_statistics_and_verdict_on_known_numbers():
    mod = _script()

    def rec(v, seed, loss):
        return mod.make_record(v, seed, [loss], [(1, loss)], 10)

    table = [("bf16", 0, 2.0), ("fp8", 0, 2.02), ("bf16", 1, 2.2), ("fp8", 1, 2.2), ("bf16", 2, 1.8), ("fp8", 2, 1.81)]
    runs = {mod.run_key(v, k): rec(v, k, x) for v, k, x in table}
    p = mod.paired(runs, "fp8", "final_eval", [0, 1, 2])
    assert p["diffs"] == pytest.approx([0.02, 0.0, 0.01]) and p["mean"] == pytest.approx(0.01)
    assert p["std"] == pytest.approx(0.01) and p["bf16_mean"] == pytest.approx(2.0)
    assert p["rel_diff"] == pytest.approx(0.005) and p["ci95"] == pytest.approx(4.303 * 0.01 / math.sqrt(3))
    assert mod.verdict(p, 0.01) == "undecided"  # 0.5% +- 1.24%: the interval holds both 0 and the bar
    assert mod.verdict({**p, "rel_ci95": 0.004}, 0.01) == "within"
    assert mod.verdict({**p, "rel_diff": -0.02, "rel_ci95": 0.004}, 0.01) == "outside"
    assert mod.verdict({**p, "rel_diff": 0.009, "rel_ci95": None}, 0.01) == "within"  # one seed: the point
    del runs["bf16-s2"]
    assert mod.paired(runs, "fp8", "final_eval", [0, 1, 2])["seeds"] == [0, 1]  # only seeds with both runs
    assert mod.paired(runs, "fp8-rowwise", "final_eval", [0, 1]) is None
