"""`polyrl bench rollout` smoke on the CPU: the engine runs at the tiny shape, the report holds its numbers and, with
--compare-parts, the same runs with launch graphs and skinny projections off; the kernel choice is restored."""

from __future__ import annotations

import json
import os

from polyrl.cli.main import main


def test_bench_rollout_tiny_cpu_compare_parts(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "3", "--prompt-len", "6", "--gen-len", "5"]
    before = os.environ.get("POLYRL_KERNELS")
    assert main([*argv, "--baselines", "none", "--compare-parts", "--json", str(out)]) == 0
    assert os.environ.get("POLYRL_KERNELS") == before
    text = capsys.readouterr().out
    assert "A/B launch graphs off: tokens/s" in text
    res = json.loads(out.read_text())
    for key in ("engine_tok_s", "engine_launch_graphs_tok_s", "engine_no_launch_graphs_tok_s",
                "engine_batch1_ms_per_token", "engine_batch1_decode_ms_per_token",
                "engine_launch_graphs_batch1_decode_ms_per_token", "engine_no_launch_graphs_batch1_decode_ms_per_token",
                "engine_skinny_batch1_decode_ms_per_token", "engine_no_skinny_batch1_decode_ms_per_token"):  # fmt: skip
        assert res[key] > 0, key
    assert res["logprob_max_abs_diff"] < 1e-4  # fp32 on the CPU: engine and training forward agree
