"""``polyrl bench agent`` runs end to end on the CPU at a tiny size and reports what it measured (the numbers that
matter come from the H200: see the module docstring of ``polyrl.bench.agent``)."""

from __future__ import annotations

import json

from polyrl.cli.main import main


def test_bench_agent_runs_and_counts_exactly(tmp_path, capsys):
    out = tmp_path / "agent.json"
    argv = ["bench", "agent", "--shape", "tiny", "--episodes", "6", "--turns", "3", "--turn-tokens", "5",
            "--prompt-words", "8", "--obs-words", "3", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["generated_tokens"] == 6 * 3 * 5  # eos ignored: every turn is exactly its budget
    assert res["turns_mean"] == 3.0
    assert res["episodes_per_s"] > 0 and res["single_turn_tok_s"] > 0
    assert res["ratio_agent_vs_single"] == res["agent_tok_s"] / res["single_turn_tok_s"]
    assert res["prefix_cache_hit_rate"] > 0.2  # later turns reuse the cached conversation
    assert "ratio episodes / single-turn" in capsys.readouterr().out
