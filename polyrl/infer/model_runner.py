"""Model runner: one engine step on the device - inputs in, logits of the sampling rows out (in the model's dtype,
as the LM head computes them: 311 MB less to write and read per B512 step than fp32; the sampler upcasts).

Eager path (any device, any batch): build ``StepInputs`` (``batch.py``), run ``DecoderLM.forward`` with
paged ``AttnMetadata``, gather the hidden state of each sampling sequence's last token and call
``compute_logits`` on those rows only (never ``[T, V]``).

Prompt log-probs (``prompt_logprobs.py``): a step whose prefill chunks cover prompt positions a request asked
to score also scores those rows of the hidden state (chunked; never ``[T, V]``) and stores them on the sequence.

Decode-only steps with at most ``max_graph_batch_size`` sequences replay a CUDA graph where
``polyrl.platform.device.supports_graphs()``: ``cuda_graphs.py`` captures forward + logits per batch-size
bucket over static buffers; the batch is padded to the bucket. A capture that fails (the model does something a
capture forbids) is cleaned up by ``device.graph_capture``; the runner then warns once and decodes eagerly.

The runner holds a reference to the model (colocated training shares its weights: no copy). With FP8 weights
(``RolloutConfig.weight_precision = "fp8"``, ``fp8_weights.py``) it also holds their FP8 copies: every forward of
``execute`` / ``execute_steps`` / ``capture_graphs`` runs inside the decoder's ``projection_override`` with them,
after requantising them if ``weights_changed()`` was called since (the trainer's own forwards never see them).
With fused projections (``RolloutConfig.fuse_projections``, ``fused_projections.py``) it holds the concatenated
q/k/v and gate/up copies instead, entered and refreshed the same way (under FP8 weights the FP8 copies fuse their
groups themselves and no bf16 copies are made).
It does not schedule, sample or own the cache's block accounting.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch

from polyrl import kernels
from polyrl.infer.batch import StepInputs, host_arrays, to_device
from polyrl.infer.config import RolloutConfig
from polyrl.infer.cuda_graphs import DecodeBuffers, DecodeGraphs, GraphCaptureError
from polyrl.infer.fp8_weights import Fp8Weights
from polyrl.infer.fused_projections import FusedProjections
from polyrl.infer.kv_cache import KVCache
from polyrl.infer.overlap import feed_input_ids
from polyrl.infer.prompt_logprobs import PromptScores, compute, plan_step
from polyrl.infer.sampler import SamplingRows, host_to_device
from polyrl.infer.scheduler import SchedulerOutput
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.decoder import projection_override
from polyrl.models.moe import Routing
from polyrl.platform import device


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        cfg: RolloutConfig,
        max_model_len: int,
        fp8: Fp8Weights | None = None,
        fused: FusedProjections | None = None,
    ) -> None:
        self.model = model
        self.fp8 = fp8  # the engine's FP8 projection weights (RolloutConfig.weight_precision), or None
        # the engine's fused q/k/v and gate/up copies (RolloutConfig.fuse_projections), or None; FP8 takes precedence
        self.fused = fused if fp8 is None else None
        self.kv = kv
        self.cfg = cfg
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // cfg.block_size)
        want = device.supports_graphs() if cfg.cuda_graphs is None else cfg.cuda_graphs
        self.use_graphs = bool(want) and self.device.type == "cuda" and device.supports_graphs()
        if self.use_graphs:
            head_dim = getattr(getattr(model, "config", None), "head_dim", None)
            # a decode step whose attention runs the host-syncing reference cannot be captured: run it eagerly
            self.use_graphs = head_dim is None or kernels.paged_attention_graph_safe("cuda", self.dtype, head_dim)
        self.graphs = None
        self.last_step_used_graph = False
        self.last_decode: DecodeBuffers | None = None  # inputs of the last step run, for execute_steps
        self.released_capture_s = 0.0  # capture time of graph sets dropped by invalidate_graphs
        self._prompt_plan = None  # the step's prompt log-prob rows (prompt_logprobs.py), consumed by _eager
        self._prompt_scores: list[PromptScores] = []  # queued by _eager, handed to the engine by take_prompt_scores

    @property
    def weight_copies(self) -> Fp8Weights | FusedProjections | None:
        """The engine's own copies of projection weights (FP8 or fused), the decoder's projection override; or None."""
        return self.fp8 if self.fp8 is not None else self.fused

    def weights_changed(self) -> None:
        """The model's weights were updated (a training step, a sync, a load): FP8 or fused copies are rewritten
        before the next forward (in place, so captured graphs stay valid). Nothing to do without copies."""
        copies = self.weight_copies
        if copies is not None:
            copies.mark_stale()

    def release_weights(self) -> None:
        """Free the FP8 or fused copies with the KV cache (``LLM.release``; the graphs that read them are dropped
        there too); the next forward makes them again. Nothing to do without copies."""
        copies = self.weight_copies
        if copies is not None:
            copies.free()

    def _precision(self) -> contextlib.AbstractContextManager:
        """Entered around every forward of the engine: the FP8 or fused copies, refreshed if stale, as the decoder's
        projection override (nothing without copies)."""
        copies = self.weight_copies
        if copies is None:
            return contextlib.nullcontext()
        copies.refresh()
        return projection_override(copies)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, feed: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """Logits ``[S, V]`` (the model's dtype) for the scheduled sequences that sample, in scheduling order.

        ``feed = (rows, prev_tokens)``: item ``i`` with ``rows[i] >= 0`` takes its input id from the device tensor
        ``prev_tokens[rows[i]]`` (one-step-ahead decoding, ``overlap.py``); only for one-token items."""
        with self._precision():
            return self._execute(sched, feed)

    def _execute(self, sched: SchedulerOutput, feed: tuple[list[int], torch.Tensor] | None) -> torch.Tensor:
        if self.kv.caches is None:
            raise RuntimeError("the KV cache is released; call LLM.reallocate() before generating")
        arrays = host_arrays(sched.items, self.cfg.block_size)
        fed = self._fed(feed)
        bank = getattr(self.model, "lora_bank", None)
        if bank is not None:  # LoRA adapters per request: each token's adapter slot (fixed across queued steps)
            bank.index = _adapter_index(sched, bank, self.device)
        if self._graph_step(sched):  # adapter steps run eagerly
            try:
                logits = self.graphs.run(arrays, fed)
                self.last_step_used_graph = True
                self.last_decode = self.graphs.decode_buffers(len(sched.items))
                return logits
            except GraphCaptureError as exc:
                self._decode_eagerly_from_now_on(exc)
        self.last_step_used_graph = False
        inputs = to_device(arrays, self.device)
        self._prompt_plan = plan_step(sched.items)  # prompt log-probs this step computes (never on a decode graph)
        if fed is not None:
            feed_input_ids(inputs.input_ids, *fed)
        x = inputs
        self.last_decode = DecodeBuffers(
            x.input_ids, x.positions, x.slot_mapping, x.context_lens, x.block_tables, lambda: self._eager(x)
        )
        return self._eager(inputs)

    @torch.inference_mode()
    def execute_steps(
        self,
        sched: SchedulerOutput,
        feed: tuple[list[int], torch.Tensor] | None,
        steps: int,
        draw: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
        rows: SamplingRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``steps`` decode steps of a decode-only batch queued back to back, without the host in between.
        Returns (tokens int64, logprobs fp32), each ``[steps, S]``. The caller has allocated every sequence's
        blocks for all ``steps`` positions.

        With ``rows`` (the draws need only temperature, seed, offset, greedy) on the graph path and ``steps`` =
        ``decode_steps``: one replay of the launch graph (``cuda_graphs.py``), sampling included. Otherwise the
        first step as ``execute``, then ``DecodeBuffers.advance`` and run again; ``draw(logits, j)`` samples step j."""
        with self._precision():
            return self._execute_steps(sched, feed, steps, draw, rows)

    def _execute_steps(self, sched, feed, steps, draw, rows) -> tuple[torch.Tensor, torch.Tensor]:
        # Launch graphs of decode_steps steps only (captured ahead with the step graphs); a shorter launch (the tail of
        # a rollout) takes the step path rather than capturing a graph per (bucket, steps) mid-run.
        full = steps == self.cfg.decode_steps and self.cfg.launch_graphs
        if rows is not None and full and self.kv.caches is not None and self._graph_step(sched):
            fed = self._fed(feed)
            try:
                out = self.graphs.run_launch(host_arrays(sched.items, self.cfg.block_size), fed, rows, steps)
                self.last_step_used_graph = True
                self.last_decode = None
                return out
            except GraphCaptureError as exc:
                self._decode_eagerly_from_now_on(exc)
        tok, lp = draw(self.execute(sched, feed), 0)
        if steps == 1:
            return tok[None], lp[None]
        toks, lps = [tok], [lp]
        buffers = self.last_decode
        for j in range(1, steps):
            buffers.advance(tok, self.cfg.block_size)
            tok, lp = draw(buffers.run(), j)
            toks.append(tok)
            lps.append(lp)
        return torch.stack(toks), torch.stack(lps)

    def _decode_eagerly_from_now_on(self, exc: Exception) -> None:
        """A capture failed (``device.graph_capture`` cleaned up): say so once and stop using graphs."""
        warnings.warn(f"{exc}; decoding without CUDA graphs from now on", RuntimeWarning, stacklevel=3)
        self.invalidate_graphs()
        self.use_graphs = False

    def _graph_step(self, sched: SchedulerOutput) -> bool:
        """Whether this step replays a decode graph (and make the graph set on first use)."""
        bank = getattr(self.model, "lora_bank", None)
        ok = bank is None and self.use_graphs and sched.is_decode_only
        ok = ok and len(sched.items) <= self.cfg.max_graph_batch_size
        if ok and self.graphs is None:
            self.graphs = DecodeGraphs(self.model, self.kv, self.cfg, self.max_blocks_per_seq)
        return ok

    def _fed(self, feed: tuple[list[int], torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if feed is None:
            return None
        return host_to_device(feed[0], torch.int64, self.device), feed[1]

    def capture_graphs(self, batch: int) -> None:
        """Capture the decode graphs of every batch size up to ``batch`` now - step graphs and ``decode_steps``-step
        launch graphs (no-op without graphs)."""
        if not self.use_graphs or self.kv.caches is None:
            return
        with self._precision():
            self._capture_graphs(batch)

    def _capture_graphs(self, batch: int) -> None:
        if self.graphs is None:
            self.graphs = DecodeGraphs(self.model, self.kv, self.cfg, self.max_blocks_per_seq)
        try:
            launch = self.cfg.decode_steps if self.cfg.overlap_decode is not False and self.cfg.launch_graphs else 0
            self.graphs.capture_up_to(min(batch, self.cfg.max_graph_batch_size), launch)
        except GraphCaptureError as exc:
            self._decode_eagerly_from_now_on(exc)

    def _eager(self, x: StepInputs) -> torch.Tensor:
        meta = AttnMetadata.paged(x, self.kv.caches)
        if self.kv.routing is None:
            hidden = self.model(x.input_ids, x.positions, meta)  # [T, H]
        else:  # record the chosen experts by slot (kv_cache.py)
            routing = Routing(record=True, keep_logits=False)
            hidden = self.model(x.input_ids, x.positions, meta, routing=routing)
            self.kv.write_routing(x.slot_mapping, routing.topk_ids)
        plan, self._prompt_plan = self._prompt_plan, None
        if plan is not None:
            self._prompt_scores.append(compute(hidden, self.model.lm_head_weight, plan))
        if x.sample_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if x.sample_rows.numel() != x.num_tokens:
            hidden = hidden.index_select(0, x.sample_rows)  # [S, H]
        return self.model.compute_logits(hidden, upcast=False)

    def take_prompt_scores(self) -> list[PromptScores]:
        """The prompt log-probs queued by the steps run since the last call, in step order; the engine stores them
        (``PromptScores.store``) when it reads those steps' tokens."""
        scores, self._prompt_scores = self._prompt_scores, []
        return scores

    def invalidate_graphs(self) -> None:
        """Drop captured graphs (after the cache is released or parameter tensors are replaced)."""
        if self.graphs is not None:
            self.released_capture_s += self.graphs.capture_s
        self.graphs = None

    @property
    def graph_capture_s(self) -> float:
        """Total seconds spent capturing decode graphs so far (every capture after a release counts again)."""
        return self.released_capture_s + (self.graphs.capture_s if self.graphs is not None else 0.0)


def _adapter_index(sched: SchedulerOutput, bank, dev: torch.device) -> torch.Tensor:
    """int64 ``[T]``: the adapter slot of every token of the step (-1: the base), in the step's token order."""
    slots = [bank.slot(it.seq.params.adapter) for it in sched.items]
    counts = [it.num_new for it in sched.items]
    return torch.repeat_interleave(torch.tensor(slots, dtype=torch.long), torch.tensor(counts)).to(dev)
