"""FSDP2 on an MoE model, CPU gloo, 2 real processes: the 3-D expert tensors shard along the expert axis like any
weight, and 2 steps with the router aux loss on give the one-process losses, aux metrics and gradient norms (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import VOCAB, global_batches, read_json, spawn, write_json

from polyrl.models import ModelConfig, build_model
from polyrl.train import OptimConfig, PrecisionConfig, TrainEngine

STEPS = 2


def moe_lm(seed: int = 0):
    cfg = ModelConfig.from_hf_dict(
        dict(
            model_type="qwen3_moe",
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        )
    )
    return build_model(cfg, dtype=torch.float32, seed=seed)


def new_engine(model, world=None):
    opt = OptimConfig(lr=2e-2, grad_clip=0.5)
    return TrainEngine(model, opt, precision=PrecisionConfig(compute_dtype="fp32"), total_steps=STEPS, world=world)


def moe_worker(rank: int, world_size: int, workdir: str) -> None:
    from polyrl.train.parallel import destroy_world, init_world, shard_model

    world = init_world()
    model = shard_model(moe_lm(0).to(world.device), world)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    local = tuple(experts.to_local().shape)
    engine = new_engine(model, world)
    stats = [engine.step(global_batches(step)[rank::world_size]) for step in range(STEPS)]
    if rank == 0:
        write_json(
            Path(workdir) / "moe.json",
            {
                "local_shape": local,
                "placements": str(experts.placements),
                "losses": [s.loss for s in stats],
                "aux": [s.metrics["moe/aux_loss"] for s in stats],
                "grad_norms": [s.grad_norm for s in stats],
            },
        )
    destroy_world(world)


def test_two_ranks_shard_experts_and_equal_one_process(tmp_path):
    model = moe_lm(0)
    engine = new_engine(model)
    single = [engine.step(global_batches(step)) for step in range(STEPS)]
    spawn(moe_worker, 2, str(tmp_path))
    dist = read_json(tmp_path / "moe.json")
    assert dist["local_shape"] == [2, 32, 32]  # 4 experts of [2I=32, H=32], two per rank
    assert "Shard(dim=0)" in dist["placements"]
    assert dist["losses"] == pytest.approx([s.loss for s in single], abs=1e-5)
    assert dist["aux"] == pytest.approx([s.metrics["moe/aux_loss"] for s in single], abs=1e-5)
    assert dist["grad_norms"] == pytest.approx([s.grad_norm for s in single], abs=1e-5)
    assert single[0].metrics["moe/aux_loss"] > 0.9
