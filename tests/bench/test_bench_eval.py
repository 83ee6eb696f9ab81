"""`polyrl bench eval` smoke on the CPU at the tiny shape: every backend row is timed, the engine's log-likelihoods
equal the hf backend's, the generation rows produce hf's greedy texts, the harness's own time is a row, and the
report carries the prompt log-prob overhead, the in-process phase's host breakdown (a document's choices share their
context: fewer tokens fed than one sequence per request) and its repeat, and the serve row runs against a `polyrl
serve` process with the client settings and the server's own time split (its /metrics) recorded. A row that fails is
printed with its error and the others still run."""

from __future__ import annotations

import json

import torch

from polyrl.cli.main import main

ARGV = ["bench", "eval", "--shape", "tiny", "--docs", "6", "--context-words", "30", "--hf-batch-sizes", "8"]
GEN = ["--gen-docs", "4", "--gen-tokens", "8"]


def test_bench_eval_tiny_cpu(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "eval.json"
    prof = tmp_path / "prof"
    assert main([*ARGV, *GEN, "--serve", "--repeats", "2", "--json", str(out), "--profile", str(prof)]) == 0
    res = json.loads(out.read_text())
    for name in ("eval_gen.pstats", "eval_gen_cprofile.txt", "eval_gen_torch.txt", "eval_gen_trace.json"):
        assert (prof / name).stat().st_size > 0, name  # a repeat of the generation phase, profiled
    rows = {r["backend"]: r for r in res["rows"]}
    ll = {"hf bs=8", "polyrl (in-process)", "serve (local-completions)"}
    gen = {"hf bs=8 generate", "polyrl (in-process) generate"}
    assert set(rows) == ll | gen | {"lm-eval harness itself (hf bs=8 run)"}
    for name in ll:
        r = rows[name]
        assert r["loglikelihood_s"] > 0 and r["harness_s"] > 0 and r["requests_per_s"] > 0
        assert r["max_abs_diff_vs_hf"] <= 1e-3  # fp32: the same numbers as lm-eval's hf backend
    for name in gen:
        r = rows[name]
        assert r["generate_s"] > 0 and r["requests_per_s"] == 4 / r["generate_s"]
        assert r["same_as_hf"] == 1.0  # fp32 greedy: hf's texts exactly
        # both generation rows run their phase twice (the same rule for both): the steady state is a column too
        assert r["repeat_s"] > 0 and r["same_on_repeat"] is True and r["repeat_speedup"] > 0
        assert len(r["repeat_all_s"]) == 2 and r["repeat_s"] == min(r["repeat_all_s"])  # --repeats 2: the fastest
    g = rows["polyrl (in-process) generate"]["breakdown"]
    assert g["steps"] >= 8 and g["generated_tokens"] == 4 * 8  # 8 tokens each (a stop string that never occurs)
    assert 0 < g["first_step_s"] <= g["slowest_step_s"] <= g["generate_s"] and g["graph_capture_s"] == 0.0
    assert g["requests"] == 4 and g["engine_calls"] == 1 and g["stop_checks"] == 4 * 8 and g["stop_check_s"] > 0
    assert g["steps"] == g["sync_steps"] + g["launches"] + 1  # the CPU runs every step synchronously
    h = rows["hf bs=8 generate"]["breakdown"]  # lm-eval's model.generate calls: the same work as the engine's
    assert h["requests"] == 4 and h["generate_calls"] == 1 and h["computed_tokens"] == 4 * 8 and h["generate_s"] > 0
    assert rows["hf bs=8 generate"]["text_tokens"] == rows["polyrl (in-process) generate"]["text_tokens"] > 0
    # the hf log-likelihood row repeats its phase too; ratios are against hf's faster run, the claim the lower ratio
    hf_ll = rows["hf bs=8"]
    assert hf_ll["repeat_s"] > 0
    best = min(hf_ll["phase_s"], hf_ll["repeat_s"])
    for name in ll:
        r = rows[name]
        assert r["speedup_vs_best_hf"] == best / r["phase_s"]
        assert r["claimed_speedup"] == min(r["speedup_vs_best_hf"], r.get("repeat_speedup") or float("inf"))
    mine = rows["polyrl (in-process)"]
    assert mine["repeat_speedup"] == best / mine["repeat_s"]
    assert mine["warmup_s"] > 0  # kernels compiled before the timed phase
    assert mine["repeat_s"] > 0 and mine["same_on_repeat"] is True
    b = mine["breakdown"]
    assert 0 < b["fed_tokens"] < b["unshared_tokens"]  # the four choices of a document share their ~40-token context
    assert b["scored_tokens"] > 0 and b["batches"] >= 1 and b["tokenize_s"] > 0
    assert rows["serve (local-completions)"]["client"] == {"batch_size": 64, "num_concurrent": 8}
    assert rows["serve (local-completions)"]["serve_mode"] == "process"
    server = rows["serve (local-completions)"]["server"]  # the server's own split, from its /metrics
    assert server["prompts"] == 24 and server["calls"] >= 1 and server["engine"] > 0 and server["format"] > 0
    assert rows["lm-eval harness itself (hf bs=8 run)"]["harness_s"] == rows["hf bs=8"]["harness_s"] > 0
    over = res["prompt_logprobs_overhead"]
    assert set(over) == {"all_positions", "continuation", "plain_s", "all_positions_s", "continuation_s"} | {
        "tokens",
        "floor",
    }
    assert over["plain_s"] > 0 and over["tokens"] > 24 * 30  # every token of the 24 prompts, prefix cache off
    assert 0.5 < over["floor"] < 5  # tiny: head 2 x 64 x 2048 against a 2-layer body of hidden 64
    printed = capsys.readouterr().out
    assert (
        "speedup_vs_best_hf" in printed
        and "claimed_speedup" in printed
        and "log-likelihood breakdown (s): tokenize" in printed
    )
    assert "generate breakdown: 4 requests in 1 engine call(s)" in printed and "host stop checks" in printed
    assert "hf generate breakdown: 4 requests in 1 model.generate calls, 8 decode steps, 32 tokens computed" in printed
    assert "15% is out of reach there" in printed and "prefix cache off" in printed
    # each row is printed as it is measured, before the final table
    assert printed.index("hf bs=8: load") < printed.index("polyrl (in-process): load") < printed.index("backend")


def test_bench_eval_survives_a_failing_row(tmp_path, capsys, monkeypatch):
    from polyrl.bench import eval as bench_eval

    def broken(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'tenacity'")

    monkeypatch.setattr(bench_eval, "_serve_row", broken)  # what the GPU box without lm-eval[api] hit
    torch.set_num_threads(1)
    out = tmp_path / "eval.json"
    prof = tmp_path / "prof"
    argv = [*ARGV[:-1], "", "--gen-docs", "0", "--serve", "--json", str(out), "--profile", str(prof)]  # no hf row
    assert main(argv) == 0
    for name in ("eval_ll.pstats", "eval_ll_cprofile.txt", "eval_ll_torch.txt", "eval_ll_trace.json"):
        assert (prof / name).stat().st_size > 0, name
    assert "Python calls for 24 requests" in (prof / "eval_ll_cprofile.txt").read_text()
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["serve (local-completions)"]["error"] == "ModuleNotFoundError: No module named 'tenacity'"
    assert rows["polyrl (in-process)"]["loglikelihood_s"] > 0
    assert "serve (local-completions): FAILED (ModuleNotFoundError" in capsys.readouterr().out


def test_lm_head_floor_of_scoring_every_position():
    # the arithmetic behind "15% is out of reach when every position is scored" at the shape
    from polyrl.bench.eval import head_flop_share
    from polyrl.models.config import ModelConfig
    from polyrl.models.presets import PRESETS

    share = {
        n: head_flop_share(ModelConfig.from_hf_dict(PRESETS[n].hf)) for n in ("qwen3-0.6b-shape", "qwen3-8b-shape")
    }
    assert abs(share["qwen3-0.6b-shape"] - 2 * 1024 * 151936 / (2 * 28 * 15_728_640)) < 1e-9  # 0.31 / 0.88 GFLOP
    assert 0.35 < share["qwen3-0.6b-shape"] < 0.36 and 0.08 < share["qwen3-8b-shape"] < 0.10
    assert (
        head_flop_share(ModelConfig.from_hf_dict(PRESETS["qwen3-0.6b-shape"].hf), context=90)
        < share["qwen3-0.6b-shape"]
    )


def test_bench_eval_fuse_projections_keeps_the_numbers(tmp_path, capsys):
    """--fuse-projections: the in-process engine runs fused q/k/v + gate/up and still gives hf's numbers and texts."""
    torch.set_num_threads(1)
    out = tmp_path / "eval.json"
    assert main([*ARGV, *GEN, "--fuse-projections", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["fuse_projections"] is True and res["fused_weight_bytes"] > 0
    rows = {r["backend"]: r for r in res["rows"]}
    assert rows["polyrl (in-process)"]["max_abs_diff_vs_hf"] <= 1e-3
    assert rows["polyrl (in-process) generate"]["same_as_hf"] == 1.0
    assert "polyrl engine: fused projections (4 groups" in capsys.readouterr().out
