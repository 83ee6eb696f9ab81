"""`polyrl bench sft` smoke: every config runs on the tiny shape, same weights and tokens give the same
loss for polyrl and HF (fp32 on the CPU), the JSON report holds the numbers. GPU: the real shapes run."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.cli.main import main


def test_bench_sft_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "sft", "--shape", "tiny", "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--baselines", "hf,hf-liger", "--numerics", "autocast", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "polyrl vs the fastest baseline" in text
    report = json.loads(out.read_text())
    by_name = {r["name"]: r for r in report["results"]}
    assert list(by_name) == ["polyrl", "hf-autocast", "hf-liger-autocast"]
    ours, hf = by_name["polyrl"], by_name["hf-autocast"]
    assert ours["status"] == hf["status"] == "ok" and ours["tokens_per_s"] > 0
    # On the CPU both run fp32 from the same initial weights on the same tokens: two identical updates.
    assert ours["loss"] == pytest.approx(hf["loss"], rel=1e-4)
    assert by_name["hf-liger-autocast"]["status"] in ("ok",) or by_name["hf-liger-autocast"]["status"].startswith(
        "skipped"
    )
    assert report["ratios"]["fastest"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"], rel=1e-6)


def test_bench_sft_cuda_graphs_both_adds_an_eager_row_per_polyrl_config(tmp_path):
    out = tmp_path / "both.json"
    argv = ["bench", "sft", "--shape", "tiny", "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--cuda-graphs", "both", "--baselines", "hf", "--numerics", "bf16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_name = {r["name"]: r for r in report["results"]}
    assert list(by_name) == ["polyrl", "polyrl-eager", "hf-bf16"]
    # on the CPU nothing is captured: both polyrl rows are the same eager computation
    assert by_name["polyrl-eager"]["loss"] == pytest.approx(by_name["polyrl"]["loss"], rel=1e-6)
    assert set(report["ratios"]) == {"hf-bf16", "fastest"}  # the eager row is ours, not a baseline


def test_bench_sft_checkpointing_and_pure_bf16_reach_both_sides(tmp_path, capsys, monkeypatch):
    """--activation-checkpointing checkpoints the HF baselines too (a fair 8b row); --master-dtype none runs polyrl
    without fp32 masters. On the CPU both sides still compute the same first update from the same weights."""
    from polyrl.bench import sft
    from polyrl.train import optim

    enabled, masters = [], []
    real_enable, real_init = sft.enable_hf_checkpointing, optim.MasterAdamW.__init__

    def spy_enable(model):
        real_enable(model)
        flag = getattr(model, "is_activation_checkpointing", None)  # the older name before transformers 5.2x
        enabled.append((type(model).__name__, model.is_gradient_checkpointing if flag is None else flag))

    def spy_init(self, named_params, cfg, *a, **k):
        masters.append(cfg.master_dtype)
        return real_init(self, named_params, cfg, *a, **k)

    monkeypatch.setattr(sft, "enable_hf_checkpointing", spy_enable)
    monkeypatch.setattr(optim.MasterAdamW, "__init__", spy_init)
    out = tmp_path / "ckpt.json"
    argv = ["bench", "sft", "--shape", "tiny", "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "1"]
    argv += ["--activation-checkpointing", "--master-dtype", "none", "--baselines", "hf", "--numerics", "autocast"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "activation checkpointing, polyrl optim.master_dtype=none" in capsys.readouterr().out
    assert enabled == [("Qwen3ForCausalLM", True)] and masters == ["none"]
    by_name = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert by_name["polyrl"]["loss"] == pytest.approx(by_name["hf-autocast"]["loss"], rel=1e-4)


def test_graph_capture_step_is_never_timed():
    """The second step of a shape is its CUDA-graph capture: polyrl's graphed configs warm up at least 2 steps on an
    accelerator; eager rows, baselines and the CPU keep --warmup."""
    import argparse

    from polyrl.bench.sft import warmup_steps

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = argparse.Namespace(warmup=1, cuda_graphs="auto")
    assert warmup_steps("polyrl", auto, cuda) == 2 and warmup_steps("polyrl-lora", auto, cuda) == 2
    assert warmup_steps("polyrl-eager", auto, cuda) == 1 and warmup_steps("hf-liger-bf16", auto, cuda) == 1
    assert warmup_steps("polyrl", auto, cpu) == 1
    assert warmup_steps("polyrl", argparse.Namespace(warmup=1, cuda_graphs="off"), cuda) == 1
    assert warmup_steps("polyrl", argparse.Namespace(warmup=5, cuda_graphs="auto"), cuda) == 5


def test_bench_sft_rejects_unknown_baseline(capsys):
    assert main(["bench", "sft", "--shape", "tiny", "--baselines", "trl"]) == 2
    assert "unknown baseline(s) ['trl']" in capsys.readouterr().err


def test_bench_sft_lora_tiny_cpu(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    argv = ["bench", "sft", "--shape", "tiny", "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--lora", "r=8,alpha=16", "--baselines", "hf,hf-liger", "--json", str(out)]) == 0
    by_name = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert list(by_name) == ["polyrl-lora", "hf-peft", "hf-peft-liger"]
    ours, hf = by_name["polyrl-lora"], by_name["hf-peft"]
    assert ours["status"] == hf["status"] == "ok" and ours["tokens_per_s"] > 0
    # same base weights and tokens, B = 0 at the start, lr 1e-5: the adapters' different A draws barely matter
    assert ours["loss"] == pytest.approx(hf["loss"], rel=1e-3)


@pytest.mark.gpu
def test_bench_sft_qwen3_shape_gpu(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "sft", "--shape", "qwen3-0.6b", "--seq", "4096", "--batch", "4", "--steps", "3"]
    assert main([*argv, "--baselines", "hf", "--numerics", "bf16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ours, hf = report["results"]
    assert ours["status"] == "ok" and hf["status"] == "ok"
    assert ours["mfu"] is not None and ours["peak_memory_gib"] > 0
    assert ours["loss"] == pytest.approx(hf["loss"], rel=0.05)  # bf16 numerics differ slightly


def test_bench_sft_precision_both_adds_an_fp8_row(tmp_path, monkeypatch, capsys):
    """``--precision both``: polyrl and polyrl-fp8 rows; on the CPU the FP8 row is skipped with the reason unless the
    reference GEMM is forced, then it runs FP8-emulated and its loss is the bf16 row's within 1%; torchao-fp8 rows
    are skipped here (no FP8 GEMM) with the reason."""
    argv = ["bench", "sft", "--shape", "tiny", "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "0"]
    argv += ["--precision", "both", "--baselines", "torchao-fp8"]
    monkeypatch.delenv("POLYRL_KERNELS", raising=False)
    out = tmp_path / "skip.json"
    assert main([*argv, "--json", str(out)]) == 0
    by_name = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert list(by_name) == ["polyrl", "polyrl-fp8", "torchao-fp8-bf16", "torchao-fp8-compile-bf16"]
    assert by_name["polyrl-fp8"]["status"].startswith("skipped: precision.linear = 'fp8'")
    assert by_name["torchao-fp8-bf16"]["status"] == "skipped: this device has no FP8 GEMM (polyrl env: fp8 gemm)"
    monkeypatch.setenv("POLYRL_KERNELS", "fp8_scaled_mm:reference")
    out = tmp_path / "emulated.json"
    assert main([*argv, "--fp8-scaling", "rowwise", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_name = {r["name"]: r for r in report["results"]}
    assert by_name["polyrl-fp8"]["status"] == "ok"
    assert by_name["polyrl-fp8"]["loss"] == pytest.approx(by_name["polyrl"]["loss"], rel=0.01)
    assert by_name["polyrl-fp8"]["loss"] != by_name["polyrl"]["loss"]
    assert "rowwise FP8 forward" in report["header"]


def test_bench_sft_lora_precision_both_adds_an_fp8_base_row(tmp_path, monkeypatch):
    argv = ["bench", "sft", "--shape", "tiny", "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "0"]
    argv += ["--lora", "r=8", "--precision", "both", "--baselines", "none"]
    monkeypatch.delenv("POLYRL_KERNELS", raising=False)
    out = tmp_path / "lora.json"
    assert main([*argv, "--json", str(out)]) == 0
    by_name = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert list(by_name) == ["polyrl-lora", "polyrl-lora-fp8"]
    assert by_name["polyrl-lora-fp8"]["status"].startswith("skipped: precision.linear = 'fp8'")
    monkeypatch.setenv("POLYRL_KERNELS", "fp8_scaled_mm:reference")
    assert main([*argv, "--json", str(out)]) == 0
    by_name = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert by_name["polyrl-lora-fp8"]["status"] == "ok"
    assert by_name["polyrl-lora-fp8"]["loss"] == pytest.approx(by_name["polyrl-lora"]["loss"], rel=0.01)
