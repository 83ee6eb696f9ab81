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
    from polyrl.models import decoder

    assert decoder.GROUP_PROJECTIONS is False and decoder.PARALLEL_PROJECTIONS is False  # defaults, restored
    text = capsys.readouterr().out
    assert "A/B launch graphs off: tokens/s" in text
    res = json.loads(out.read_text())
    keys = ["engine_tok_s", "engine_launch_graphs_tok_s", "engine_no_launch_graphs_tok_s", "engine_batch1_ms_per_token"]
    keys += ["engine_parallel_proj_tok_s", "engine_no_parallel_proj_tok_s"]
    for part in ("launch_graphs", "skinny", "grouped"):
        keys += [f"engine_{part}_batch1_decode_ms_per_token", f"engine_no_{part}_batch1_decode_ms_per_token"]
    for key in keys + ["engine_batch1_decode_ms_per_token"]:
        assert res[key] > 0, key
    assert res["logprob_max_abs_diff"] < 1e-4  # fp32 on the CPU: engine and training forward agree


def test_decode_phase_is_timed_inside_the_run_and_counts_the_tokens_after_the_prefill():
    import torch

    from polyrl.bench.rollout import _model, _run_engine_phased
    from polyrl.infer import LLM, EngineConfig

    llm = LLM(_model("tiny", torch.float32, torch.device("cpu")), None, EngineConfig(num_blocks=64, max_num_seqs=8))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    run = _run_engine_phased(llm, prompts, 6, torch.device("cpu"))
    # one prefill step draws every prompt's first token; the 5 tokens after it are the decode phase
    assert run["decode_tokens"] == 3 * 5 and run["decode_steps"] == 5
    assert 0 < run["decode_s"] <= run["total_s"]
    assert [len(o.outputs[0].token_ids) for o in run["outs"]] == [6, 6, 6]
