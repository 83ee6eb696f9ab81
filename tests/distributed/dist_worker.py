"""What each gloo rank runs for ``test_fsdp.py`` (one spawn, several checks, to keep the suite fast):

1. 3 FSDP2 steps on the rank-strided share of each step's 4 micro-batches (fp32, grad clip on), with a
   sharded checkpoint after step 2;
2. a resume of the parent's ONE-process checkpoint (step 2) into a fresh sharded model, then step 3;
3. the HF export of the 3-step weights (one folder, rank 0);
4. data-parallel greedy rollout of ``PROMPTS`` with gathered full weights.
Rank 0 writes the numbers to ``<workdir>/dist.json``.
"""

from __future__ import annotations

from pathlib import Path

from dist_helpers import PROMPTS, global_batches, tiny_lm, write_json

from polyrl.train import OptimConfig, PrecisionConfig, TrainEngine
from polyrl.train.parallel import (
    destroy_world,
    export_hf,
    generate_data_parallel,
    init_world,
    load_any_checkpoint,
    rollout_model,
    save_sharded_checkpoint,
    shard_model,
)

OPTIM = OptimConfig(lr=2e-2, grad_clip=0.5, weight_decay=0.01)
STEPS = 3


def new_engine(model, world=None):
    # fp32 compute everywhere (the default on an accelerator would be bf16), so one process and N ranks can be
    # compared at a tight tolerance on the GPU too
    return TrainEngine(model, OPTIM, precision=PrecisionConfig(compute_dtype="fp32"), total_steps=STEPS, world=world)


def train_worker(rank: int, world_size: int, workdir: str) -> None:
    work = Path(workdir)
    world = init_world()
    model = shard_model(tiny_lm(0).to(world.device), world)
    engine = new_engine(model, world)
    losses, norms, tokens = [], [], []
    for step in range(STEPS):
        stats = engine.step(global_batches(step)[rank::world_size])
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        tokens.append(stats.tokens)
        if step + 1 == 2:
            save_sharded_checkpoint(work / "ckpt", 2, model, engine, world, data_state={"position": 2})
    export_hf(model, world, work / "hf")

    from polyrl.infer import LLM, RolloutConfig, SamplingParams

    plain = rollout_model(model)
    llm = LLM(plain, None, RolloutConfig(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32))
    outs = generate_data_parallel(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), world)

    resumed = shard_model(tiny_lm(7).to(world.device), world)  # other init: the checkpoint must overwrite it all
    engine2 = new_engine(resumed, world)
    loaded = load_any_checkpoint(work / "single" / "step-00000002", resumed, engine2, world)
    resumed_loss = engine2.step(global_batches(2)[rank::world_size]).loss
    if world.is_main:
        write_json(
            work / "dist.json",
            {
                "losses": losses,
                "grad_norms": norms,
                "tokens": tokens,
                "rollout": [o.outputs[0].token_ids for o in outs],
                "rollout_logprobs": [o.outputs[0].logprobs for o in outs],
                "resumed_step": loaded.step,
                "resumed_loss": resumed_loss,
                "resumed_global_step": engine2.global_step,
            },
        )
    destroy_world(world)
