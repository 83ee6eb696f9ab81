"""The actor-critic loop (``polyrl train --algo ppo``): ``OnlineRun`` with a critic. PPO's algorithm parts (config,
value and policy losses, hooks, GAE) are ``polyrl.algorithms.ppo`` / ``gae``; this module runs them.

- ``Critic``: a ``ValueModel`` (``polyrl.models.value_head``: initialised from ``critic_model`` or the policy
  checkpoint with a zero head) and its own ``TrainEngine`` with ``critic_lr`` (default ``optim.lr``) and the run's
  other optimizer settings; FSDP2-sharded under torchrun like the policy.
- ``ActorCriticRun.prepare``: the trainer's and (with ``kl_coef``) the reference's log-probs, the critic's values at
  every completion token, token rewards (score on the last token ``- kl_coef x KL_t``), GAE advantages and returns,
  whitened over the step's tokens (global sums under torchrun).
- ``ActorCriticRun.update``: a critic step per mini-batch, then (after ``critic_warmup_steps`` RL steps) the
  policy's steps of ``OnlineRun.update``.
- Checkpoints: the critic's go to ``<out>/critic/checkpoints/step-*`` (saved before the policy's, so every policy
  checkpoint has its critic; resume restores both), the final critic to ``<out>/critic/final`` (``export_more``:
  in the run's finish, before the summary, whose ``final_critic`` names it).

Not here: the loss math and hooks (``polyrl.algorithms.ppo``), GAE (``polyrl.algorithms.gae``), the loop's other
stages (``online``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from polyrl.algorithms.gae import gae, pad_rows, token_rewards, unpad_rows, whiten
from polyrl.algorithms.losses import kl_penalty, tis_weights
from polyrl.algorithms.online_config import OnlineHooks
from polyrl.algorithms.ppo import make_value_loss
from polyrl.algorithms.rl_batch import RLBatch, Sample, pack_samples
from polyrl.errors import CheckpointError
from polyrl.models.lora import base_model_path
from polyrl.models.value_head import load_value_model, mark_token_classification, save_value_model
from polyrl.platform import device
from polyrl.run.async_rollout import staleness_metrics
from polyrl.run.config import RunConfig
from polyrl.run.online import OnlineRun, run_online
from polyrl.train import parallel as par
from polyrl.train.checkpoint import CheckpointManager, load_checkpoint, step_dir_name
from polyrl.train.engine import TrainEngine
from polyrl.train.losses import attention_metadata
from polyrl.train.precision import resolve_compute_dtype

CRITIC_DIR = "critic"


# ---- the critic ---------------------------------------------------------------------------------
class Critic:
    """A ``ValueModel`` and its own ``TrainEngine`` (the run's optimizer settings with ``critic_lr``); FSDP2-sharded
    when ``world`` is distributed."""

    def __init__(self, cfg: RunConfig, total_steps: int, world: par.World | None = None) -> None:
        a = cfg.algo_config
        self.world = world if world is not None and world.distributed else None
        dev = self.world.device if self.world is not None else device.torch_device()

        # a LoRA run started from an adapter folder: the critic starts from its base (a full-parameter critic)
        critic = a.critic_model or base_model_path(cfg.model, cfg.lora.base if cfg.lora is not None else None)
        self.model = load_value_model(critic, torch.float32, dev)
        if self.world is not None:
            par.shard_model(self.model, self.world, resolve_compute_dtype(cfg.precision, dev.type))
        optim = dataclasses.replace(cfg.optim, lr=a.critic_lr if a.critic_lr is not None else cfg.optim.lr)
        self.engine = TrainEngine(
            self.model, optim, cfg.schedule, cfg.precision, cfg.engine, total_steps, world=self.world
        )
        self.device = self.engine.device

    @torch.no_grad()
    def values(self, batches: list[RLBatch], num_samples: int) -> list[torch.Tensor]:
        """Per sample: the critic's value at each completion token (fp32 CPU ``[c]``)."""

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


# ---- the run ------------------------------------------------------------------------------------
class ActorCriticRun(OnlineRun):
    """``OnlineRun`` with PPO's ``prepare`` (values, GAE) and ``update`` (critic, then policy after warm-up)."""

    def __init__(self, cfg: RunConfig, hooks: OnlineHooks, stream: TextIO | None = None) -> None:
        super().__init__(cfg, hooks, stream)
        a = cfg.algo_config
        self.critic = Critic(cfg, self.steps * a.ppo_epochs * a.mini_batches, self.world)
        self.critic_ckpts = self._critic_manager() if self.world.is_main else None  # rank 0 cleans stale dirs
        self.world.barrier()
        self.critic_ckpts = self.critic_ckpts or self._critic_manager()
        self._step = self.start  # RL steps finished (the step a checkpoint is written for)
        self._current = self.start  # the RL step being prepared / updated (0-based)
        self.teacher_term: list[list[float]] | None = None  # this step's per-token distillation term (--teacher)
        if self.start_point is not None:
            self._load_critic()

    def _critic_manager(self) -> CheckpointManager:
        return CheckpointManager(self.out / CRITIC_DIR, dataclasses.replace(self.cfg.checkpoint, dir=None))

    def _load_critic(self) -> None:
        path = self.critic_ckpts.root / step_dir_name(self.start)
        if not (path / "manifest.json").is_file():
            raise CheckpointError(
                f"no critic checkpoint {path} for policy checkpoint step {self.start}; a PPO run saves both"
            )

        if self.world.distributed or par.is_sharded_checkpoint(path):
            par.load_any_checkpoint(path, self.critic.model, self.critic.engine, self.critic.world)
        else:
            load_checkpoint(path, self.critic.model, self.critic.engine)

    def data_state(self) -> dict[str, Any]:
        # Called by OnlineRun.run right before each policy checkpoint (on every rank): the critic's first, same step.
        if self.world.distributed:
            par.save_sharded_checkpoint(
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
        self, step: int, samples: list[Sample], scores: list[float], keep: list[int]
    ) -> tuple[list[list[RLBatch]], dict[str, float]]:
        """Mini-batches with per-token ``adv``, ``old_logp``, ``old_value``, ``returns``; measurement metrics. Each
        rank handles its share of every mini-batch (all of it in one process)."""

        a = self.a
        self._current = step
        t0 = time.perf_counter()
        budget = self.policy.micro_batch_tokens
        groups = [self.share(g) for g in self.split(step, keep)]
        mine = [i for g in groups for i in g]
        plain = [b for g in groups for b in pack_samples(samples, None, budget, g)]
        lps, ents = self.policy.logprobs(samples, a.temperature, entropy=True, batches=plain)
        self.measured_logprobs = lps  # rollouts.jsonl's trainer log-probs
        rollout_lp = [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]
        old = rollout_lp if a.old_logprobs == "rollout" and not self.decoupled else lps
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
        if self.teacher_term is not None:  # --teacher: the distillation term, after GAE and whitening
            adv = adv + pad_rows([torch.tensor(self.teacher_term[i], dtype=adv.dtype) for i in mine])[0]
        fields: dict[str, list[Any]] = {k: [None] * len(samples) for k in ("adv", "old_logp", "old_value", "returns")}
        for i, ad, ret in zip(mine, unpad_rows(adv, mask), unpad_rows(returns, mask)):
            fields["adv"][i], fields["returns"][i] = ad.tolist(), ret.tolist()
            fields["old_logp"][i], fields["old_value"][i] = old[i].tolist(), values[i].tolist()
        cap = self.is_cap()  # async: truncated pi_prox / pi_behaviour weights (the decoupled objective)
        if cap:
            fields["is_w"] = [tis_weights(lps[i], rollout_lp[i], cap).tolist() if i in set(mine) else None
                              for i in range(len(samples))]  # fmt: skip
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
        if self.source is not None:
            gather = self.world.all_gather_object if self.world.distributed else None  # over every rank's share
            m.update(staleness_metrics(step, samples, mine, rollout_lp, lps, cap, gather))
        return batches, m

    def add_teacher_term(self, adv: list[Any], term: list[list[float]]) -> list[Any]:
        self.teacher_term = term  # prepare adds it to the GAE advantages
        return adv

    def update(self, batches: list[list[RLBatch]]) -> dict[str, float]:
        """Critic steps, then (after ``critic_warmup_steps`` RL steps) ``OnlineRun.update``'s policy steps."""

        a = self.a
        t0 = time.perf_counter()
        recs = []
        for _ in range(a.ppo_epochs):
            for mb in batches:
                tokens = self.world.sum_float(sum(b.num_target_tokens for b in mb))  # every rank's share
                loss_fn = make_value_loss(a, tokens, tokens)
                # the policy's recorded routing is no record of the critic's own router: it routes itself
                plain = [dataclasses.replace(b, routing=None, routing_layers=()) for b in mb]
                recs.append(self.critic.engine.step(plain, loss_fn, tokens).to_dict())
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

    def export_more(self) -> dict[str, Any]:
        # in OnlineRun's finish: under its StopSignal (a SIGTERM here lets the run finish), before its summary
        if not self.cfg.train.save_final_model:
            return {}
        out = Path(self.cfg.out) / CRITIC_DIR / "final"
        if self.world.distributed:
            path = par.export_hf(self.critic.model, self.world, out, tokenizer=self.tokenizer)
            if path is not None:
                mark_token_classification(path)
        else:
            path = save_value_model(self.critic.model, out, self.tokenizer)
        if not self.world.is_main:
            return {}
        self.print(f"final critic: {path}")
        return {"final_critic": str(path)}


def run_actor_critic(cfg: RunConfig, stream: TextIO | None = None) -> dict[str, Any]:
    """``polyrl train --algo ppo`` (one process or under torchrun)."""
    return run_online(cfg, stream, run_cls=ActorCriticRun)


__all__ = ["CRITIC_DIR", "ActorCriticRun", "Critic", "run_actor_critic"]
