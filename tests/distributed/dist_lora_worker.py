"""What each gloo rank runs for ``test_lora_data_parallel.py``:

- ``lora_step_worker``: LoRA (and QLoRA) replicas of the tiny model (``replicate_model``), ``STEPS`` engine steps on
  the rank-strided share of each step's 4 micro-batches (fp32, grad clip on); every rank writes its adapter weights to
  ``<workdir>/<kind>-rank<r>.safetensors`` and its step stats (loss, grad norm, tokens) to ``<kind>-rank<r>.json``.
- ``resume_worker``: two ``polyrl.run`` runs from raw config dicts, an uninterrupted one and a resume of
  its checkpoint (the torchrun path without the launcher: ``init_world`` reads the variables ``dist_helpers.spawn``
  sets).
"""

from __future__ import annotations

from pathlib import Path

import torch
from dist_helpers import global_batches, tiny_lm, write_json

from polyrl.models.lora import LoraConfig, adapter_parameters, apply_lora
from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, TrainEngine
from polyrl.train.parallel import destroy_world, init_world, replicate_model

OPTIM = OptimConfig(lr=2e-2, grad_clip=0.2, weight_decay=0.01)  # the clip is active: the norm must be global
STEPS = 2
KINDS = {"lora": LoraConfig(r=4, alpha=8), "qlora": LoraConfig(r=4, alpha=8, quantize_base="nf4")}


def lora_model(kind: str):
    return apply_lora(tiny_lm(0), KINDS[kind], seed=0)


def new_engine(model, world=None):
    fp32 = PrecisionConfig(compute_dtype="fp32")
    return TrainEngine(model, OPTIM, ScheduleConfig(decay="constant"), fp32, world=world)


def save_adapters(model, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in adapter_parameters(model).items()}, str(path))


def lora_step_worker(rank: int, world_size: int, workdir: str) -> None:
    world = init_world()
    for kind in KINDS:
        model = lora_model(kind)
        if rank:  # another init on the other ranks: replicate_model must make rank 0's adapters everyone's
            with torch.no_grad():
                for p in adapter_parameters(model).values():
                    p.add_(1.0)
        replicate_model(model, world)
        engine = new_engine(model, world)
        stats = [engine.step(global_batches(step)[rank::world_size]) for step in range(STEPS)]
        save_adapters(model, Path(workdir) / f"{kind}-rank{rank}.safetensors")
        numbers = {k: [getattr(s, k) for s in stats] for k in ("loss", "grad_norm", "tokens")}
        write_json(Path(workdir) / f"{kind}-rank{rank}.json", numbers)
    destroy_world(world)


def resume_worker(rank: int, world_size: int, whole: dict, resumed: dict, port: int) -> None:
    """Run ``whole`` (3 steps, a checkpoint at 2); then, in a new process group on ``port``, rank 0 makes
    ``resumed["out"]`` a copy of that run as it was at its step-2 checkpoint and every rank runs ``resumed``."""
    import os
    import shutil

    from polyrl import run as runner
    from polyrl.run import config as rc

    runner.run(rc.build(whole))  # starts and ends its own process group
    os.environ["MASTER_PORT"] = str(port)
    world = init_world()  # the resumed run joins this one (and tears it down)
    if world.is_main:
        out = Path(resumed["out"])
        shutil.copytree(whole["out"], out)
        shutil.rmtree(out / "checkpoints" / "step-00000003")
        shutil.rmtree(out / "final")
    world.barrier()
    runner.run(rc.build(resumed))
