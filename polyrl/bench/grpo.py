"""``polyrl bench grpo``: one GRPO step end to end, split into rollout / log-prob / train, against its roofline and
against TRL's ``GRPOTrainer`` (transformers ``generate``, no vLLM) in the same run when ``trl`` is importable.

Both sides load the same random-weight model folder written by ``polyrl.models.presets`` (``--shape qwen3-0.6b`` =
the ``qwen3-0.6b-shape`` preset), use the same prompts (``--prompts`` texts of about ``--prompt-len`` tokens), ``--n``
samples per prompt, ``--gen-len`` new tokens per sample (ours: EOS ignored; TRL: see ``bench/grpo_trl.py``, whose
settings ``--trl-configs`` are each timed and printed, the ratio against the fastest), a dummy reward (a
deterministic pseudo-random number per completion, so advantages are non-zero) and one optimizer step per batch.

Our step is the RL loop's pieces on a ``ColocatedPolicy``, as ``polyrl train --algo grpo`` runs them with one update
per batch: rollout (KV cache taken back, generate, released), packing, one optimizer step with the GRPO loss whose
forward also measures the rollout/trainer mismatch (``--logprob-pass`` adds the separate no-grad pass that recompute
and several updates per batch need; the roofline counts it only when it runs). Roofline of the step: rollout =
decode bytes (weights once per decode step + the KV cache at the mean context) over the measured copy bandwidth
(``bench/rollout.roofline_tokens_per_s``), plus log-prob pass (forward FLOPs) and train (forward + backward FLOPs,
``DecoderLM.flops_per_token``) over the peak dense bf16 FLOP/s (matmul measured on the CPU). Steady state = median
over ``--steps`` timed steps after ``--warmup``. Measures; asserts nothing.

``--train-phase`` times the training phase alone on synthetic rollouts, next to the SFT engine step on the same
tokens (``bench/grpo_train.py``).
``--async K,..`` (step time per max-staleness K with the real run loop, ``bench/grpo_async.py``) and ``--task
arithmetic --curve-samples N`` (sync vs async reward curves, ``bench/grpo_curve.py``) replace this step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from polyrl.algorithms.advantages import group_advantages
from polyrl.algorithms.grpo import GroupRelative, GRPOConfig
from polyrl.algorithms.rl_batch import pack_samples
from polyrl.bench import grpo_async, grpo_curve, grpo_train
from polyrl.bench.common import free_memory, measure_copy_bandwidth, measure_matmul_flops, shape_preset
from polyrl.bench.grpo_async import add_async_arguments
from polyrl.bench.grpo_trl import TRL_CONFIGS, dummy_reward, prompt_texts, trl_rows
from polyrl.bench.profile import kernel_table, print_kernel_table
from polyrl.bench.rollout import roofline_tokens_per_s
from polyrl.infer import RolloutConfig, SamplingParams
from polyrl.models.presets import create_model_from_preset
from polyrl.platform import device
from polyrl.train import OptimConfig, StepConfig
from polyrl.trainer import Trainer

SHAPES = {
    "tiny": "tiny",
    "small": "small",
    "qwen3-0.6b": "qwen3-0.6b-shape",
    "qwen3-1.7b": "qwen3-1.7b-shape",
    "tiny-moe": "tiny-moe",
    "qwen3-30b-a3b": "qwen3-30b-a3b",  # MoE; with -LN the first N layers
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape",
        default="qwen3-0.6b",
        help=f"model shape (random weights): {', '.join(SHAPES)}; a -LN suffix keeps the first N layers",
    )
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (about)")
    parser.add_argument("--gen-len", type=int, default=512, help="new tokens per sample (fixed)")
    parser.add_argument("--micro-batch-tokens", type=int, default=32768, help="training micro-batch token budget")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--baselines", default="trl", help="comma-separated: trl, or none")
    parser.add_argument(
        "--trl-configs",
        default="fast,old",
        help=f"TRL GRPOTrainer settings to time, comma-separated: {', '.join(TRL_CONFIGS)} (bench/grpo_trl.py); "
        "the ratio is against the fastest",
    )
    parser.add_argument(
        "--logprob-pass",
        action="store_true",
        help="also run the separate no-grad log-prob pass (skipped by `polyrl train` with one update per batch)",
    )
    parser.add_argument(
        "--kv",
        choices=["release", "keep", "both"],
        default="both",
        help="release the KV cache for training and retake it (graphs re-captured) every step, keep it and its "
        'graphs across steps, or time both (--async: the run\'s release_kv = "auto")',
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one more training phase (an update on the last step's batches): top N kernels "
        "and framework ops, with its wall time (accelerators only)",
    )
    parser.add_argument(
        "--routing-replay",
        action="store_true",
        help="MoE: record the rollout's experts and replay them in training (grpo.routing_replay), to time its "
        "cost and see the mismatch it leaves",
    )
    parser.add_argument(
        "--train-phase",
        action="store_true",
        help="time only the training phase on synthetic rollouts of this shape (no generation): the SFT engine step "
        "on the same packs, the GRPO loss before (eager) and now (graph-safe), tokens/s and MFU (bench/grpo_train.py)",
    )
    parser.add_argument(
        "--train-rows", default=",".join(grpo_train.ROWS), help="--train-phase rows, comma list of sft,rl-before,rl"
    )
    parser.add_argument("--model-dir", default=None, help="reuse this model folder (default: a temp folder)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_async_arguments(parser)


def _sync() -> None:
    device.synchronize()


def _on_accelerator() -> bool:
    return device.torch_device().type != "cpu"


# ---- ours ----------------------------------------------------------------------------------------
def ours(model_dir: Path, args: argparse.Namespace, keep_kv: bool = False) -> dict[str, Any]:
    max_len = args.prompt_len * 2 + args.gen_len + 16
    tr = Trainer(
        model=str(model_dir),
        optim=OptimConfig(lr=1e-6),
        engine=StepConfig(micro_batch_tokens=args.micro_batch_tokens),
        rollout=RolloutConfig(
            max_num_seqs=args.prompts * args.n,
            max_model_len=max_len,
            max_num_blocks=args.prompts * args.n * (-(-max_len // 16) + 1),  # as `polyrl train` sizes it
            record_routing=getattr(args, "routing_replay", False),
        ),
        release_kv=not keep_kv,
    )
    texts = prompt_texts(args.prompts, args.prompt_len)
    ids = [tr.encode(t)[: args.prompt_len] for t in texts]
    params = SamplingParams(temperature=1.0, max_tokens=args.gen_len, ignore_eos=True)
    cfg = GRPOConfig(max_new_tokens=args.gen_len, samples_per_prompt=args.n, prompts_per_step=args.prompts)
    hooks = GroupRelative(cfg)
    rows = []
    for step in range(args.warmup + args.steps):
        _sync()
        capture0 = tr.llm.stats()["graph_capture_s"]
        t0 = time.perf_counter()
        samples = tr.rollout_batch(ids, args.n, params, seeds=[step * 100_003 + i for i in range(len(ids))])
        _sync()
        t1 = time.perf_counter()
        rewards = [dummy_reward(s.completion_ids) for s in samples]
        adv = group_advantages(rewards, [s.group for s in samples])
        rollout_lp = [s.logprobs for s in samples]
        if args.logprob_pass:  # the separate no-grad pass (what recompute / several updates per batch need)
            plain = pack_samples(samples, None, args.micro_batch_tokens)
            lps, _ = tr.logprobs(samples, 1.0, batches=plain)
        fields = {"adv": adv, "old_logp": rollout_lp, "rollout_logp": rollout_lp}
        batches = pack_samples(samples, fields, args.micro_batch_tokens)
        _sync()
        t2 = time.perf_counter()
        tokens = float(sum(b.num_target_tokens for b in batches))
        # as `polyrl train --algo grpo` with one update per batch: the training forward measures the mismatch, with
        # the run's loss kept across steps (graph-safe; eager when the KV cache is taken back every step)
        loss_fn = hooks.make_loss(tokens, tokens, measure=True)
        loss_fn.graph_safe = keep_kv
        stats = tr.train(batches, loss_fn, normalizer=tokens)
        mismatch = stats.to_dict()["mismatch_mean"]
        flips = stats.metrics.get("moe/replay_flips")  # with --routing-replay: the routing the replay overrode
        _sync()
        t3 = time.perf_counter()
        capture = tr.llm.stats()["graph_capture_s"] - capture0
        rows.append(
            {"rollout_s": t1 - t0, "logprob_s": t2 - t1, "train_s": t3 - t2, "step_s": t3 - t0, "capture_s": capture}
        )
        print(
            f"# ours ({'keep' if keep_kv else 'release'} KV) step {step + 1}: rollout {t1 - t0:.2f}s "
            f"(graph capture {capture:.2f}s), log-prob {t2 - t1:.2f}s, "
            f"train {t3 - t2:.2f}s "
            f"(loss {stats.loss:.4f}, mismatch mean {mismatch:.2e}"
            f"{f', replay flips {flips:.2%}' if flips is not None else ''}){' [warm-up]' if step < args.warmup else ''}"
        )
    timed = rows[args.warmup :] or rows
    res = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    if args.profile and _on_accelerator():
        table = kernel_table(lambda: tr.train(batches, loss_fn, normalizer=tokens), args.profile)
        print_kernel_table(table, f"ours ({'keep' if keep_kv else 'release'} KV) training phase profile")
        res["train_profile"] = table
    res["kv_dtype_bytes"] = tr.llm.kv.caches[0][0].element_size() if tr.llm.kv.allocated else None
    res["_model"] = tr.model
    return res


def roofline(model: Any, args: argparse.Namespace, dev: torch.device) -> dict[str, float]:
    """Seconds the step would take at the copy-bandwidth / peak-FLOP/s limits, by phase."""
    bw = measure_copy_bandwidth(dev)
    peak = device.peak_bf16_flops() if dev.type != "cpu" else None
    peak = peak or measure_matmul_flops(dev)
    batch = args.prompts * args.n
    kv_bytes = next(model.parameters()).element_size()
    rollout = batch * args.gen_len / roofline_tokens_per_s(model, batch, args.prompt_len, args.gen_len, kv_bytes, bw)
    seq = args.prompt_len + args.gen_len
    train_flops = model.flops_per_token(seq) * seq * batch  # forward + backward
    return {
        "copy_bandwidth_gb_s": bw / 1e9,
        "peak_tflops": peak / 1e12,
        "roofline_rollout_s": rollout,
        "roofline_logprob_s": train_flops / 3 / peak,
        "roofline_train_s": train_flops / peak,
    }


# ---- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if getattr(args, "train_phase", False):  # the training phase alone, next to SFT's step (bench/grpo_train.py)
        res = grpo_train.run_train_phase(args, SHAPES)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    if args.async_k is not None or args.task is not None:  # asynchronous RL: step times per K, or reward curves
        with tempfile.TemporaryDirectory(prefix="polyrl-bench-grpo-async-") as tmp:
            if args.model_dir and (Path(args.model_dir) / "config.json").is_file():
                model_dir = Path(args.model_dir)
            else:
                preset = shape_preset(args.shape, SHAPES)
                model_dir = create_model_from_preset(preset, Path(args.model_dir or tmp) / "model", seed=0)
            mode = grpo_curve.run_curve if args.task is not None else grpo_async.run_async
            res = mode(model_dir, args, Path(tmp))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    dev = device.torch_device()
    tmp = None
    if args.model_dir and (Path(args.model_dir) / "config.json").is_file():
        model_dir = Path(args.model_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="polyrl-bench-grpo-")
        preset = shape_preset(args.shape, SHAPES)
        model_dir = create_model_from_preset(preset, Path(args.model_dir or tmp.name) / "model", seed=0)
    print(
        f"# GRPO step: {args.shape} on {device.name() if dev.type != 'cpu' else 'cpu'}, {args.prompts} prompts x "
        f"{args.n} samples x {args.gen_len} new tokens (prompt ~{args.prompt_len}); {args.warmup} warm-up + "
        f"{args.steps} timed steps"
    )
    res: dict[str, Any] = {"shape": args.shape, "prompts": args.prompts, "n": args.n, "gen_len": args.gen_len}
    modes = {"release": [False], "keep": [True], "both": [False, True]}[args.kv]
    runs = {keep: ours(model_dir, args, keep_kv=keep) for keep in modes}
    best = min(runs, key=lambda keep: runs[keep]["step_s"])
    for keep, r in runs.items():
        model = r.pop("_model")
        r.pop("kv_dtype_bytes", None)
        if len(runs) > 1:
            res.update({f"{k}_{'keep' if keep else 'release'}_kv": v for k, v in r.items()})
    res.update(runs[best])
    res["kv_mode"] = "keep" if best else "release"
    res.update(roofline(model, args, dev))
    if not args.logprob_pass:
        res["roofline_logprob_s"] = 0.0  # no separate pass ran: its work is not part of this step
    res["roofline_step_s"] = res["roofline_rollout_s"] + res["roofline_logprob_s"] + res["roofline_train_s"]
    res["roofline_fraction"] = res["roofline_step_s"] / res["step_s"]
    del model
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    if "trl" in baselines:
        free_memory()  # our engine's cached blocks back before TRL loads
        res.update(trl_rows(model_dir, args, dev))
        if res.get("trl_step_s"):
            res["speedup_vs_trl"] = res["trl_step_s"] / res["step_s"]  # against the fastest TRL setting timed
    _print(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0


def _print(res: dict[str, Any]) -> None:
    rows = [
        ("ours, KV released each step: step s", "step_s_release_kv", "{:.3f}"),
        ("  rollout s", "rollout_s_release_kv", "{:.3f}"),
        ("ours, KV and graphs kept: step s", "step_s_keep_kv", "{:.3f}"),
        ("  rollout s", "rollout_s_keep_kv", "{:.3f}"),
        ("KV mode of the rows below", "kv_mode", "{}"),
        ("ours: step s (steady state)", "step_s", "{:.3f}"),
        ("  rollout s", "rollout_s", "{:.3f}"),
        ("    of which graph capture s", "capture_s", "{:.3f}"),
        ("  log-prob s", "logprob_s", "{:.3f}"),
        ("  train s", "train_s", "{:.3f}"),
        ("roofline step s", "roofline_step_s", "{:.3f}"),
        ("  rollout (copy BW) s", "roofline_rollout_s", "{:.3f}"),
        ("  log-prob (peak FLOP/s) s", "roofline_logprob_s", "{:.3f}"),
        ("  train (peak FLOP/s) s", "roofline_train_s", "{:.3f}"),
        ("fraction of roofline", "roofline_fraction", "{:.0%}"),
        ("copy bandwidth GB/s", "copy_bandwidth_gb_s", "{:,.0f}"),
        ("peak TFLOP/s", "peak_tflops", "{:,.1f}"),
        ("TRL version", "trl_version", "{}"),
        ("TRL setting (fastest timed)", "trl_config", "{}"),
        ("TRL mean completion tokens", "trl_completion_len", "{:.0f}"),
        ("TRL GRPOTrainer first step s", "trl_first_step_s", "{:.3f}"),
        ("TRL GRPOTrainer step s (steady)", "trl_step_s", "{:.3f}"),
        ("speedup vs TRL (step time)", "speedup_vs_trl", "{:.2f}x"),
    ]
    for label, key, fmt in rows:
        if res.get(key) is not None:
            print(f"{label:<34} {fmt.format(res[key])}")
