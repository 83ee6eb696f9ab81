"""`polyrl bench rollout --response-format json_schema` on the CPU: the constrained run is timed next to the free one,
its cost reported, the schema compiled once for the warm-up and the timed run, the grammar executor's host time,
threads and lanes reported (``--grammar-lanes`` sets the lanes, ``auto`` by default)."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main


def test_bench_rollout_response_format(tmp_path, capsys):
    from polyrl.infer.structured import host_threads

    fmt = "json_schema"
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "3", "--prompt-len", "6", "--gen-len", "6"]
    argv += ["--baselines", "none", "--skip-batch1", "--response-format", fmt, "--grammar-lanes", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["response_format"] == fmt and res["grammar_compiles"] == 1
    assert res["grammar_threads"] == host_threads() and res["grammar_lanes"] == 2
    assert res["grammar_mask_ms_mean"] > 0
    assert res["constrained_tok_s"] > 0 and res["constrained_decode_tok_s"] > 0
    assert res["constrained_decode_cost"] == pytest.approx(
        1 - res["constrained_decode_tok_s"] / res["engine_decode_tok_s"]
    )
    printed = capsys.readouterr().out
    assert "constrained decode cost vs free" in printed
    assert f"grammar executor threads / lanes     {host_threads()} / 2" in printed


def test_bench_rollout_structured_host_breakdown(tmp_path, capsys):
    """With overlapped decoding (``--overlap-decode on``, also on the CPU) the guided run takes several steps per
    launch and the structured row splits a guided step's host time into its parts (``structured.HostTimes``); a list
    of lanes (``auto`` = the engine's automatic choice) adds an A/B line per further value, and
    ``--grammar-pipeline-ab`` one without the feed/mask pipeline, ``--guided-ab`` one per named part of the guided
    path as it was before; a bad lanes or ``--guided-ab`` value is refused."""
    from polyrl.infer.structured import auto_lanes, host_threads

    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "3", "--prompt-len", "6", "--gen-len", "12"]
    argv += ["--baselines", "none", "--skip-batch1", "--response-format", "json_schema", "--overlap-decode", "on"]
    argv += ["--grammar-lanes", "auto,2"]  # the structured row with automatic lanes, an A/B line with two
    argv += ["--grammar-pipeline-ab"]  # and an A/B line with the (opt-in) feed/mask pipeline on
    argv += ["--guided-ab", "old,read-at-step0"]  # and the guided path's parts as they were before
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert 1 < res["guided_steps_per_launch"] <= 8  # overlap.GUIDED_LAUNCH_STEPS = 8; the run's tail launches fewer
    parts = [res[f"guided_host_{p}_ms"] for p in ("wait", "consume", "mask", "draw")]
    assert min(parts) >= 0 and res["guided_host_mask_ms"] > 0 and res["guided_host_read_ms"] > 0
    assert res["guided_host_launch_ms"] >= sum(parts)  # the parts happen inside the launches
    assert res["constrained_decode_step_ms"] > 0
    assert res["grammar_lanes"] == auto_lanes(host_threads()) and res["grammar_lanes_auto"] is True
    assert res["lanes2_grammar_mask_ms_mean"] > 0 and res["pipe_grammar_mask_ms_mean"] > 0
    assert res["guided_pipelined_fraction"] == 0  # pipeline off by default (and 3 rows: below PIPELINE_ROWS)
    assert 0 < res["pipe_constrained_decode_step_ms"] and res["pipe_constrained_decode_cost"] < 1
    assert 0 < res["lanes2_constrained_decode_step_ms"] and res["lanes2_constrained_decode_cost"] < 1
    for name in ("old", "read-at-step0"):
        assert res[f"guided_ab_{name}_constrained_decode_step_ms"] > 0 < res[f"guided_ab_{name}_grammar_mask_ms_mean"]
    assert res["grammar_par_consume"] is (res["grammar_lanes"] > 1 and host_threads() >= 4)
    printed = capsys.readouterr().out
    assert "  computing the masks" in printed and "A/B 2 grammar lanes: cost" in printed
    assert "A/B guided old: cost" in printed and "A/B guided read-at-step0: cost" in printed
    assert "A/B feed/mask pipeline on: cost" in printed and "guided steps feed/mask pipelined     0%" in printed
    assert f"grammar executor threads / lanes     {host_threads()} / {auto_lanes(host_threads())} (auto)" in printed
    assert main([*argv[:-3], "--grammar-lanes", "auto,0"]) != 0  # refused before any run
    assert "--grammar-lanes takes 'auto' or counts >= 1" in capsys.readouterr().err
    assert main([*argv[:-2], "--guided-ab", "steps5"]) != 0
    assert "--guided-ab takes" in capsys.readouterr().err
