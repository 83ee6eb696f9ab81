"""`polyrl bench rollout --response-format json_schema` on the CPU: the constrained run is timed next to the free one,
its cost reported, the schema compiled once for the warm-up and the timed run."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main


def test_bench_rollout_response_format(tmp_path, capsys):
    fmt = "json_schema"
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "3", "--prompt-len", "6", "--gen-len", "6"]
    assert main([*argv, "--baselines", "none", "--skip-batch1", "--response-format", fmt, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["response_format"] == fmt and res["grammar_compiles"] == 1
    assert res["constrained_tok_s"] > 0 and res["constrained_decode_tok_s"] > 0
    assert res["constrained_decode_cost"] == pytest.approx(
        1 - res["constrained_decode_tok_s"] / res["engine_decode_tok_s"]
    )
    assert "constrained decode cost vs free" in capsys.readouterr().out
