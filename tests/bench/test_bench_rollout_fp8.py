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
    # the FP8 weights + FP8 KV engine's row beside the weights-only one, with its log-prob mismatch and roofline
    for key in ("fp8kv_tok_s", "fp8kv_speedup", "fp8kv_logprob_mean_abs_diff", "fp8kv_roofline_tok_s"):
        assert res[key] > 0, key
    assert res["fp8kv_roofline_tok_s"] > res["fp8_roofline_tok_s"] > res["roofline_tok_s"]  # fewer bytes per step
    assert res["fp8kv_logprob_mean_abs_diff"] > 1e-4 > res["logprob_mean_abs_diff"]  # fp32 engine: ~2e-7
    assert 0.0 <= res["fp8kv_greedy_agreement"] <= 1.0
    text = capsys.readouterr().out
    assert "FP8 / model precision (output)" in text and "FP8 greedy agree (teacher-forced)" in text
    assert "FP8+KV / model precision (output)" in text and "FP8+KV log-prob |eng - train| mean" in text


def test_bench_rollout_fp8_kv_only_times_one_fp8_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYRL_KERNELS", "fp8_weight_linear:reference")
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "2", "--prompt-len", "4", "--gen-len", "3"]
    argv += [
        "--baselines",
        "none",
        "--skip-batch1",
        "--precision",
        "fp8-kv",
        "--agree-tokens",
        "3",
        "--agree-seqs",
        "1",
    ]
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["fp8kv_tok_s"] > 0 and "fp8_tok_s" not in res


def test_sequence_agreement_counts_positions():
    assert sequence_agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == 4 / 5
    assert sequence_agreement([[1, 2]], [[1]]) == 1.0  # positions both sequences have
    assert sequence_agreement([], []) == 0.0
