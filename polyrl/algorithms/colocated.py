"""The colocated policy: ONE ``DecoderLM`` that the training engine updates and the rollout engine samples from,
plus the data types that flow between them. The building block of every online algorithm (GRPO, GSPO, PPO) and of
the public ``polyrl.trainer.Trainer`` (which adds model loading by path on top; this module lives in the
algorithms layer so the RL loop below the trainer can use it).

- ``Sample``: one completion: prompt ids, completion ids, the rollout engine's per-token log-probs
  (``log_softmax(logits / T)`` at each sampled token), finish reason, text, and its group (prompt index). An
  agentic episode (``polyrl.agents``) is one Sample whose ``mask`` (one per completion id) marks the policy's own
  tokens: only those are trained (labels -100 on tool outputs and user turns) and ``logprobs`` / per-token fields
  then hold one value per masked token.
- ``RLBatch``: a packed micro-batch of samples (``PackedBatch`` fields: labels are the completion tokens, -100 on
  the prompt) plus ``mask [T]`` (1.0 where ``labels`` is a completion token), ``seq_index [T]`` (sample within the
  micro-batch), ``sample_ids`` (positions in the caller's sample list) and ``fields``: per-token float tensors
  aligned with ``labels`` (``fields["adv"][t]`` belongs to the token predicted at t). ``pack_samples`` builds them.
- ``ColocatedPolicy(model, tokenizer, ...)``: ``rollout(prompts, n, sampling, seeds)`` -> samples;
  ``logprobs(samples, temperature, model=None, entropy=False)`` (no-grad recompute, same packing as training);
  ``step(batches, loss_fn, normalizer)`` (one optimizer step; the prefix cache is reset afterwards);
  ``save`` / ``load`` (polyrl.train.checkpoint). The LLM holds the very module the engine trains: no copy, no
  weight sync. With ``release_kv`` the KV cache exists only while rolling out (``llm.reallocate()`` before,
  ``llm.release()`` after), which also gives every rollout the same fresh block state (reproducible batches).
  ``reference=True`` keeps a frozen copy of the initial weights (``ref_model``) for a KL penalty; for a LoRA model
  (``polyrl.models.lora``) the reference is the same model with its adapters off (no copy), and with
  ``lora_config.merge_for_rollout`` rollouts run with the adapters merged in place (unmerged afterwards).
- Data-parallel (``world`` of ``polyrl.train.parallel``, under torchrun): the trained model is FSDP2-sharded, so the
  rollout engine runs a plain full copy in the compute dtype (``rollout_net``, refreshed in place after every
  optimizer step with one all-gather per tensor), each rank generates for its share of the prompts and every rank
  gets all samples back (``generate_data_parallel``). Log-prob recomputes run on that plain copy too (same weights
  and kernels as the FSDP forward, no collectives, so ranks may hold different numbers of micro-batches there).
  A replicated model (``replicate_model``: LoRA) stays colocated as in one process (rollout, reference and
  ``merge_for_rollout`` as above, on every rank's own identical replica); only generation is split over ranks.

Deliberately not here: rewards, advantages, losses, the run loop (``polyrl.algorithms.online``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyrl.errors import UserError
from polyrl.platform import device


@dataclass
class Sample:
    """One rollout completion (``group`` = index of its prompt in the ``rollout`` call, ``index`` = j of n)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    group: int = 0
    index: int = 0
    mask: list[int] | None = None  # per completion id, 1 = a policy token (trained); None = all of them

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_policy_tokens(self) -> int:
        return len(self.completion_ids) if self.mask is None else sum(1 for m in self.mask if m)


@dataclass
class RLBatch:
    """Packed samples for training or log-prob recompute (see the module docstring). Shapes: T tokens, B samples."""

    input_ids: torch.Tensor  # int64 [T]
    labels: torch.Tensor  # int64 [T], completion tokens, -100 elsewhere
    position_ids: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [B+1]
    max_seqlen: int
    num_target_tokens: int
    mask: torch.Tensor  # fp32 [T]
    seq_index: torch.Tensor  # int64 [T]
    sample_ids: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 [T] each

    @property
    def num_sequences(self) -> int:
        return len(self.sample_ids)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RLBatch:
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return RLBatch(
            mv(self.input_ids),
            mv(self.labels),
            mv(self.position_ids),
            mv(self.cu_seqlens),
            self.max_seqlen,
            self.num_target_tokens,
            mv(self.mask),
            mv(self.seq_index),
            list(self.sample_ids),
            {k: mv(v) for k, v in self.fields.items()},
        )

    def per_sample(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``[T]`` tensor into each sample's completion-token values (in completion order)."""
        out = []
        sel = self.mask > 0
        for b in range(self.num_sequences):
            out.append(values[(self.seq_index == b) & sel])
        return out


def pack_samples(
    samples: Sequence[Sample],
    fields: dict[str, Sequence[Any]] | None = None,
    max_tokens: int = 8192,
    order: Sequence[int] | None = None,
) -> list[RLBatch]:
    """Pack ``samples`` (in ``order``, default as given) into micro-batches of at most ``max_tokens`` tokens (a
    longer sample gets a micro-batch of its own). ``fields[name][i]`` is sample i's value: a number (broadcast over
    its completion tokens) or a list with one value per completion token (per policy token for a masked sample)."""
    fields = fields or {}
    order = list(range(len(samples))) if order is None else list(order)
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = samples[i].num_tokens
        if cur and used + n > max_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return [_pack(samples, ids, fields) for ids in groups]


def _pack(samples: Sequence[Sample], ids: list[int], fields: dict[str, Sequence[Any]]) -> RLBatch:
    tokens: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    seq_index: list[int] = []
    cu = [0]
    vals: dict[str, list[float]] = {k: [] for k in fields}
    for b, i in enumerate(ids):
        s = samples[i]
        p, c = len(s.prompt_ids), s.num_policy_tokens
        seq = list(s.prompt_ids) + list(s.completion_ids)
        tokens.extend(seq)
        keep = s.mask if s.mask is not None else [1] * len(s.completion_ids)
        if len(keep) != len(s.completion_ids):
            raise ValueError(f"sample {i} has a mask of {len(keep)} for {len(s.completion_ids)} completion tokens")
        labels.extend([-100] * (p - 1) + [t if m else -100 for t, m in zip(s.completion_ids, keep)] + [-100])
        positions.extend(range(len(seq)))
        seq_index.extend([b] * len(seq))
        cu.append(cu[-1] + len(seq))
        for k, per in fields.items():
            v = per[i]
            per_tok = [float(x) for x in v] if isinstance(v, (list, tuple, torch.Tensor)) else [float(v)] * c
            if len(per_tok) != c:
                raise ValueError(f"field {k!r} of sample {i} has {len(per_tok)} values for {c} completion tokens")
            if s.mask is not None:  # scatter the policy tokens' values; 0 on observation tokens
                it = iter(per_tok)
                per_tok = [next(it) if m else 0.0 for m in keep]
            vals[k].extend([0.0] * (p - 1) + per_tok + [0.0])
    labels_t = torch.tensor(labels, dtype=torch.int64)
    mask = (labels_t != -100).float()
    return RLBatch(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        labels=labels_t,
        position_ids=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(samples[i].num_tokens for i in ids),
        num_target_tokens=int(mask.sum()),
        mask=mask,
        seq_index=torch.tensor(seq_index, dtype=torch.int64),
        sample_ids=list(ids),
        fields={k: torch.tensor(v, dtype=torch.float32) for k, v in vals.items()},
    )


def padding_batch(like: RLBatch, keys: Sequence[str] | None = None) -> RLBatch:
    """A micro-batch with ``like``'s tokens but no target token (mask 0, labels -100, every field 0; ``keys``: the
    fields, default ``like``'s): it runs forward and backward (so a data-parallel rank with fewer micro-batches still
    joins every FSDP collective) and adds exactly 0 to the loss and its gradients."""
    return RLBatch(
        input_ids=like.input_ids,
        labels=torch.full_like(like.labels, -100),
        position_ids=like.position_ids,
        cu_seqlens=like.cu_seqlens,
        max_seqlen=like.max_seqlen,
        num_target_tokens=0,
        mask=torch.zeros_like(like.mask),
        seq_index=like.seq_index,
        sample_ids=list(like.sample_ids),
        fields={k: torch.zeros_like(like.mask) for k in (like.fields if keys is None else keys)},
    )


def completion_logprobs(
    model: nn.Module, batch: RLBatch, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[T]`` (0 off the completion) of each completion token under ``model`` at ``temperature``, and
    optionally the entropy ``[T]`` of the tempered distribution there; differentiable when grad is enabled.
    Uses the fused ``kernels.token_logprobs`` over the completion positions only (no ``[T, V]`` logits)."""
    from polyrl import kernels
    from polyrl.train.losses import attention_metadata

    hidden = model(batch.input_ids, batch.position_ids, attention_metadata(batch))  # [T, H]
    sel = torch.nonzero(batch.mask > 0).squeeze(-1)
    out = kernels.token_logprobs(hidden[sel], model.lm_head_weight, batch.labels[sel], temperature, entropy)
    lp, ent = out if entropy else (out, None)
    full = torch.zeros(batch.input_ids.shape[0], dtype=torch.float32, device=hidden.device)
    full = full.index_put((sel,), lp.float())
    if ent is not None:
        ent = torch.zeros_like(full).index_put((sel,), ent.detach().float())
    return full, ent


# "auto" keeps the rollout KV cache (and its CUDA graphs) across steps when it takes at most this share of the
# device's memory: on the H200, keeping it saved 0.3 s of a 7.6 s GRPO step (no re-allocation, no re-capture).
KEEP_KV_FRACTION = 0.25


def keeps_kv_released(release_kv: bool | str, kv_bytes: int) -> bool:
    """Whether to free the KV cache while training: the setting, with "auto" resolved for this device."""
    if release_kv != "auto":
        return bool(release_kv)
    if device.device_type() == "cpu":
        return True
    _, total = device.mem_get_info()
    return kv_bytes > KEEP_KV_FRACTION * total


class ColocatedPolicy:
    """A trainable model and a rollout engine over the same parameter tensors (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        optim: Any = None,
        schedule: Any = None,
        precision: Any = None,
        engine: Any = None,
        rollout: Any = None,
        total_steps: int | None = None,
        release_kv: bool | str = "auto",
        reference: bool = False,
        world: Any = None,
    ) -> None:
        from polyrl.infer import LLM
        from polyrl.train import ScheduleConfig, TrainEngine

        if schedule is None and total_steps is None:
            schedule = ScheduleConfig(decay="constant")  # an open-ended Python session has no length
        self.model = model
        self._tokenizer = tokenizer
        self.world = world if world is not None and world.distributed else None
        from polyrl.train.parallel import is_replicated

        self.sharded = self.world is not None and not is_replicated(model)
        if not self.sharded:  # one process, or a whole replica per rank: the rollout shares the trained tensors
            lora = getattr(model, "lora_config", None) is not None
            # before any update or hook: the initial weights (LoRA: the frozen base itself, adapters off, no copy)
            initial = copy.deepcopy(model) if reference and not lora else None
            self.engine = TrainEngine(model, optim, schedule, precision, engine, total_steps, world=self.world)
            self.rollout_net = model  # colocated: the very tensors the optimizer updates
            self.ref_model: nn.Module | None = None
            if initial is not None:
                self.ref_model = initial.to(self.engine.compute_dtype).eval().requires_grad_(False)
            elif reference:
                from polyrl.models.lora import AdapterDisabled

                self.ref_model = AdapterDisabled(model)
        else:
            from polyrl.train.parallel import rollout_model

            self.engine = TrainEngine(model, optim, schedule, precision, engine, total_steps, world=self.world)
            dtype = self.engine.compute_dtype
            self.rollout_net = rollout_model(model, dtype).requires_grad_(False)
            self.ref_model = rollout_model(model, dtype).requires_grad_(False) if reference else None
        self.llm = LLM(self.rollout_net, tokenizer, rollout)  # built after the cast: KV cache in the compute dtype
        self.release_kv = keeps_kv_released(release_kv, self.llm.kv.total_bytes)
        if self.release_kv:
            self.llm.release()
        self.device = self.engine.device
        self.micro_batch_tokens = self.engine.cfg.micro_batch_tokens

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # ---- prompts ----------------------------------------------------------------------------------
    def encode(self, prompt: Any) -> list[int]:
        """Token ids of a prompt: ids, text, a message list or a ``PromptExample`` (chat template)."""
        messages = getattr(prompt, "messages", None)
        if messages is None and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            messages = prompt
        if messages is not None:
            if self._tokenizer is None:
                raise UserError("chat prompts need a tokenizer; pass tokenizer= or give token ids")
            from polyrl.data import ChatTokenizer

            return ChatTokenizer(self._tokenizer).encode_prompt(messages)
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise UserError("text prompts need a tokenizer; pass tokenizer= or give token ids")
            return list(self._tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    # ---- rollout ----------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(
        self, prompts: Sequence[Any], n: int = 1, sampling: Any = None, seeds: Sequence[int] | None = None
    ) -> list[Sample]:
        """``n`` completions of each prompt, grouped by prompt (``group`` = prompt index). ``seeds[i]`` seeds prompt
        i's samples (reproducible whatever else is in the batch); ``sampling.seed`` is used otherwise."""
        from polyrl.infer import SamplingParams

        base = (sampling or SamplingParams()).clone(n=n)
        plist = [base.clone(seed=int(s)) for s in seeds] if seeds is not None else [base] * len(prompts)
        ids = [self.encode(p) for p in prompts]
        was_training = self.rollout_net.training
        self.rollout_net.eval()
        if not self.llm.kv.allocated:
            self.llm.reallocate()
        merge = self._merge_for_rollout()
        try:
            if self.world is not None:
                from polyrl.train.parallel import generate_data_parallel

                outs = generate_data_parallel(self.llm, ids, plist, self.world)
            else:
                outs = self.llm.generate(ids, plist)
        except BaseException:
            self.llm.abort_all()  # a failed generate leaves requests behind; the cache must still be freed
            raise
        finally:
            merge.__exit__(None, None, None)
            if self.release_kv:
                self.llm.release()
            self.rollout_net.train(was_training)
        samples = []
        for g, out in enumerate(outs):
            for c in out.outputs:
                samples.append(
                    Sample(list(out.prompt_token_ids), list(c.token_ids), list(c.logprobs), c.finish_reason, c.text, g)
                )
                samples[-1].index = c.index
        return samples

    def _merge_for_rollout(self) -> Any:
        """Entered context: with ``lora.merge_for_rollout`` the adapters are merged into the base weights in place
        (the rollout runs plain linears; CUDA graphs captured now see the merged weights in the same storage) and
        unmerged when it exits; otherwise nothing (the rollout runs base + adapter, unmerged)."""
        import contextlib

        cfg = getattr(self.rollout_net, "lora_config", None)
        ctx = contextlib.nullcontext()
        if cfg is not None and cfg.merge_for_rollout:
            from polyrl.models.lora import merged

            ctx = merged(self.rollout_net)
        ctx.__enter__()
        return ctx

    # ---- log-probs and training -----------------------------------------------------------------
    @torch.no_grad()
    def logprobs(
        self,
        samples: Sequence[Sample],
        temperature: float = 1.0,
        model: nn.Module | None = None,
        entropy: bool = False,
        batches: Sequence[RLBatch] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sample: the completion tokens' log-probs (fp32 CPU ``[c]``) under ``model`` (default the policy) and,
        with ``entropy``, the entropies. Pass the training ``batches`` to recompute with the exact packing the loss
        will use (so an unchanged model gives a ratio of exactly 1). Data-parallel: the default model is the plain
        full copy (``rollout_net``, the model itself when replicated); samples in no given batch get None."""
        model = model or self.rollout_net
        was_training = model.training
        model.eval()
        batches = batches if batches is not None else pack_samples(samples, max_tokens=self.micro_batch_tokens)
        lps: list[torch.Tensor | None] = [None] * len(samples)
        ents: list[torch.Tensor | None] = [None] * len(samples)
        try:
            for b in batches:
                b = b.to(self.device)
                lp, ent = completion_logprobs(model, b, temperature, entropy)
                for j, v in zip(b.sample_ids, b.per_sample(lp)):
                    lps[j] = v.cpu()
                if ent is not None:
                    for j, v in zip(b.sample_ids, b.per_sample(ent)):
                        ents[j] = v.cpu()
        finally:
            model.train(was_training)
        return lps, (ents if entropy else None)  # type: ignore[return-value]

    def step(
        self, batches: Sequence[RLBatch], loss_fn: Callable[[nn.Module, Any], Any], normalizer: float | None = None
    ) -> Any:
        """One optimizer step (``TrainEngine.step``); the rollout engine's prefix cache is reset afterwards."""
        stats = self.engine.step(list(batches), loss_fn, normalizer)
        if self.sharded:
            from polyrl.train.parallel import sync_rollout_weights

            sync_rollout_weights(self.model, self.rollout_net)
        self.llm.reset_prefix_cache()
        return stats

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self, root: str | Path, step: int, data_state: dict | None = None, config: Any = None) -> Path:
        """Atomic checkpoint ``<root>/step-%08d`` (weights, optimizer, RNG, counters, ``data_state``); when
        data-parallel sharded (every rank writes its shards) or replicated (rank 0 writes, every rank its RNG), a
        collective."""
        from polyrl.train import save_checkpoint

        if self.world is not None:
            from polyrl.train.parallel import save_distributed_checkpoint

            return save_distributed_checkpoint(
                root, step, self.model, self.engine, self.world, data_state=data_state, config=config,
                tokenizer=self._tokenizer,
            )  # fmt: skip
        return save_checkpoint(
            root, step, self.model, self.engine, data_state=data_state, config=config, tokenizer=self._tokenizer
        )

    def load(self, path: str | Path) -> Any:
        """Restore a checkpoint in place (parameter tensors keep their identity); returns ``LoadedCheckpoint``.
        One-process and sharded checkpoints load at any world size."""
        from polyrl.train import load_checkpoint
        from polyrl.train import parallel as par

        if self.world is not None or par.is_sharded_checkpoint(path):
            loaded = par.load_any_checkpoint(path, self.model, self.engine, self.world)
            if self.sharded:
                par.sync_rollout_weights(self.model, self.rollout_net)
        else:
            loaded = load_checkpoint(path, self.model, self.engine)
        self.llm.reset_prefix_cache()
        return loaded


__all__ = ["ColocatedPolicy", "RLBatch", "Sample", "completion_logprobs", "pack_samples", "padding_batch"]
