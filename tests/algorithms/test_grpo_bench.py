"""`polyrl bench grpo` smoke run on the CPU at a tiny shape: the step split, the roofline and the TRL note print."""

from __future__ import annotations

import json
import re

from polyrl.cli.main import main


def test_bench_grpo_tiny_prints_split_and_roofline(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "grpo", "--shape", "tiny", "--prompts", "2", "--n", "2", "--gen-len", "4", "--prompt-len", "6"]
    argv += ["--steps", "1", "--warmup", "1", "--micro-batch-tokens", "128", "--baselines", "none", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for label in ("rollout s", "log-prob s", "train s", "roofline step s", "fraction of roofline"):
        assert re.search(rf"{label}\s+[\d.]+", text), label
    res = json.loads(out.read_text())
    parts = res["rollout_s"] + res["logprob_s"] + res["train_s"]
    assert 0 < parts <= res["step_s"] * 1.05
    assert res["roofline_step_s"] > 0 and 0 < res["roofline_fraction"]


def test_bench_grpo_profile_runs_one_more_training_phase_under_the_profiler(tmp_path, capsys, monkeypatch):
    from polyrl.bench import grpo

    monkeypatch.setattr(grpo, "_on_accelerator", lambda: True)  # the CPU trace has no device kernels, but the path runs
    out = tmp_path / "bench.json"
    argv = ["bench", "grpo", "--shape", "tiny", "--prompts", "2", "--n", "2", "--gen-len", "4", "--prompt-len", "6"]
    argv += ["--steps", "1", "--warmup", "0", "--micro-batch-tokens", "128", "--baselines", "none", "--kv", "keep"]
    assert main([*argv, "--profile", "5", "--json", str(out)]) == 0
    assert "ours (keep KV) training phase profile: wall" in capsys.readouterr().out
    profile = json.loads(out.read_text())["train_profile"]
    assert profile["wall_ms"] > 0 and isinstance(profile["rows"], list)


def test_bench_grpo_routing_replay_on_tiny_moe_reports_the_replay(tmp_path, capsys):
    argv = ["bench", "grpo", "--shape", "tiny-moe", "--prompts", "2", "--n", "2", "--gen-len", "4"]
    argv += ["--prompt-len", "6", "--steps", "1", "--warmup", "0", "--micro-batch-tokens", "128", "--baselines", "none"]
    assert main([*argv, "--kv", "keep", "--routing-replay"]) == 0
    flips = re.findall(r"mismatch mean ([\d.e+-]+), replay flips ([\d.]+)%\)", capsys.readouterr().out)
    assert len(flips) == 1 and float(flips[0][0]) < 1e-5 and 0 <= float(flips[0][1]) <= 100


def test_bench_grpo_train_phase_rows_on_the_same_packs(tmp_path, capsys):
    """``--train-phase``: the SFT step, the GRPO loss before and now on the same synthetic packs; the two GRPO rows
    train the same trajectory (equal losses) and every row reports its throughput."""
    out = tmp_path / "train.json"
    argv = ["bench", "grpo", "--train-phase", "--shape", "tiny", "--prompts", "2", "--n", "2", "--prompt-len", "6"]
    argv += ["--gen-len", "5", "--micro-batch-tokens", "24", "--steps", "1", "--warmup", "1", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "rl vs rl-before" in text and "losses over all steps agree to 0.00e+00" in text
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["train_phase"]}
    assert set(rows) == {"sft", "rl-before", "rl"}
    assert all(r["micro_batches"] == 2 and r["tokens"] == 44 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["rl"]["losses"] == rows["rl-before"]["losses"] and len(rows["rl"]["losses"]) == 2
    assert res["rl_loss_max_abs_diff"] == 0.0 and rows["rl"]["vs_sft"] > 0
