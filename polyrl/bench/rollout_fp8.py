"""``polyrl bench rollout --precision fp8``: the rollout engine with FP8 projection weights
(``RolloutConfig.weight_precision = "fp8"``, ``polyrl/infer/fp8_weights.py``) against the same engine in the model's
precision, in the same run, on the same model and prompts:

- output and decode-phase tokens/s of the FP8 engine and the ratio to the model-precision run just timed by
  ``bench/rollout.py`` (same warm-up, same phased timing);
- greedy agreement with the model's precision over the first ``--agree-tokens`` tokens of ``--agree-seqs`` prompts:
  the share of positions where the two free-running greedy sequences hold the same token (one flip changes the
  rest of a sequence, so this falls with length), and the teacher-forced share - FP8's greedy token against the
  model-precision argmax on FP8's own context (a training-style packed forward), which does not compound;
- the FP8 copies' bytes (extra memory on top of the model's weights) and the time to quantise them once.

The bench's weights are random (a preset shape): agreement on a trained model is what the RL metrics
(``mismatch_*``) show; this measures speed and gives a same-run numerics sanity check. It asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.attention_metadata import AttnMetadata


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        choices=["model", "fp8"],
        default="model",
        help="fp8: also time the engine with FP8 projection weights in the same run, with greedy agreement",
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


def run_fp8(model, prompts, args, dev, ecfg: RolloutConfig, res: dict, base_greedy, timed_run) -> None:
    """The FP8 engine's rows of ``res`` (module docstring). ``base_greedy``: the model-precision engine's greedy
    tokens of ``prompts[:agree_seqs]`` (taken before it was released); ``timed_run(llm)`` is the bench's phased run
    (``bench/rollout._run_engine_phased`` on the bench's prompts), so both engines are timed the same way."""
    t0 = time.perf_counter()
    llm = LLM(model, None, dataclasses.replace(ecfg, weight_precision="fp8"))
    res["fp8_quantize_s"] = time.perf_counter() - t0
    res["fp8_weight_bytes"] = llm.runner.fp8.nbytes
    res["fp8_graph_capture_s"] = llm.capture_graphs(args.batch)
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=min(args.gen_len, 16), ignore_eos=True))
    llm.reset_prefix_cache()
    full = timed_run(llm)
    res["fp8_tok_s"] = args.batch * args.gen_len / full["total_s"]
    res["fp8_decode_tok_s"] = full["decode_tokens"] / full["decode_s"]
    res["fp8_speedup"] = res["fp8_tok_s"] / res["engine_tok_s"]
    res["fp8_decode_speedup"] = res["fp8_decode_tok_s"] / res["engine_decode_tok_s"]
    k = min(args.agree_seqs, len(prompts))
    mine = greedy(llm, prompts[:k], args.agree_tokens)
    res["fp8_greedy_agreement"] = sequence_agreement(base_greedy, mine)
    res["fp8_teacher_forced_agreement"] = teacher_forced_agreement(model, prompts[:k], mine)
    res["fp8_agree_tokens"] = args.agree_tokens
    llm.release()


ROWS = [
    ("FP8 engine output tokens/s", "fp8_tok_s", "{:,.0f}"),
    ("FP8 engine decode-phase tokens/s", "fp8_decode_tok_s", "{:,.0f}"),
    ("FP8 / model precision (output)", "fp8_speedup", "{:.2f}x"),
    ("FP8 / model precision (decode)", "fp8_decode_speedup", "{:.2f}x"),
    ("FP8 greedy agree (sequences)", "fp8_greedy_agreement", "{:.1%}"),
    ("FP8 greedy agree (teacher-forced)", "fp8_teacher_forced_agreement", "{:.1%}"),
    ("FP8 weight copies GiB", "fp8_weight_bytes", "{:.2f}"),
    ("FP8 quantise s (once, at build)", "fp8_quantize_s", "{:.2f}"),
]


def print_rows(res: dict) -> None:
    for label, key, fmt in ROWS:
        if key in res:
            value = res[key] / 2**30 if key == "fp8_weight_bytes" else res[key]
            print(f"{label:<36} {fmt.format(value)}")
