"""The data-parallel steps of an online RL run under torchrun, as a mixin of ``OnlineRun`` (``self.world``,
``self.pool``, ``self.policy``): in one process every method is the identity (or a plain local computation).

- ``score``: rank 0's reward pool scores every sample; the ``RewardResult`` is broadcast (one set of reward workers).
  ``reward_stream`` / ``finish_scoring``: the same, with rank 0 scoring its own samples as they finish (its share
  of the rollout; the other ranks' samples arrive with the gather and are scored after it), timings broadcast too.
- ``share``: this rank's part of a mini-batch (every ``world_size``-th sample), so the ranks split each update.
- ``even_out``: pads each mini-batch to the largest micro-batch count over ranks with zero-weight micro-batches
  (``rl_batch.padding_batch``): FSDP2 forwards and backwards are collectives, every rank must run as many.
- ``global_stats`` / ``global_sums``: metrics and normalisers over every rank's tokens.

Not here: the loop (``online``), sharding and checkpoints (``polyrl.train.parallel``).
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.reward_stream import RewardStream
from polyrl.algorithms.rl_batch import pack_samples, padding_batch


class DataParallelSteps:
    """Mixin: needs ``world`` (``polyrl.train.parallel.World``), ``pool`` (rank 0's ``RewardPool`` or None) and
    ``policy`` (``ColocatedPolicy``)."""

    world: Any
    pool: Any
    policy: Any

    def score(self, texts: list[str], views: list[dict]) -> Any:
        """Rewards of ``texts``: scored by rank 0's pool, the same ``RewardResult`` on every rank."""
        res = self.pool.score(texts, views) if self.pool is not None else None
        return self.world.broadcast_object(res) if self.world.distributed else res

    def reward_stream(self) -> RewardStream | None:
        """Rank 0: a ``RewardStream`` over its pool, for the rollout to feed as samples finish (``collect``); None on
        the other ranks (rank 0 scores every sample)."""
        return RewardStream(self.pool) if self.pool is not None else None

    def finish_scoring(
        self, stream: RewardStream | None, texts: list[str], views: list[dict]
    ) -> tuple[Any, dict[str, float]]:
        """The rewards of ``texts`` (rank 0's stream: those not streamed are scored now) and the timings
        ``reward_s`` / ``reward_wait_s`` / ``reward/overlap_frac`` (``RewardStream``) with the run's
        ``reward_failures_total`` (rank 0's reward pool); the same on every rank (a queued async batch carries them,
        and every rank's queue must be rank 0's)."""
        out = None
        if stream is not None:
            res = stream.finish(texts, views)
            pool = getattr(self, "pool", None)
            timing = {
                "reward_s": stream.scoring_s,
                "reward_wait_s": stream.wait_s,
                "reward/overlap_frac": stream.overlap_frac,
                "reward_failures_total": float(sum(pool.totals.values())) if pool is not None else 0.0,
            }
            out = (res, timing)
        return self.world.broadcast_object(out) if self.world.distributed else out

    def share(self, ids: list[int]) -> list[int]:
        """This rank's part of a mini-batch (sample ids): every ``world_size``-th, from ``rank``."""
        return ids[self.world.rank :: self.world.world_size] if self.world.distributed else list(ids)

    def global_stats(self, values: list[torch.Tensor]) -> tuple[float, float]:
        """(mean, max) of the concatenated ``values`` over every rank (0, 0 when there are none)."""
        x = torch.cat(values) if values else torch.zeros(0)
        local = (float(x.sum()), int(x.numel()), float(x.max()) if x.numel() else float("-inf"))
        parts = self.world.all_gather_object(local) if self.world.distributed else [local]
        n = sum(p[1] for p in parts)
        return (sum(p[0] for p in parts) / n, max(p[2] for p in parts)) if n else (0.0, 0.0)

    def even_out(self, batches: list[list[Any]], samples: list[Any], template: int) -> list[list[Any]]:
        """Pad every mini-batch to the largest micro-batch count over ranks with zero-weight micro-batches
        (``padding_batch``), so every rank runs the same number of FSDP forwards/backwards."""
        if not self.world.distributed:
            return batches

        counts = self.world.all_gather_object([len(mb) for mb in batches])
        keys = next((list(b.fields) for mb in batches for b in mb), [])
        out = []
        for k, mb in enumerate(batches):
            want = max(c[k] for c in counts)
            if len(mb) < want:
                like = mb[0] if mb else pack_samples(samples, None, self.policy.micro_batch_tokens, [template])[0]
                mb = mb + [padding_batch(like, keys) for _ in range(want - len(mb))]
            out.append(mb)
        return out

    def global_sums(self, sel: torch.Tensor, *xs: torch.Tensor) -> list[float]:
        """[token count, sum of each x] over every rank (fp64 Python numbers)."""
        local = [float(sel.sum())] + [float(x.double().sum()) for x in xs]
        if not self.world.distributed:
            return local
        parts = self.world.all_gather_object(local)
        return [sum(p[k] for p in parts) for k in range(len(local))]


__all__ = ["DataParallelSteps"]
