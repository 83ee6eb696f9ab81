"""What ``data.fixed_shapes`` buys on chat-like data: the same micro-batches of mixed-length sequences (FFD-packed to
a token budget) trained as packed (shapes change every step: eager), padded to one shape and eager (the padding's
cost alone), and padded and replayed as a CUDA graph (``engine.cuda_graphs``). Prints real (unpadded) tokens/s
of each, the padding share and the graph captures / replays.

    python3 scripts/fixed_shapes_ab.py [--shape qwen3-1.7b] [--budget 8192] [--batches 12] [--lora r=16,alpha=32]
                                       [--activation-checkpointing] [--median-len 600]

Random weights and tokens; sequence lengths log-normal around ``--median-len``. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from polyrl.bench import sft
from polyrl.data import PackedBatchIterator, TokenizedSeq
from polyrl.platform import device

MODES = (("packed, eager", False, False), ("fixed shapes, eager", True, False), ("fixed shapes, graphed", True, None))


def chat_like_units(vocab: int, budget: int, batches: int, median: int, seed: int) -> list[tuple[TokenizedSeq]]:
    """About ``batches`` budgets' worth of sequences, lengths log-normal (sigma 0.8) around ``median``, the first
    third of each without loss (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    units, total = [], 0
    while total < batches * budget:
        n = int(min(budget, max(16, median * math.exp(0.8 * float(torch.randn((), generator=g))))))
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        units.append((TokenizedSeq(ids, [0] * (n // 3) + [1] * (n - n // 3)),))
        total += n
    return units


def make_engine(cfg, args, dev, cuda_graphs):
    from polyrl.models.decoder import build_model
    from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine
    from polyrl.train.precision import resolve_compute_dtype

    ecfg = StepConfig(activation_checkpointing=args.activation_checkpointing, seed=args.seed, cuda_graphs=cuda_graphs)
    if args.lora:
        from polyrl.models.lora import apply_lora, make_lora_config

        dtype = resolve_compute_dtype(PrecisionConfig(), dev.type)
        model = apply_lora(build_model(cfg, dtype=dtype, device=dev, seed=args.seed), make_lora_config(args.lora))
    else:
        model = build_model(cfg, dtype=torch.float32, device=dev, seed=args.seed)
    return TrainEngine(model, OptimConfig(lr=1e-5), ScheduleConfig(decay="constant"), engine=ecfg)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b", choices=list(sft.SHAPES))
    ap.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch (engine.micro_batch_tokens)")
    ap.add_argument("--batches", type=int, default=12, help="micro-batches per pass (one per optimizer step)")
    ap.add_argument("--median-len", type=int, default=600)
    ap.add_argument("--lora", default="r=16,alpha=32", help="LoRA spec; empty for full fine-tuning")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dev = device.torch_device()
    cfg = sft.model_config(args.shape)
    units = chat_like_units(cfg.vocab_size, args.budget, args.batches, args.median_len, args.seed)
    print(f"# {args.shape}, {'LoRA ' + args.lora if args.lora else 'full'}, budget {args.budget}, {len(units)} seqs")
    out = {}
    for label, fixed, graphs in MODES:
        it = PackedBatchIterator(units, args.budget, shuffle=False, max_epochs=1, fixed_shapes=fixed)
        batches = [b.to(dev) for b in it][: args.batches]
        real = sum(b.input_ids.numel() - b.padding_tokens for b in batches)
        engine = make_engine(cfg, args, dev, graphs)
        for b in batches:  # warm-up pass: autotuning, and (graphed) the eager warm-up + capture of the shape
            engine.step([b])
        device.synchronize()
        t0 = time.perf_counter()
        for b in batches:
            engine.step([b])
        device.synchronize()
        dt = time.perf_counter() - t0
        pad = sum(b.padding_tokens for b in batches) / sum(b.input_ids.numel() for b in batches)
        out[label] = real / dt
        print(
            f"{label:<24} {real / dt:>10,.0f} real tokens/s  padding {pad:.1%}  "
            f"captures {engine.graph_captures}  replays {engine.graph_replays}"
        )
        del engine
    return out


if __name__ == "__main__":
    main()
