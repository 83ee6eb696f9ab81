"""`polyrl bench rollout` smoke on the CPU: the engine runs at the tiny shape, the report holds its numbers and, with
--compare-parts, the same runs with launch graphs and skinny projections off; the kernel choice is restored; with
--fuse-projections, the unfused and fused rows of one engine."""

from __future__ import annotations

import json
import os

from polyrl.cli.main import main


def test_bench_rollout_tiny_cpu_compare_parts(tmp_path, capsys, monkeypatch):
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "3", "--prompt-len", "6", "--gen-len", "5"]
    from polyrl.bench import rollout

    built, real_model = [], rollout._model
    monkeypatch.setattr(rollout, "_model", lambda *a, **k: built.append(real_model(*a, **k)) or built[-1])
    flags = ("group_projections", "parallel_projections", "fused_qk_norm_rope")
    before = os.environ.get("POLYRL_KERNELS")
    assert main([*argv, "--baselines", "none", "--compare-parts", "--json", str(out)]) == 0
    # every switch is left as found (the DecoderOptions ones on the model the bench built)
    assert os.environ.get("POLYRL_KERNELS") == before
    (model,) = built
    found = {f: getattr(rollout.DecoderOptions(), f) for f in flags}
    assert {f: getattr(model.options, f) for f in flags} == found
    text = capsys.readouterr().out
    assert "A/B launch_graphs off: tokens/s" in text and "(fused_qk: q/k norms + RoPE in one kernel" in text
    res = json.loads(out.read_text())
    keys = ["engine_tok_s", "engine_batch1_ms_per_token", "engine_batch1_decode_ms_per_token"]
    from polyrl.bench.rollout import PARTS

    for name, _, at_batch, at_one in PARTS:
        for prefix in (f"engine_{name}", f"engine_no_{name}"):
            keys += [f"{prefix}_tok_s"] if at_batch else []
            keys += [f"{prefix}_batch1_decode_ms_per_token"] if at_one else []
    assert len(keys) == 3 + 2 * 7
    for key in keys:
        assert res[key] > 0, key
    assert res["logprob_max_abs_diff"] < 1e-4  # fp32 on the CPU: engine and training forward agree


def test_decode_phase_is_timed_inside_the_run_and_counts_the_tokens_after_the_prefill():
    import torch

    from polyrl.bench.rollout import _model, _run_engine_phased
    from polyrl.infer import LLM, RolloutConfig

    llm = LLM(_model("tiny", torch.float32, torch.device("cpu")), None, RolloutConfig(num_blocks=64, max_num_seqs=8))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    run = _run_engine_phased(llm, prompts, 6, torch.device("cpu"))
    # one prefill step draws every prompt's first token; the 5 tokens after it are the decode phase
    assert run["decode_tokens"] == 3 * 5 and run["decode_steps"] == 5
    assert 0 < run["decode_s"] <= run["total_s"]
    assert [len(o.outputs[0].token_ids) for o in run["outs"]] == [6, 6, 6]


def test_bench_rollout_fuse_projections_times_both_rows(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--shape", "tiny", "--batch", "3", "--prompt-len", "6", "--gen-len", "5"]
    assert main([*argv, "--baselines", "none", "--skip-batch1", "--fuse-projections", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("unfused_tok_s", "fused_tok_s", "unfused_decode_step_ms", "fused_decode_step_ms", "fused_weight_bytes"):
        assert res[key] > 0, key
    assert res["fused_speedup"] == res["fused_tok_s"] / res["unfused_tok_s"]
    assert res["fused_groups"] == 2 * 2  # tiny: 2 layers, q/k/v and gate/up each
    assert res["fused_logprob_max_abs_diff"] < 1e-4  # fp32: the fused engine still matches the training forward
    text = capsys.readouterr().out
    assert "A/B unfused: output tokens/s" in text and "A/B fused:   decode step ms (wall)" in text
