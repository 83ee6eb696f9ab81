"""PPO with a learned critic as a registered online algorithm: the ``[ppo]`` config, the value loss, the critic and
the run (``OnlineRun`` of ``polyrl.algorithms.online`` with PPO's advantage stage and a critic update).

Per RL step: sample completions (``samples_per_prompt``, default 1: PPO needs no groups) and score them; one no-grad
pass gives the trainer's log-probs (mismatch, ``old_logprobs``), the reference's (only with ``kl_coef`` > 0) and the
critic's values ``V_t`` of every completion token; token rewards = the score on the last token ``- kl_coef x KL_t``
(KL in the reward, estimator ``kl_estimator``); GAE(``gamma``, ``lam``) -> advantages and returns
(``polyrl.algorithms.gae``); advantages whitened over the step's tokens (``whiten_advantages``). Then, for
``ppo_epochs`` x ``mini_batches``: a critic step on the clipped value loss
``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` (``value_clip`` = c; 0: unclipped), and, once
``critic_warmup_steps`` RL steps have passed, a policy step on the clipped ratio loss of ``losses.policy_loss``
(the same math as GRPO), aggregated by ``loss_agg``.

The critic is a separate model (``polyrl.models.value_head``): initialised from ``critic_model`` or the policy
checkpoint with a zero head, trained by its own ``TrainEngine`` with ``critic_lr`` (default ``optim.lr``) and the
run's other optimizer settings. Its checkpoints go to ``<out>/critic/checkpoints/step-*`` (saved before the
policy's, so every policy checkpoint has its critic; resume restores both), the final critic to
``<out>/critic/final`` (``AutoModelForTokenClassification`` loads it).

Under torchrun (``--nproc-per-node N``) the critic is FSDP2-sharded like the policy and each rank works on its
share of each mini-batch (``OnlineRun.share`` / ``even_out``): values, GAE and the updates on its own samples;
advantage whitening and the metrics use global sums; critic checkpoints are sharded.
Not here: the loop itself, rewards, the policy-loss math (``losses``), GAE.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrl.algorithms import AlgorithmSpec
from polyrl.algorithms.losses import AGGREGATIONS, KL_ESTIMATORS, aggregate, kl_penalty, policy_loss
from polyrl.algorithms.online import OnlineConfig, OnlineRun
from polyrl.errors import CheckpointError, ConfigError

OLD_LOGPROBS = ("rollout", "recompute")
CRITIC_DIR = "critic"
PLOT_SERIES = ("reward", "eval_reward", "value_loss", "explained_variance", "kl", "mismatch_mean", "clip_fraction")


@dataclass
class PPOConfig(OnlineConfig):
    """The ``[ppo]`` table: the rollout/loop settings of ``OnlineConfig`` plus PPO's."""

    samples_per_prompt: int = 1
    prompts_per_step: int = 32
    clip_low: float = 0.2
    clip_high: float = 0.2
    value_clip: float | None = 0.2  # 0 or None: unclipped value loss
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    kl_coef: float = 0.0  # KL penalty in the reward; > 0 keeps a frozen copy of the initial weights
    kl_estimator: str = "k1"
    loss_agg: str = "token-mean"
    old_logprobs: str = "rollout"  # rollout (the engine's) | recompute (the trainer's, before the update)
    critic_model: str | None = None  # HF folder (a critic or a causal LM); None: the policy checkpoint
    critic_lr: float | None = None  # None: optim.lr
    critic_warmup_steps: int = 0  # RL steps that update only the critic

    def table_name(self) -> str:
        return "ppo"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.table_name()
        if not (0.0 <= self.clip_low < 1.0) or not self.clip_high >= 0.0:
            raise ConfigError(
                f"{n}.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.value_clip is not None and not self.value_clip >= 0:
            raise ConfigError(f"{n}.value_clip must be >= 0 (e.g. 0.2; 0 = an unclipped value loss)")
        for key in ("gamma", "lam"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"{n}.{key} must be in [0, 1], got {v!r}")
        if not self.kl_coef >= 0:
            raise ConfigError(f"{n}.kl_coef must be >= 0 (0 turns the KL penalty and the reference model off)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"{n}.kl_estimator={self.kl_estimator!r}: use one of {', '.join(KL_ESTIMATORS)}")
        if self.loss_agg not in AGGREGATIONS:
            raise ConfigError(f"{n}.loss_agg={self.loss_agg!r}: use one of {', '.join(AGGREGATIONS)}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ConfigError(f"{n}.old_logprobs={self.old_logprobs!r}: use 'rollout' or 'recompute'")
        if self.critic_lr is not None and not self.critic_lr > 0:
            raise ConfigError(f"{n}.critic_lr must be > 0 (e.g. 1e-5), or unset to use optim.lr")
        w = self.critic_warmup_steps
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ConfigError(f"{n}.critic_warmup_steps must be a non-negative integer, got {w!r}")


# ---- losses -------------------------------------------------------------------------------------
def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``[T]`` and the indicator ``[T]`` of tokens where the clipped term is larger
    (its gradient is zero there): ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype).detach()


def make_value_loss(cfg: PPOConfig, tokens_in_step: float, step_normalizer: float):
    """The critic's engine loss ``(critic, RLBatch) -> (loss_sum, metric_sums)`` (token mean over the step)."""
    from polyrl.train.losses import attention_metadata

    scale = step_normalizer / max(tokens_in_step, 1.0)

    def loss_fn(model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v = model.value(batch.input_ids, batch.position_ids, attention_metadata(batch))  # [T]
        f, m = batch.fields, batch.mask
        per_tok, clipped = value_loss(v, f["old_value"], f["returns"], cfg.value_clip or None)
        loss_sum, _ = aggregate(per_tok, m, batch.seq_index, batch.num_sequences, "token-mean")
        metrics = {"value_clip_fraction": (clipped * m).sum() * scale, "value_pred": (v.detach() * m).sum() * scale}
        return loss_sum, metrics

    return loss_fn


def make_policy_loss(cfg: PPOConfig, tokens_in_step: float, step_normalizer: float):
    """The policy's engine loss: ``losses.policy_loss`` (token ratio, asymmetric clip) with the batch's ``adv`` and
    ``old_logp`` fields, aggregated by ``loss_agg``; clip fraction and ratio as means over the step's tokens."""
    from polyrl.algorithms.colocated import completion_logprobs

    scale = step_normalizer / max(tokens_in_step, 1.0)

    def loss_fn(model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, _ = completion_logprobs(model, batch, cfg.temperature)
        f, m, b = batch.fields, batch.mask, batch.num_sequences
        per_tok, info = policy_loss(
            logp, f["old_logp"], f["adv"], m, batch.seq_index, b, clip_low=cfg.clip_low, clip_high=cfg.clip_high
        )
        loss_sum, _ = aggregate(per_tok, m, batch.seq_index, b, cfg.loss_agg, cfg.max_new_tokens)
        metrics = {
            "clip_fraction": (info["clipped"] * m).sum() * scale,
            "ratio_mean": (info["ratio"] * m).sum() * scale,
        }
        return loss_sum, metrics

    return loss_fn


class PPOHooks:
    """The ``OnlineRun`` hooks of PPO: the score passes through as the per-sample "advantage" (``PPORun.prepare``
    turns it into token advantages), every sample is trained on."""

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def advantages(self, rewards: list[float], groups: list[int]) -> tuple[list[float], list[int], dict[str, float]]:
        return list(rewards), list(range(len(rewards))), {}

    def normalizer(self, tokens: float, sequences: int) -> float:
        from polyrl.algorithms.losses import normalizer

        return normalizer(self.cfg.loss_agg, tokens, sequences, self.cfg.max_new_tokens)

    def make_loss(self, tokens_in_step: float, normalizer: float):
        return make_policy_loss(self.cfg, tokens_in_step, normalizer)


# ---- the critic ---------------------------------------------------------------------------------
class Critic:
    """A ``ValueModel`` and its own ``TrainEngine`` (the run's optimizer settings with ``critic_lr``); FSDP2-sharded
    when ``world`` is distributed."""

    def __init__(self, cfg: Any, total_steps: int, world: Any = None) -> None:
        from polyrl.models.value_head import load_value_model
        from polyrl.platform import device
        from polyrl.train import TrainEngine

        a = cfg.algo_config
        self.world = world if world is not None and world.distributed else None
        dev = self.world.device if self.world is not None else device.torch_device()
        from polyrl.models.lora import base_model_path

        # a LoRA run started from an adapter folder: the critic starts from its base (a full-parameter critic)
        self.model = load_value_model(a.critic_model or base_model_path(cfg.model), torch.float32, dev)
        if self.world is not None:
            from polyrl.train import resolve_compute_dtype
            from polyrl.train.parallel import shard_model

            shard_model(self.model, self.world, resolve_compute_dtype(cfg.precision, dev.type))
        optim = dataclasses.replace(cfg.optim, lr=a.critic_lr if a.critic_lr is not None else cfg.optim.lr)
        self.engine = TrainEngine(
            self.model, optim, cfg.schedule, cfg.precision, cfg.engine, total_steps, world=self.world
        )
        self.device = self.engine.device

    @torch.no_grad()
    def values(self, batches: list[Any], num_samples: int) -> list[torch.Tensor]:
        """Per sample: the critic's value at each completion token (fp32 CPU ``[c]``)."""
        from polyrl.train.losses import attention_metadata

        out: list[torch.Tensor] = [torch.zeros(0)] * num_samples
        was_training = self.model.training
        self.model.eval()
        try:
            for b in batches:  # sharded: every rank runs the same number (padding batches included)
                b = b.to(self.device)
                v = self.model.value(b.input_ids, b.position_ids, attention_metadata(b))
                if b.num_target_tokens == 0:
                    continue  # a padding micro-batch
                for j, x in zip(b.sample_ids, b.per_sample(v)):
                    out[j] = x.float().cpu()
        finally:
            self.model.train(was_training)
        return out


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over tokens (1: perfect critic, 0: no better than a constant); NaN if Var(R)=0."""
    var = returns.var(unbiased=False)
    return float(1.0 - (returns - values).var(unbiased=False) / var) if var > 0 else float("nan")


# ---- the run ------------------------------------------------------------------------------------
class PPORun(OnlineRun):
    """``OnlineRun`` with PPO's ``prepare`` (values, GAE) and ``update`` (critic, then policy after warm-up)."""

    def __init__(self, cfg: Any, stream: Any = None) -> None:
        super().__init__(cfg, PPOHooks(cfg.algo_config), stream)
        a = cfg.algo_config
        self.critic = Critic(cfg, self.steps * a.ppo_epochs * a.mini_batches, self.world)
        self.critic_ckpts = self._critic_manager() if self.world.is_main else None  # rank 0 cleans stale dirs
        self.world.barrier()
        self.critic_ckpts = self.critic_ckpts or self._critic_manager()
        self._step = self.start  # RL steps finished (the step a checkpoint is written for)
        self._current = self.start  # the RL step being prepared / updated (0-based)
        if self.start_point is not None:
            self._load_critic()

    def _critic_manager(self) -> Any:
        from polyrl.train import CheckpointManager

        return CheckpointManager(self.out / CRITIC_DIR, dataclasses.replace(self.cfg.checkpoint, dir=None))

    def _load_critic(self) -> None:
        from polyrl.train import load_checkpoint
        from polyrl.train.checkpoint import step_dir_name

        path = self.critic_ckpts.root / step_dir_name(self.start)
        if not (path / "manifest.json").is_file():
            raise CheckpointError(
                f"no critic checkpoint {path} for policy checkpoint step {self.start}; a PPO run saves both"
            )
        from polyrl.train import parallel as par

        if self.world.distributed or par.is_sharded_checkpoint(path):
            par.load_any_checkpoint(path, self.critic.model, self.critic.engine, self.critic.world)
        else:
            load_checkpoint(path, self.critic.model, self.critic.engine)

    def data_state(self) -> dict[str, Any]:
        # Called by OnlineRun.run right before each policy checkpoint (on every rank): the critic's first, same step.
        if self.world.distributed:
            from polyrl.train.parallel import save_sharded_checkpoint

            save_sharded_checkpoint(
                self.critic_ckpts.root, self._step, self.critic.model, self.critic.engine, self.world
            )
            if self.world.is_main:
                self.critic_ckpts.prune()
            self.world.barrier()
        else:
            self.critic_ckpts.save(self._step, self.critic.model, self.critic.engine, tokenizer=self.tokenizer)
        return super().data_state()

    def step(self, step: int) -> dict[str, Any]:
        rec = super().step(step)
        self._step = step + 1
        return rec

    def prepare(
        self, step: int, samples: list[Any], scores: list[float], keep: list[int]
    ) -> tuple[list[list[Any]], dict[str, float]]:
        """Mini-batches with per-token ``adv``, ``old_logp``, ``old_value``, ``returns``; measurement metrics. Each
        rank handles its share of every mini-batch (all of it in one process)."""
        import time

        from polyrl.algorithms.colocated import pack_samples
        from polyrl.algorithms.gae import gae, pad_rows, token_rewards, unpad_rows, whiten

        a = self.a
        self._current = step
        t0 = time.perf_counter()
        budget = self.policy.micro_batch_tokens
        groups = [self.share(g) for g in self.split(step, keep)]
        mine = [i for g in groups for i in g]
        plain = [b for g in groups for b in pack_samples(samples, None, budget, g)]
        lps, ents = self.policy.logprobs(samples, a.temperature, entropy=True, batches=plain)
        rollout_lp = [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]
        old = rollout_lp if a.old_logprobs == "rollout" else lps
        values = self.critic.values(self.even_out([plain], samples, keep[0])[0], len(samples))
        old_pad, mask = pad_rows([old[i] for i in mine])
        kl_pad = None
        if self.policy.ref_model is not None:
            refs, _ = self.policy.logprobs(samples, a.temperature, model=self.policy.ref_model, batches=plain)
            # the trainer's log-probs on both sides: exactly 0 before the first update
            kl_pad, _ = pad_rows([kl_penalty(lps[i], refs[i], a.kl_estimator) for i in mine])
        v_pad, _ = pad_rows([values[i] for i in mine])
        rewards = token_rewards(torch.tensor([scores[i] for i in mine], dtype=torch.float32), mask, kl_pad, a.kl_coef)
        adv, returns = gae(rewards, v_pad, mask, a.gamma, a.lam)
        raw_adv = adv
        sel = mask > 0
        n, adv_sum, adv_sq = self.global_sums(sel, raw_adv[sel], raw_adv[sel] ** 2)
        if a.whiten_advantages and n >= 2:
            if self.world.distributed:  # global mean and unbiased variance over every rank's tokens
                mean = adv_sum / n
                var = max(adv_sq - n * mean * mean, 0.0) / (n - 1)
                adv = torch.where(sel, (adv - mean) * (var + 1e-8) ** -0.5, torch.zeros_like(adv))
            else:
                adv = whiten(adv, mask)
        fields: dict[str, list[Any]] = {k: [None] * len(samples) for k in ("adv", "old_logp", "old_value", "returns")}
        for i, ad, ret in zip(mine, unpad_rows(adv, mask), unpad_rows(returns, mask)):
            fields["adv"][i], fields["returns"][i] = ad.tolist(), ret.tolist()
            fields["old_logp"][i], fields["old_value"][i] = old[i].tolist(), values[i].tolist()
        batches = self.even_out([pack_samples(samples, fields, budget, g) for g in groups], samples, keep[0])
        mismatch_mean, mismatch_max = self.global_stats([(rollout_lp[i] - lps[i]).abs() for i in mine])
        v, r = v_pad[sel], returns[sel]
        _, v_sum, r_sum, r_sq, d_sum, d_sq = self.global_sums(sel, v, r, r * r, r - v, (r - v) ** 2)
        var_r = r_sq / max(n, 1) - (r_sum / max(n, 1)) ** 2
        var_d = d_sq / max(n, 1) - (d_sum / max(n, 1)) ** 2
        m = {
            "mismatch_mean": mismatch_mean,
            "mismatch_max": mismatch_max,
            "entropy": self.global_stats([ents[i] for i in mine])[0],
            "values_mean": v_sum / max(n, 1),
            "returns_mean": r_sum / max(n, 1),
            "advantages_mean": adv_sum / max(n, 1),
            "explained_variance": 1.0 - var_d / var_r if var_r > 0 else float("nan"),
            "logprob_s": time.perf_counter() - t0,
        }
        if kl_pad is not None:
            m["kl"] = self.global_stats([kl_pad[sel]])[0]
        return batches, m

    def update(self, batches: list[list[Any]]) -> dict[str, float]:
        """Critic steps, then (after ``critic_warmup_steps`` RL steps) ``OnlineRun.update``'s policy steps."""
        import time

        a = self.a
        t0 = time.perf_counter()
        recs = []
        for _ in range(a.ppo_epochs):
            for mb in batches:
                tokens = self.world.sum_float(sum(b.num_target_tokens for b in mb))  # every rank's share
                loss_fn = make_value_loss(a, tokens, tokens)
                recs.append(self.critic.engine.step(mb, loss_fn, tokens).to_dict())
        n = len(recs)
        out = {
            "value_loss": sum(r["loss"] for r in recs) / n,
            "value_clip_fraction": sum(r["value_clip_fraction"] for r in recs) / n,
            "critic_grad_norm": sum(r["grad_norm"] for r in recs) / n,
            "critic_lr": recs[-1]["lr"],
            "critic_s": time.perf_counter() - t0,
        }
        if self._current < a.critic_warmup_steps:
            out["policy_updated"] = 0.0
            return out
        out.update(super().update(batches))
        out["policy_updated"] = 1.0
        return out

    def run(self) -> dict[str, Any]:
        summary = super().run()
        if self.cfg.train.save_final_model:
            from polyrl.models.value_head import save_value_model

            out = Path(self.cfg.out) / CRITIC_DIR / "final"
            if self.world.distributed:
                from polyrl.models.value_head import mark_token_classification
                from polyrl.train.parallel import export_hf

                path = export_hf(self.critic.model, self.world, out, tokenizer=self.tokenizer)
                if path is not None:
                    mark_token_classification(path)
            else:
                path = save_value_model(self.critic.model, out, self.tokenizer)
            if self.world.is_main:
                summary["final_critic"] = str(path)
                self.print(f"final critic: {path}")
        return summary


def run(cfg: Any) -> dict[str, Any]:
    """``polyrl train --algo ppo`` (one process or under torchrun)."""
    from polyrl.algorithms.online import run_online

    return run_online(cfg, None, run_cls=PPORun)


SPEC = AlgorithmSpec(
    name="ppo",
    description="PPO: a critic (value head), GAE, clipped policy and value losses, critic warm-up, colocated rollout",
    config_cls=PPOConfig,
    run=run,
    plot_series=PLOT_SERIES,
)
