"""SFT step throughput of the FSDP2 engine on N ranks (run under torchrun; the lead runs it on H200 x2/x4).

    torchrun --standalone --nproc-per-node N tests/distributed/scaling.py --shape qwen3-1.7b --seq 4096 --batch 4

Each rank trains ``--batch`` random sequences of ``--seq`` tokens per step (one packed micro-batch; the
per-rank batch is fixed, so N ranks do N times the work: weak scaling), bf16 compute through FSDP2's
mixed-precision policy, fp32 masters/reduction, grad clip 1.0. Rank 0 prints one JSON line: global tokens/s,
tokens/s per GPU, MFU per GPU, peak memory, last loss. Per-GPU efficiency at N = (tokens/s per GPU at N) /
(tokens/s at 1), with N=1 from the same script (``--nproc-per-node 1``). This script asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-1.7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true")
    args = p.parse_args()

    from polyrl.bench.sft import model_config
    from polyrl.data.batch import pack_sequences
    from polyrl.data.examples import TokenizedSeq
    from polyrl.models.decoder import build_model
    from polyrl.platform import device
    from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine
    from polyrl.train.parallel import destroy_world, init_world, shard_model

    world = init_world()
    cfg = model_config(args.shape)
    model = build_model(cfg, dtype=torch.float32, device=world.device, seed=0)
    dtype = torch.bfloat16 if device.is_accelerator() else torch.float32
    if world.distributed:
        shard_model(model, world, dtype)
    engine = TrainEngine(
        model,
        OptimConfig(lr=1e-5, grad_clip=1.0),
        ScheduleConfig(decay="constant"),
        precision=PrecisionConfig(compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32"),
        engine=StepConfig(activation_checkpointing=args.activation_checkpointing, seed=world.rank),
        world=world,
    )
    g = torch.Generator().manual_seed(world.rank)
    seqs = [torch.randint(0, cfg.vocab_size, (args.seq,), generator=g).tolist() for _ in range(args.batch)]
    batch = pack_sequences([TokenizedSeq(s, [0] + [1] * (len(s) - 1)) for s in seqs])
    for _ in range(args.warmup):
        engine.step([batch])
    device.synchronize()
    world.barrier()
    device.reset_peak_memory_stats()
    t0, mfus = time.perf_counter(), []
    for _ in range(args.steps):
        stats = engine.step([batch])
        mfus.append(stats.mfu or 0.0)
    device.synchronize()
    dt = time.perf_counter() - t0
    tokens = args.steps * args.seq * args.batch * world.world_size
    if world.is_main:
        row = {
            "shape": args.shape,
            "world_size": world.world_size,
            "tokens_per_s": tokens / dt,
            "tokens_per_s_per_gpu": tokens / dt / world.world_size,
            "mfu_per_gpu": sum(mfus) / len(mfus),
            "peak_memory_gib": device.max_memory_allocated() / 1024**3,
            "loss": stats.loss,
            "device": device.name(),
        }
        print(json.dumps(row), flush=True)
    destroy_world(world)


if __name__ == "__main__":
    main()
