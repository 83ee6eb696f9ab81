"""`polyrl bench eval` smoke on the CPU at the tiny shape: every backend row is timed, the engine's log-likelihoods
equal the hf backend's, and the report carries the prompt log-prob overhead and the prefix-cache hit rate."""

from __future__ import annotations

import json

import torch

from polyrl.cli.main import main


def test_bench_eval_tiny_cpu(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "eval.json"
    argv = ["bench", "eval", "--shape", "tiny", "--docs", "6", "--context-words", "30", "--hf-batch-sizes", "8"]
    assert main([*argv, "--serve", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["backend"]: r for r in res["rows"]}
    assert set(rows) == {"hf bs=8", "polyrl (in-process)", "serve (local-completions)"}
    for r in rows.values():
        assert r["loglikelihood_s"] > 0 and r["harness_s"] > 0 and r["requests_per_s"] > 0
        assert r["max_abs_diff_vs_hf"] <= 1e-3  # fp32: the same numbers as lm-eval's hf backend
    assert res["prefix_cache_hit_rate"] > 0  # the four choices of a document share their ~40-token context
    assert set(res["prompt_logprobs_overhead"]) == {"all_positions", "continuation"}
    assert "speedup_vs_best_hf" in capsys.readouterr().out
