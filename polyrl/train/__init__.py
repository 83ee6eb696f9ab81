"""polyrl.train: the training engine every recipe (SFT, DPO, GRPO, PPO) runs on.

The caller owns the loop; the engine owns one optimizer step. A complete run::

    from polyrl.train import (TrainEngine, OptimConfig, ScheduleConfig, PrecisionConfig, StepConfig,
                              CheckpointConfig, CheckpointManager, MetricsLogger, latest_checkpoint,
                              load_checkpoint, causal_lm_loss)

    engine = TrainEngine(model, OptimConfig(lr=1e-5), ScheduleConfig(warmup_ratio=0.03),
                         PrecisionConfig(), StepConfig(seed=0), total_steps=N)   # model already on device
    ckpts = CheckpointManager(run_dir, CheckpointConfig(every_n_steps=100, keep_last_k=2))
    start, data_state = 0, {}
    if (last := latest_checkpoint(run_dir)) is not None:                     # --resume
        loaded = load_checkpoint(last, model, engine)                        # weights, optimizer, RNG
        start, data_state = loaded.step, loaded.data_state
    log = MetricsLogger(run_dir, total_steps=N, start_step=start)
    for step in range(start, N):
        micro_batches = ...                    # list of PackedBatch for this step (token budgets below)
        stats = engine.step(micro_batches, causal_lm_loss)                   # -> StepStats
        log.log(stats)
        if ckpts.should_save(step + 1):
            ckpts.save(step + 1, model, engine, data_state=..., config=resolved_config)
    ckpts.save(N, model, engine, data_state=..., config=resolved_config)     # final (if cfg.save_final)
    log.close()                                                              # summary.json, metrics.png

Pieces (one concept per module):

- ``config``: ``OptimConfig``, ``ScheduleConfig``, ``CheckpointConfig``, ``PrecisionConfig``,
  ``StepConfig`` dataclasses, validated on construction (``ConfigError`` says what to change).
  ``StepConfig.micro_batch_tokens`` / ``step_tokens`` are the token budgets the data packer fills
  (``accumulation_steps`` = step_tokens // micro_batch_tokens); the engine takes whatever list it gets.
- ``engine.TrainEngine(model, optim, schedule, precision, engine, total_steps)``:
  ``step(micro_batches, loss_fn=causal_lm_loss, normalizer=None) -> StepStats``. ``loss_fn(model,
  batch) -> (loss_sum, metrics)`` returns SUMS; the engine divides the loss and every metric by one
  ``normalizer`` for the whole step (default: total ``num_target_tokens``; RL passes e.g. the global
  token or sequence count), so micro-batching never changes the update. Then global grad norm (fp32,
  before clipping, reported), clip to ``optim.grad_clip``, NaN/Inf guard (skip, count,
  ``NonFiniteLossError`` after ``nan_guard_max_consecutive`` in a row), lr from the schedule, AdamW.
  The schedule is indexed by ``engine.global_step`` (steps run, skipped ones included).
  Construction casts trainable params IN PLACE to the compute dtype (bf16 on accelerators, fp32 on
  CPU), keeps ``Parameter`` identity (the rollout engine may share the tensors after this point), sets
  ``model.gradient_checkpointing``, compiles ``model.model.layers[i]`` when ``engine.compile``.
- ``optim.MasterAdamW``: fp32 masters + moments, torch AdamW (fused on accelerators, foreach on
  CPU), weight decay on >= 2-D weights by default. Gradients land in fp32 ``master.grad`` during
  backward (``param.grad`` is None afterwards for bf16 params): read them via ``engine.optimizer.grads()``.
  Its update rule is an updater from ``optim.UPDATERS``: ``optim_torch`` (torch AdamW), ``optim_8bit``
  (``optim.name = "adamw8bit"``: blockwise 8-bit moments, ``kernels.adamw8bit``), ``optim_offload``
  (``optim.offload = "cpu"``: masters and moments in host memory; docs/optim8.md).
- ``schedule.lr_at(step, base_lr, cfg, total_steps)``: pure function (exact resume, no state).
- ``moe_loss.MoELoss``: for an MoE model, each micro-batch's loss runs under a recording ``models.moe.Routing``;
  the router load-balancing loss and z-loss are reported (``moe/aux_loss``, ``moe/z_loss``) and added with HF's
  coefficients (``router_aux_loss_coef`` when ``output_router_logits``; ``StepConfig.moe_aux_loss_coef`` /
  ``moe_z_loss_coef`` override); a micro-batch's ``routing_replay`` forces its experts.
- ``losses.causal_lm_loss``: summed token cross-entropy via ``kernels.linear_cross_entropy``;
  ``losses.attention_metadata(batch)`` builds the training ``AttnMetadata`` of a packed batch.
- ``checkpoint``: ``CheckpointManager``, ``save_checkpoint`` (atomic), ``latest_checkpoint``,
  ``load_checkpoint`` -> ``LoadedCheckpoint(step, data_state, config, ...)``; ``data_state`` is the
  caller's opaque, JSON-serialisable data position.
- ``metrics.MetricsLogger``: metrics.jsonl, TensorBoard (if installed), progress, summary, plot.

Not here: data loading/packing (``polyrl.data``), algorithm losses (``polyrl.algorithms``), FSDP2
data parallelism (``train/parallel``: ``TrainEngine(..., world=world)`` on a sharded model), the CLI.
"""

from polyrl.train.checkpoint import (
    CheckpointManager,
    LoadedCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from polyrl.train.config import CheckpointConfig, OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig
from polyrl.train.engine import NonFiniteLossError, StepStats, TrainEngine, seed_everything
from polyrl.train.losses import attention_metadata, causal_lm_loss
from polyrl.train.metrics import MetricsLogger, plot_metrics
from polyrl.train.optim import MasterAdamW
from polyrl.train.precision import resolve_compute_dtype
from polyrl.train.schedule import lr_at

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "StepConfig",
    "LoadedCheckpoint",
    "MasterAdamW",
    "MetricsLogger",
    "NonFiniteLossError",
    "OptimConfig",
    "PrecisionConfig",
    "ScheduleConfig",
    "StepStats",
    "TrainEngine",
    "attention_metadata",
    "causal_lm_loss",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "lr_at",
    "plot_metrics",
    "resolve_compute_dtype",
    "save_checkpoint",
    "seed_everything",
]
