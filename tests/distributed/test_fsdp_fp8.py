"""FP8 training composes with FSDP2: 2 gloo ranks, each running the FP8-emulated linears (``POLYRL_KERNELS`` forces
the reference GEMM; the children inherit it) on its share of the micro-batches, against the one-process FP8 run of
the same global batches. Every FP8 scale is per micro-batch (activations, gradients) or of the gathered full weight,
so both runs quantise the same tensors: the losses agree to 1e-4 (fp32 reduction order aside), and the rank's layers
really ran FP8 (the same run without FP8 differs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import global_batches, read_json, spawn, tiny_lm, write_json

from polyrl.models.fp8_linear import Fp8Linear
from polyrl.train import OptimConfig, PrecisionConfig, TrainEngine
from polyrl.train.parallel import destroy_world, init_world, shard_model

EMULATE = "fp8_scaled_mm:reference"
STEPS = 3
OPTIM = OptimConfig(lr=2e-2, grad_clip=0.5)


def _engine(model, linear: str, world=None) -> TrainEngine:
    return TrainEngine(model, OPTIM, precision=PrecisionConfig("fp32", linear=linear), total_steps=STEPS, world=world)


def fp8_worker(rank: int, world_size: int, workdir: str) -> None:
    world = init_world()
    model = shard_model(tiny_lm(0).to(world.device), world)
    engine = _engine(model, "fp8", world)
    assert engine.fp8_linears == 14 and sum(isinstance(m, Fp8Linear) for m in model.modules()) == 14
    # sharded weights: no FP8 copy of a gathered weight outlives its forward (the backward casts it again)
    assert not any(m.fp8_keep_weight for m in model.modules() if isinstance(m, Fp8Linear))
    losses = [engine.step(global_batches(step)[rank::world_size]).loss for step in range(STEPS)]
    if world.is_main:
        write_json(Path(workdir) / "fp8.json", {"losses": losses})
    destroy_world(world)


def test_fsdp_two_ranks_fp8_equal_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYRL_KERNELS", EMULATE)  # os.environ: the spawned ranks inherit it
    single = _engine(tiny_lm(0), "fp8")
    single_losses = [single.step(global_batches(step)).loss for step in range(STEPS)]
    plain = _engine(tiny_lm(0), "default")
    plain_losses = [plain.step(global_batches(step)).loss for step in range(STEPS)]
    spawn(fp8_worker, 2, str(tmp_path))
    dist = read_json(tmp_path / "fp8.json")["losses"]
    assert dist == pytest.approx(single_losses, abs=1e-4)
    assert single_losses != pytest.approx(plain_losses, abs=1e-6)
    assert single_losses == pytest.approx(plain_losses, rel=0.01)
