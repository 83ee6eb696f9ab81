"""`polyrl bench rollout --precision fp8` on the CPU (the FP8 reference forced): the report holds the FP8 engine's
speed next to the model-precision run and the greedy agreement numbers; the agreement helpers count correctly."""

from __future__ import annotations

import json

from polyrl.bench.rollout_fp8 import sequence_agreement
from polyrl.cli.main import main


def test_bench_rollout_fp8_tiny_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POLYRL_KERNELS", "fp8_weight_linear:reference")
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "3", "--prompt-len", "6", "--gen-len", "5"]
    argv += ["--baselines", "none", "--skip-batch1", "--precision", "fp8", "--agree-tokens", "6", "--agree-seqs", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("fp8_tok_s", "fp8_decode_tok_s", "fp8_speedup", "fp8_weight_bytes"):
        assert res[key] > 0, key
    assert res["fp8_speedup"] == res["fp8_tok_s"] / res["engine_tok_s"]
    assert 0.0 <= res["fp8_greedy_agreement"] <= 1.0 and 0.0 <= res["fp8_teacher_forced_agreement"] <= 1.0
    assert res["fp8_agree_tokens"] == 6
    text = capsys.readouterr().out
    assert "FP8 / model precision (output)" in text and "FP8 greedy agree (teacher-forced)" in text


def test_sequence_agreement_counts_positions():
    assert sequence_agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == 4 / 5
    assert sequence_agreement([[1, 2]], [[1]]) == 1.0  # positions both sequences have
    assert sequence_agreement([], []) == 0.0
