"""FP8 KV cache (``RolloutConfig.kv_cache_dtype = "fp8_e4m3"``, ``polyrl/infer/kv_cache.py``): the config values, the
block count doubling for the same memory, the engine on the CPU reference (what the cache holds, greedy agreement and
log-prob mismatch against the fp32 training forward), the refusal on a CUDA device without FP8 conversions, and on the
GPU a graph-captured bf16 engine with FP8 KV against the bf16-KV engine."""

from __future__ import annotations

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.infer import kv_cache as kv_cache_mod
from polyrl.infer.kv_cache import KVCache
from polyrl.kernels import token_logprobs
from polyrl.kernels.paged_attention.reference import quantize_kv
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.decoder import build_model, init_weights

from .conftest import tiny_config

FP8 = torch.float8_e4m3fn
WIDER = dict(hidden_size=64, intermediate_size=128, head_dim=16)


def _model(seed: int = 0, std: float = 0.05, **over):
    model = build_model(tiny_config(**{**WIDER, **over}), dtype=torch.float32, seed=seed)
    return init_weights(model, seed=seed, std=std).eval()


def _prompts(count: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 14, (count,), generator=g)]


def test_kv_cache_dtype_values():
    assert RolloutConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's alias
    assert RolloutConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="fp8_e4m3"):
        RolloutConfig(kv_cache_dtype="fp8_e5m2")


def test_serve_flag_sets_the_kv_cache_dtype():
    import argparse

    from polyrl.cli import serve

    def engine(*argv: str) -> RolloutConfig:
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        return serve.build_configs(parser.parse_args(["--model", "m", *argv]))[1]

    assert engine("--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8_e4m3"
    assert engine("--kv-cache-dtype", "bfloat16").kv_cache_dtype == "bfloat16"
    assert engine().kv_cache_dtype is None  # auto: the model's dtype
    with pytest.raises(SystemExit):
        engine("--kv-cache-dtype", "int8")


def test_fp8_cache_holds_twice_the_blocks_in_the_same_memory():
    model = _model()
    cfg = dict(block_size=4, cpu_kv_cache_bytes=1 << 20, max_num_seqs=64, max_model_len=256)
    wide = KVCache(RolloutConfig(**cfg, kv_cache_dtype="bfloat16"), model.config, torch.float32, torch.device("cpu"))
    fp8 = KVCache(RolloutConfig(**cfg, kv_cache_dtype="fp8"), model.config, torch.float32, torch.device("cpu"))
    assert fp8.caches[0][0].dtype == FP8 and fp8.caches[0][0].element_size() == 1
    assert fp8.block_bytes * 2 == wide.block_bytes == 2 * 2 * 4 * 2 * 16 * 2  # K+V x layers x page x Hk x D x 2 B
    assert fp8.num_blocks == 2 * wide.num_blocks == 2 * ((1 << 20) // wide.block_bytes)


def _engine_vs_training_forward(model, kv_dtype, n=16):
    """Greedy through the engine; returns (outs, per-token |engine log-prob - training forward log-prob| [N],
    share of engine tokens that are the training forward's argmax on the same context)."""
    llm = LLM(model, None, RolloutConfig(num_blocks=256, block_size=4, kv_cache_dtype=kv_dtype))
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0))
    diffs, agree, total = [], 0, 0
    with torch.no_grad():
        for out in outs:
            got = out.outputs[0].token_ids
            ids = torch.tensor(out.prompt_token_ids + got)
            hidden = model(ids, torch.arange(len(ids)), AttnMetadata.from_seqlens([len(ids)], "cpu"))
            rows = hidden[len(out.prompt_token_ids) - 1 : -1]
            ref = token_logprobs(rows, model.lm_head_weight, torch.tensor(got))
            diffs.append((torch.tensor(out.outputs[0].logprobs) - ref).abs())
            agree += sum(a == b for a, b in zip(model.compute_logits(rows).argmax(-1).tolist(), got))
            total += len(got)
    return llm, outs, torch.cat(diffs), agree / total


def test_engine_with_fp8_kv_on_the_reference():
    """The CPU engine (reference write + reference paged attention) with FP8 blocks: its tokens/log-probs stay close
    to the fp32 training forward while differing measurably, and the cache holds the fp32 engine's keys and values
    rounded to e4m3."""
    model = _model()
    _, _, plain_diff, plain_agree = _engine_vs_training_forward(model, None)
    llm, _, diff, agree = _engine_vs_training_forward(model, "fp8")
    assert llm.kv.caches[0][0].dtype == FP8
    assert plain_agree == 1.0 and plain_diff.max().item() < 1e-4
    # observed (2026-12-02, this random model): mean |dlogprob| 1.1e-2, max 0.066 (fp32 KV: 2e-7 / 7e-7); 0.96 of
    # the FP8-KV greedy tokens are the fp32 training forward's argmax on the same context
    assert 1e-3 < diff.mean().item() < 3e-2 and diff.max().item() < 0.2
    assert agree >= 0.9
    # what the cache holds: after prefills only (max_tokens=1 writes no sampled token), layer 0's keys and values
    # depend on the prompt alone, so the FP8 blocks are exactly the fp32 engine's blocks rounded to e4m3
    one = SamplingParams(temperature=0.0, max_tokens=1)
    cfg = dict(num_blocks=64, block_size=4, enable_prefix_caching=False)
    wide = LLM(model, None, RolloutConfig(**cfg))
    narrow = LLM(model, None, RolloutConfig(**cfg, kv_cache_dtype="fp8_e4m3"))
    wide.generate(_prompts(), one)
    narrow.generate(_prompts(), one)
    for got, want in zip(narrow.kv.caches[0], wide.kv.caches[0]):
        assert want.abs().sum() > 0
        assert torch.equal(got.view(torch.uint8), quantize_kv(want, FP8).view(torch.uint8))


def test_fp8_kv_is_refused_on_a_cuda_device_without_fp8(monkeypatch):
    monkeypatch.setattr(kv_cache_mod.device, "supports_fp8_gemm", lambda index=0: False)
    monkeypatch.setattr(kv_cache_mod.device, "name", lambda index=0: "an old GPU")
    monkeypatch.delenv("POLYRL_KERNELS", raising=False)
    if kv_cache_mod.registry.select("paged_attention", "cuda", "bfloat16")[0] != "triton":
        pytest.skip("triton does not load here, so CUDA would run the reference, which any device may")
    with pytest.raises(ConfigError, match=r"compute capability >= 8.9.*POLYRL_KERNELS=paged_attention:reference"):
        kv_cache_mod.check_fp8_kv_supported(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv("POLYRL_KERNELS", "paged_attention:reference,kv_cache_write:reference")
    kv_cache_mod.registry.reset_cache()
    try:
        kv_cache_mod.check_fp8_kv_supported(torch.device("cuda"), torch.bfloat16)  # the slow reference: allowed
    finally:
        monkeypatch.delenv("POLYRL_KERNELS")
        kv_cache_mod.registry.reset_cache()
    kv_cache_mod.check_fp8_kv_supported(torch.device("cpu"), torch.float32)  # the CPU runs the reference


@pytest.mark.gpu
def test_gpu_engine_with_fp8_kv_graphs_and_agreement():
    """A bf16 engine on the GPU with FP8 blocks: decode steps replay CUDA graphs, the cache is e4m3 and holds ~2x the
    blocks, and against the bf16 training forward its greedy tokens (teacher-forced) agree about as well as the
    bf16-KV engine's while its sampled-token log-probs differ more, but little."""
    import dataclasses

    from polyrl.platform import device

    if device.device_type() != "cuda" or not device.supports_fp8_gemm():
        pytest.skip("needs a CUDA device with FP8 conversions (compute capability >= 8.9)")
    dev = torch.device("cuda")
    cfg = tiny_config(hidden_size=512, intermediate_size=1024, head_dim=128, num_heads=8, num_kv_heads=2,
                      num_layers=4, vocab_size=2048, max_position_embeddings=1024)  # fmt: skip
    model = init_weights(build_model(cfg, dtype=torch.bfloat16, seed=0), seed=0, std=0.05).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 2048, (32, 100), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0)

    def run(kv_dtype):
        # sized from free memory, with the utilisation line set so that ~2 GiB are left for the cache (all of an
        # H200 would be millions of blocks for the block manager to list)
        rcfg = RolloutConfig(max_num_seqs=32, max_model_len=200, kv_cache_dtype=kv_dtype)
        free, total = device.mem_get_info()
        want = total - free + (2 << 30) + kv_cache_mod.activation_reserve(rcfg, cfg, torch.bfloat16)
        llm = LLM(model, None, dataclasses.replace(rcfg, gpu_memory_utilization=min(1.0, want / total)))
        outs = llm.generate(prompts, params)
        used_graph = llm.runner.last_step_used_graph
        blocks, dtype = llm.kv.num_blocks, llm.kv.caches[0][0].dtype
        llm.release()
        agree = total_tokens = 0
        diffs = []
        with torch.no_grad():
            for out in outs[:16]:
                got = out.outputs[0].token_ids
                ids = torch.tensor(out.prompt_token_ids + got, device=dev)
                hidden = model(ids, torch.arange(len(ids), device=dev), AttnMetadata.from_seqlens([len(ids)], dev))
                rows = hidden[len(out.prompt_token_ids) - 1 : -1]
                ref = token_logprobs(rows, model.lm_head_weight, torch.tensor(got, device=dev))
                diffs.append((torch.tensor(out.outputs[0].logprobs, device=dev) - ref.float()).abs())
                argmax = model.compute_logits(rows, upcast=False).argmax(-1).tolist()
                agree += sum(a == b for a, b in zip(argmax, got))
                total_tokens += len(got)
        return dict(graph=used_graph, blocks=blocks, dtype=dtype, agree=agree / total_tokens,
                    diff=torch.cat(diffs).mean().item())  # fmt: skip

    base, fp8 = run(None), run("fp8")
    assert fp8["dtype"] == FP8 and base["dtype"] == torch.bfloat16 and fp8["graph"] and base["graph"]
    assert fp8["blocks"] >= 1.8 * base["blocks"]  # the same ~2 GiB hold ~2x the blocks
    # a random bf16 model's logits are nearly flat, so e4m3's ~6% relative error in K/V flips some argmaxes: the H200
    # measured 0.865 against bf16 KV's 0.979 (a wrong scale or layout drops agreement towards 1/vocab)
    assert fp8["agree"] >= 0.8 and fp8["agree"] >= base["agree"] - 0.15  # CPU twin (fp32, 128 wide): 0.92
    assert base["diff"] < fp8["diff"] < 0.1  # CPU twin: 3.6e-7 -> 2.2e-2


@pytest.mark.parametrize("value, want", [("fp8", "fp8_e4m3"), ("model", None)])
def test_rollout_kv_dtype_reaches_the_rl_runs_engine(value, want):
    """``polyrl train --rollout-kv-dtype fp8`` -> ``<algo>.rollout_kv_dtype`` -> the RL run's ``RolloutConfig``."""
    import argparse
    import types

    from polyrl.algorithms.online_config import OnlineConfig
    from polyrl.cli import train
    from polyrl.run.online import OnlineRun

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--algo", "grpo", "--rollout-kv-dtype", value])
    assert dict(train.overrides_from_args(args))["grpo.rollout_kv_dtype"] == value
    assert parser.parse_args(train.relaunch_argv(args)).rollout_kv_dtype == value  # --nproc-per-node keeps it
    run = types.SimpleNamespace(
        a=OnlineConfig(rollout_kv_dtype=value), prompt_ids=[[1, 2, 3]], eval_set=None,
        cfg=types.SimpleNamespace(episodes=None),
    )  # fmt: skip
    assert OnlineRun.rollout_config(run).kv_cache_dtype == want
    with pytest.raises(ConfigError, match='rollout_kv_dtype must be "model" or "fp8"'):
        OnlineConfig(rollout_kv_dtype="fp8_e5m2")
