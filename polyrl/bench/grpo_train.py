"""``polyrl bench grpo --train-phase``: the training phase of one GRPO step alone, next to the SFT engine step on the
same tokens, in one run and without generation (about a minute at the default 64 x 8 x 512 qwen3-0.6b shape on one
H200).

Synthetic rollouts of the bench shape: ``--prompts`` x ``--n`` samples of ``--prompt-len`` random prompt tokens and
``--gen-len`` random completion tokens, with rollout log-probs and pseudo-random rewards (group advantages), packed as
``polyrl train --algo grpo`` packs them (``pack_samples``, ``--micro-batch-tokens``). Each row trains a fresh model
from the same random weights with its own ``TrainEngine`` (bf16 compute, fp32 masters, CUDA graphs where the loss
allows them) for max(``--warmup``, 2) untimed steps (a graph capture is never timed) and ``--steps`` timed optimizer
steps over all the packs:

- ``sft``: ``causal_lm_loss`` on the same packs as ``PackedBatch`` es (same tokens, targets = the completion tokens),
  resident on the device as in ``bench sft``: the engine's SFT step for these tokens;
- ``rl-before``: the GRPO loss as it ran up to 2026-12-02 (``PolicyLoss(graphed=False)``: eager, ``nonzero`` per
  micro-batch, a new loss object per step);
- ``rl``: the graph-safe GRPO loss ``polyrl train`` runs now (one ``PolicyLoss`` kept by the hooks, refilled by
  ``set_step``), with the one-update path's in-loss measurement (mismatch, entropy) and its mismatch max read back
  after each step, as ``OnlineRun.update`` does. RL packs start on the host, as in the run.

Per row: tokens/s and step seconds (median of the timed steps, the engine's own clock), MFU (``StepStats.mfu``:
``DecoderLM.flops_per_token`` over the device peak; n/a on the CPU), graph replays, last loss, peak memory. The
``rl`` and ``rl-before`` losses must agree (printed). ``--profile N`` adds a top-N kernel table of one more step per
row, with wall against kernel time (idle device = the difference). Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import torch

from polyrl.algorithms.advantages import group_advantages
from polyrl.algorithms.grpo import GroupRelative, GRPOConfig, make_policy_loss
from polyrl.algorithms.rl_batch import RLBatch, Sample, pack_samples
from polyrl.bench.common import free_memory, print_table, shape_preset
from polyrl.bench.profile import kernel_table, print_kernel_table
from polyrl.data import TokenizedSeq, pack_sequences
from polyrl.errors import ConfigError
from polyrl.models.decoder import build_model
from polyrl.models.presets import preset_config
from polyrl.platform import device
from polyrl.train import OptimConfig, ScheduleConfig, StepConfig, TrainEngine, causal_lm_loss

ROWS = ("sft", "rl-before", "rl")
GRAPH_WARMUP = 2  # a new shape runs eagerly once, then is captured: never time the capture


def synthetic_samples(vocab: int, args: argparse.Namespace, seed: int = 0) -> list[Sample]:
    """``prompts x n`` samples of exactly ``prompt_len`` + ``gen_len`` random tokens (a group shares its prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(args.prompts):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
        for j in range(args.n):
            completion = torch.randint(0, vocab, (args.gen_len,), generator=g).tolist()
            logprobs = (-3.0 * torch.rand(args.gen_len, generator=g)).tolist()
            out.append(Sample(prompt, completion, logprobs, "length", "", group=p, index=j))
    return out


def rl_packs(samples: list[Sample], budget: int, seed: int = 0) -> list[RLBatch]:
    """The packs of one update with the fields of the one-update path (``OnlineRun.prepare``'s single pass)."""
    rng = random.Random(seed)
    adv = group_advantages([rng.random() for _ in samples], [s.group for s in samples])
    rollout = [s.logprobs for s in samples]
    return pack_samples(samples, {"adv": adv, "rollout_logp": rollout, "old_logp": rollout}, budget)


def sft_packs(samples: list[Sample], packs: list[RLBatch], dev: torch.device) -> list[Any]:
    """The same packs as SFT batches: each sample's tokens, the completion tokens as targets."""
    out = []
    for b in packs:
        seqs = []
        for i in b.sample_ids:
            s = samples[i]
            mask = [0] * len(s.prompt_ids) + [1] * len(s.completion_ids)
            seqs.append(TokenizedSeq(s.prompt_ids + s.completion_ids, mask))
        sb = pack_sequences(seqs)
        if not torch.equal(sb.labels, b.labels):
            raise AssertionError("SFT and RL packs disagree on the targets")  # the comparison would be unfair
        out.append(sb.to(dev))
    return out


def _engine(cfg: Any, args: argparse.Namespace, dev: torch.device) -> TrainEngine:
    model = build_model(cfg, dtype=torch.float32, device=dev, seed=0)
    return TrainEngine(
        model,
        OptimConfig(lr=1e-6),
        ScheduleConfig(decay="constant"),
        engine=StepConfig(micro_batch_tokens=args.micro_batch_tokens),
    )


def time_row(name: str, cfg: Any, samples: list[Sample], args: argparse.Namespace, dev: torch.device) -> dict:
    """Warm-up + timed steps of one row (see the module docstring); the row's summary."""
    free_memory()
    engine = _engine(cfg, args, dev)
    packs = rl_packs(samples, args.micro_batch_tokens)
    tokens = float(sum(b.num_target_tokens for b in packs))
    gcfg = GRPOConfig(max_new_tokens=args.gen_len, samples_per_prompt=args.n, prompts_per_step=args.prompts)
    hooks = GroupRelative(gcfg)
    batches: list[Any] = sft_packs(samples, packs, dev) if name == "sft" else packs

    def step() -> Any:
        if name == "sft":
            return engine.step(batches, causal_lm_loss), None
        if name == "rl-before":
            loss_fn = make_policy_loss(gcfg, tokens, tokens, measure=True, graphed=False)
        else:
            loss_fn = hooks.make_loss(tokens, tokens, measure=True)
        stats = engine.step(batches, loss_fn, tokens)
        return stats, float(loss_fn.mismatch_max)  # read back as OnlineRun.update does

    warmup = max(args.warmup, GRAPH_WARMUP) if dev.type != "cpu" else args.warmup
    losses, timed = [], []
    for i in range(warmup + args.steps):
        stats, _ = step()
        losses.append(stats.loss)
        if i >= warmup:
            timed.append(stats)
    row = {
        "config": name,
        "micro_batches": len(batches),
        "tokens": timed[-1].tokens,
        "step_s": statistics.median(s.time_s for s in timed),
        "tokens_per_s": statistics.median(s.tokens_per_s for s in timed),
        "mfu": statistics.median(s.mfu for s in timed) if all(s.mfu is not None for s in timed) else None,
        "graph_replays": engine.graph_replays,
        "graph_captures": engine.graph_captures,
        "loss": timed[-1].loss,
        "losses": losses,
        "peak_gib": device.max_memory_allocated() / 2**30 if dev.type != "cpu" else None,
    }
    if args.profile and dev.type != "cpu":
        table = kernel_table(step, args.profile)
        print_kernel_table(table, f"{name} training phase profile")
        row["profile"] = table
        row["idle_ms"] = table["wall_ms"] - table["kernel_ms"]
    return row  # the engine, model and packs go with this frame (the next row starts with free_memory)


def run_train_phase(args: argparse.Namespace, shapes: dict[str, str]) -> dict[str, Any]:
    """The ``--train-phase`` mode: the rows of ``--train-rows`` (default all), printed and returned."""
    names = [r.strip() for r in str(args.train_rows).split(",") if r.strip()]
    bad = [r for r in names if r not in ROWS]
    if bad or not names:
        raise ConfigError(f"--train-rows {args.train_rows!r}: choose from {', '.join(ROWS)}")
    if min(args.prompts, args.n, args.prompt_len, args.gen_len, args.steps) < 1 or args.warmup < 0:
        raise ConfigError("--prompts, --n, --prompt-len, --gen-len and --steps must be >= 1, --warmup >= 0")
    dev = device.torch_device()
    cfg = preset_config(shape_preset(args.shape, shapes))
    seq = args.prompt_len + args.gen_len
    if seq > cfg.max_position_embeddings:
        raise ConfigError(f"--prompt-len + --gen-len = {seq} exceeds the {args.shape} context")
    samples = synthetic_samples(cfg.vocab_size, args)
    where = device.name() if dev.type != "cpu" else "cpu"
    print(
        f"# GRPO training phase: {args.shape} on {where}, {len(samples)} samples x ({args.prompt_len} + "
        f"{args.gen_len}) tokens, packs of <= {args.micro_batch_tokens} tokens; next to the SFT engine step on the "
        f"same packs; {args.steps} timed steps per row",
        flush=True,
    )
    rows = []
    for name in names:
        row = time_row(name, cfg, samples, args, dev)
        mfu = f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else ""
        print(f"#   {name}: {row['tokens_per_s']:,.0f} tokens/s, {row['step_s']:.3f} s/step{mfu}", flush=True)
        rows.append(row)
    by = {r["config"]: r for r in rows}
    sft = by.get("sft")
    for r in rows:
        if sft is not None and r is not sft:
            r["vs_sft"] = r["tokens_per_s"] / sft["tokens_per_s"]
    cols = ["config", "micro_batches", "tokens_per_s", "step_s", "mfu", "vs_sft", "graph_replays", "loss", "peak_gib"]
    cols += ["idle_ms"] if any("idle_ms" in r for r in rows) else []
    print_table(rows, cols)
    res: dict[str, Any] = {"train_phase": [{k: v for k, v in r.items() if k != "profile"} for r in rows]}
    if "rl" in by and "rl-before" in by:
        a, b = by["rl"]["losses"], by["rl-before"]["losses"]
        res["rl_loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a, b))
        res["rl_speedup"] = by["rl"]["tokens_per_s"] / by["rl-before"]["tokens_per_s"]
        print(
            f"# rl vs rl-before: {res['rl_speedup']:.2f}x tokens/s; losses over all steps agree to "
            f"{res['rl_loss_max_abs_diff']:.2e}"
        )
    for r in rows:
        if "profile" in r:
            res.setdefault("profiles", {})[r["config"]] = r["profile"]
    return res


__all__ = ["ROWS", "rl_packs", "run_train_phase", "sft_packs", "synthetic_samples"]
