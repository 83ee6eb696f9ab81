"""FP8 training composes with FSDP2: 2 gloo ranks, each running the FP8-emulated linears (``POLYRL_KERNELS`` forces
the reference GEMM; the children inherit it) on its share of the micro-batches, against the one-process FP8 run of
the same global batches. With the gradient scaled current (``fp8_linear.GRAD_SCALING = "current"``) every FP8 scale
is per micro-batch (activations, gradients) or of the gathered full weight, so both runs quantise the same tensors:
the losses agree to 1e-4 (fp32 reduction order aside), and the rank's layers really ran FP8 (the same run without
FP8 differs). With the default delayed gradient scale each rank scales dY from the amax of its own previous
micro-batch (the one process from the micro-batch before): the same within FP8's rounding (1%), not bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import global_batches, read_json, spawn, tiny_lm, write_json

from polyrl.models import fp8_linear as fl
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
    out = {}
    for grad_scaling in fl.GRAD_SCALINGS:
        fl.GRAD_SCALING = grad_scaling
        model = shard_model(tiny_lm(0).to(world.device), world)
        engine = _engine(model, "fp8", world)
        assert engine.fp8_linears == 14 and sum(isinstance(m, Fp8Linear) for m in model.modules()) == 14
        # sharded weights: no FP8 copy of a gathered weight outlives its forward (the backward casts it again)
        assert not any(m.fp8_keep_weight for m in model.modules() if isinstance(m, Fp8Linear))
        out[grad_scaling] = [engine.step(global_batches(step)[rank::world_size]).loss for step in range(STEPS)]
    if world.is_main:
        write_json(Path(workdir) / "fp8.json", out)
    destroy_world(world)


def _single(linear: str) -> list[float]:
    engine = _engine(tiny_lm(0), linear)
    return [engine.step(global_batches(step)).loss for step in range(STEPS)]


def test_fsdp_two_ranks_fp8_equal_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYRL_KERNELS", EMULATE)  # os.environ: the spawned ranks inherit it
    plain_losses = _single("default")
    delayed = _single("fp8")
    monkeypatch.setattr(fl, "GRAD_SCALING", "current")
    single_losses = _single("fp8")
    spawn(fp8_worker, 2, str(tmp_path))
    dist = read_json(tmp_path / "fp8.json")
    assert dist["current"] == pytest.approx(single_losses, abs=1e-4)
    assert single_losses != pytest.approx(plain_losses, abs=1e-6)
    assert single_losses == pytest.approx(plain_losses, rel=0.01)
    assert dist["delayed"] == pytest.approx(delayed, rel=0.01) and delayed == pytest.approx(plain_losses, rel=0.01)
    assert dist["delayed"] != pytest.approx(dist["current"], abs=1e-6)
