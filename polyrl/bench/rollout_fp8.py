"""``polyrl bench rollout --precision fp8``: the rollout engine with FP8 projection weights
(``RolloutConfig.weight_precision = "fp8"``, ``polyrl/infer/fp8_weights.py``), and with FP8 weights plus an FP8 KV
cache (``kv_cache_dtype = "fp8_e4m3"``, ``polyrl/infer/kv_cache.py``), against the same engine in the model's
precision, in the same run, on the same model and prompts (``--precision fp8-kv``: the FP8 weights + KV engine only).
Per engine (``VARIANTS``):

- output and decode-phase tokens/s and the ratio to the model-precision run just timed by ``bench/rollout.py`` (same
  warm-up, same phased timing), the decode step's wall time and its graph's device time;
- its decode roofline: the bench's (weights once + the KV cache at the mean context, over the copy bandwidth) with the
  weights as this engine stores them (FP8 projections) and the KV at its element size, and the fraction reached;
- the log-prob mismatch of its timed samples against a training-style packed forward in the model's precision (max /
  mean |engine - train|, the same check as the model-precision row);
- greedy agreement with the model's precision over the first ``--agree-tokens`` tokens of ``--agree-seqs`` prompts:
  the share of positions where the two free-running greedy sequences hold the same token (one flip changes the
  rest of a sequence, so this falls with length), and the teacher-forced share - the engine's greedy token against the
  model-precision argmax on its own context (a training-style packed forward), which does not compound;
- its KV blocks (an FP8 cache holds twice as many in the same memory), the FP8 copies' bytes (extra memory on top of
  the model's weights) and the time to build it (quantise once, allocate the cache).

The bench's weights are random (a preset shape): agreement on a trained model is what the RL metrics
(``mismatch_*``) show; this measures speed and gives a same-run numerics sanity check. It asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.attention_metadata import AttnMetadata

# --precision -> the engines timed besides the model-precision one: key prefix -> (label, RolloutConfig overrides)
VARIANTS = {
    "fp8": ("FP8", {"weight_precision": "fp8"}),
    "fp8kv": ("FP8+KV", {"weight_precision": "fp8", "kv_cache_dtype": "fp8_e4m3"}),
    "fp8kvf": ("FP8+KV fused", {"weight_precision": "fp8", "kv_cache_dtype": "fp8_e4m3", "fuse_projections": True}),
}
PRECISIONS = {"model": (), "fp8": ("fp8", "fp8kv"), "fp8-kv": ("fp8kv",), "fp8-kv-fused": ("fp8kv", "fp8kvf")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="model",
        help="fp8: also time the engine with FP8 projection weights, and with FP8 weights + an FP8 KV cache, in the "
        "same run, with greedy agreement and log-prob mismatch; fp8-kv: only the FP8 weights + FP8 KV engine; "
        "fp8-kv-fused: that engine and the same with q/k/v and gate/up as one FP8 GEMM each (fuse_projections)",
    )
    parser.add_argument("--agree-tokens", type=int, default=64, help="--precision fp8: greedy tokens compared")
    parser.add_argument("--agree-seqs", type=int, default=32, help="--precision fp8: prompts compared")


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def sequence_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two free-running greedy sequences hold the same token."""
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    return same / max(sum(min(len(sa), len(sb)) for sa, sb in zip(a, b)), 1)


@torch.inference_mode()
def teacher_forced_agreement(model, prompts: list[list[int]], outs: list[list[int]]) -> float:
    """Share of ``outs`` tokens that are the model's own argmax on the same context (the model's precision)."""
    dev = next(model.parameters()).device
    same = total = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor(p + o, device=dev)
        hidden = model(ids, torch.arange(len(ids), device=dev), AttnMetadata.from_seqlens([len(ids)], dev))
        argmax = model.compute_logits(hidden[len(p) - 1 : -1], upcast=False).argmax(-1).tolist()
        same += sum(x == y for x, y in zip(argmax, o))
        total += len(o)
    return same / max(total, 1)


class Measures(NamedTuple):
    """``bench/rollout.py``'s own measurements, handed in (it imports this module): ``replay_ms(llm, batch)``,
    ``logprob_agreement(model, outs, count)`` and ``roofline(model, batch, prompt_len, gen_len, kv_bytes, bw)``."""

    replay_ms: Callable
    logprob_agreement: Callable
    roofline: Callable


def run_fp8(
    model, prompts, args, dev, ecfg: RolloutConfig, res: dict, base_greedy, timed_run, measures: Measures
) -> None:
    """The rows of ``res`` for each engine ``args.precision`` names (``PRECISIONS``; module docstring).
    ``base_greedy``: the model-precision engine's greedy tokens of ``prompts[:agree_seqs]`` (taken before it was
    released); ``timed_run(llm)`` is the bench's phased run (``bench/rollout._run_engine_phased`` on the bench's
    prompts), so every engine is timed the same way."""
    for prefix in PRECISIONS[args.precision]:
        run_variant(prefix, model, prompts, args, ecfg, res, base_greedy, timed_run, measures)


def run_variant(
    prefix: str, model, prompts, args, ecfg: RolloutConfig, res: dict, base_greedy, timed_run, measures: Measures
) -> None:
    """One engine of ``VARIANTS``: build (quantise), capture, warm up, time; then log-prob mismatch against the
    training forward, greedy agreement with the model's precision, and its decode roofline (weights as it stores them:
    FP8 projections, the rest in the model's dtype; KV at its element size) from the bench's copy bandwidth."""
    t0 = time.perf_counter()
    llm = LLM(model, None, dataclasses.replace(ecfg, **VARIANTS[prefix][1]))
    res[f"{prefix}_quantize_s"] = time.perf_counter() - t0
    fp8 = llm.runner.fp8  # None for an engine with the model's weights
    res[f"{prefix}_weight_bytes"] = fp8.nbytes if fp8 is not None else 0
    res[f"{prefix}_kv_blocks"] = llm.kv.num_blocks
    res[f"{prefix}_graph_capture_s"] = llm.capture_graphs(args.batch)
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=min(args.gen_len, 16), ignore_eos=True))
    llm.reset_prefix_cache()
    full = timed_run(llm)
    res[f"{prefix}_tok_s"] = args.batch * args.gen_len / full["total_s"]
    res[f"{prefix}_decode_tok_s"] = full["decode_tokens"] / full["decode_s"]
    res[f"{prefix}_decode_step_ms"] = 1e3 * full["decode_s"] / full["decode_steps"]
    res[f"{prefix}_speedup"] = res[f"{prefix}_tok_s"] / res["engine_tok_s"]
    res[f"{prefix}_decode_speedup"] = res[f"{prefix}_decode_tok_s"] / res["engine_decode_tok_s"]
    replay = measures.replay_ms(llm, args.batch)
    if replay is not None:
        res[f"{prefix}_graph_replay_ms"] = replay
    if "copy_bandwidth_gb_s" in res:
        bw = res["copy_bandwidth_gb_s"] * 1e9
        kv_elem = llm.kv.caches[0][0].element_size()
        # the bench's roofline at this KV element size, less the bytes the FP8 copies save over the projections
        step = args.batch * bw / measures.roofline(model, args.batch, args.prompt_len, args.gen_len, kv_elem, bw)
        saved = 0 if fp8 is None else sum(lin.weight.numel() * lin.weight.element_size() for lin in fp8.entries)
        saved -= res[f"{prefix}_weight_bytes"]
        res[f"{prefix}_roofline_tok_s"] = args.batch * bw / (step - saved)
        res[f"{prefix}_roofline_fraction"] = res[f"{prefix}_decode_tok_s"] / res[f"{prefix}_roofline_tok_s"]
    lp_max, lp_mean = measures.logprob_agreement(model, full["outs"], args.logprob_seqs)
    res[f"{prefix}_logprob_max_abs_diff"], res[f"{prefix}_logprob_mean_abs_diff"] = lp_max, lp_mean
    k = min(args.agree_seqs, len(prompts))
    mine = greedy(llm, prompts[:k], args.agree_tokens)
    res[f"{prefix}_greedy_agreement"] = sequence_agreement(base_greedy, mine)
    res[f"{prefix}_teacher_forced_agreement"] = teacher_forced_agreement(model, prompts[:k], mine)
    res[f"{prefix}_agree_tokens"] = args.agree_tokens
    llm.release()


# (label after the variant's, key suffix, format)
ROWS = [
    ("output tokens/s", "tok_s", "{:,.0f}"),
    ("decode-phase tokens/s", "decode_tok_s", "{:,.0f}"),
    ("/ model precision (output)", "speedup", "{:.2f}x"),
    ("/ model precision (decode)", "decode_speedup", "{:.2f}x"),
    ("decode step ms (wall)", "decode_step_ms", "{:.2f}"),
    ("graph replay ms (device only)", "graph_replay_ms", "{:.2f}"),
    ("decode roofline tokens/s", "roofline_tok_s", "{:,.0f}"),
    ("fraction of roofline (decode)", "roofline_fraction", "{:.0%}"),
    ("log-prob |eng - train| max", "logprob_max_abs_diff", "{:.2e}"),
    ("log-prob |eng - train| mean", "logprob_mean_abs_diff", "{:.2e}"),
    ("greedy agree (sequences)", "greedy_agreement", "{:.1%}"),
    ("greedy agree (teacher-forced)", "teacher_forced_agreement", "{:.1%}"),
    ("KV cache blocks", "kv_blocks", "{:,}"),
    ("weight copies GiB", "weight_bytes", "{:.2f}"),
    ("build s (quantise, KV alloc)", "quantize_s", "{:.2f}"),
]


def print_rows(res: dict) -> None:
    for prefix, (name, _) in VARIANTS.items():
        for label, suffix, fmt in ROWS:
            key = f"{prefix}_{suffix}"
            if key in res:
                value = res[key] / 2**30 if suffix == "weight_bytes" else res[key]
                print(f"{f'{name} {label}':<36} {fmt.format(value)}")
