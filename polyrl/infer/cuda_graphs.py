"""CUDA graphs for decode steps, one per batch-size bucket, captured lazily on first use.

Static device buffers (sized for the largest bucket) hold ``input_ids``, ``positions``, ``slot_mapping``,
``cu_seqlens``, ``context_lens`` and ``block_tables [max_bs, max_blocks_per_seq]``. Two kinds of graph read them:

- the *step* graph of bucket ``b`` runs forward + ``compute_logits`` on their first ``b`` rows and leaves the LM
  head's logits ``[b, V]`` (the model's dtype: no fp32 copy, the sampler upcasts as it reads) in its own output;
- the *launch* graph of (``b``, ``k``) runs ``k`` whole decode steps: forward, ``kernels.sample_tokens`` on the
  rows' sampling buffers (``temps``, ``seeds``, ``offsets``, ``greedy``), and between steps the inputs advanced on
  the device (``advance``: the drawn token in, position + 1, the next slot from the block table), leaving tokens
  and log-probs ``[k, b]``. One replay per launch: no per-step sampler or input kernels launched from the host, no
  gaps between them (``ModelRunner.execute_steps`` takes it when the draws need nothing but those four values).

A step copies its host arrays into the buffers with one H2D transfer, pads to the bucket (slot -1: nothing
written, and a padded row never advances; context length 1 over block 0, so padded rows read a real slot and stay
finite - their results are discarded) and replays. Nothing inside the captured region syncs the host.

``DecodeBuffers`` is the view ``ModelRunner.execute_steps`` advances between queued decode steps: the step's
device inputs (the graph's static buffers here, the eager step's own tensors in ``model_runner.py``) and how to run
the step again.

With ``RolloutConfig.record_routing`` (MoE) every captured forward also writes its rows' chosen experts into the
cache's routing table by slot (``KVCache.write_routing``: a padded row's slot -1 goes to its spare row), in the step
and the launch graphs alike, so nothing is copied out between replays.

Graphs share one memory pool (they never run concurrently) and reference the KV-cache and weight tensors
by address: after ``KVCache.release()`` or replacing parameter tensors (not in-place updates), drop them.
Only ``polyrl.platform.device`` is asked for the graph API.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from polyrl import kernels
from polyrl.infer.config import RolloutConfig
from polyrl.infer.kv_cache import KVCache
from polyrl.infer.overlap import feed_input_ids
from polyrl.infer.sampler import SamplingRows
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.moe import Routing
from polyrl.platform import device


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed (``device.graph_capture`` has already cleaned up); decode eagerly."""


@dataclass
class DecodeBuffers:
    """The device inputs of the decode step just run (views of its ``[bs]`` rows) and how to run it again."""

    input_ids: torch.Tensor  # int64 [bs]
    positions: torch.Tensor  # int64 [bs]
    slot_mapping: torch.Tensor  # int64 [bs]
    context_lens: torch.Tensor  # int32 [bs]
    block_tables: torch.Tensor  # int32 [bs, M]
    run: Callable[[], torch.Tensor]  # -> logits [bs, V] (the model's dtype)

    def advance(self, tokens: torch.Tensor, block_size: int) -> None:
        """Inputs of the next decode step, on the device: each row's input is the token it just drew, one
        position on, its slot looked up in its block table (the host allocated those blocks beforehand)."""
        self.input_ids.copy_(tokens)
        self.positions.add_(1)
        self.context_lens.add_(1)
        block = self.block_tables.gather(1, (self.positions // block_size).unsqueeze(1)).squeeze(1)
        self.slot_mapping.copy_(block.to(torch.int64) * block_size + self.positions % block_size)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv: KVCache, cfg: RolloutConfig, max_blocks_per_seq: int) -> None:
        api = device.graph_api()
        streams = device.stream_api()
        if api is None or streams is None:
            raise RuntimeError("CUDA graphs are not supported on this platform")
        self.graph_cls, self.graph_ctx = api
        self.streams = streams
        self.model, self.kv = model, kv
        self.sizes = cfg.graph_batch_sizes()
        dev = next(model.parameters()).device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        # the launch graphs' sampling inputs (padded rows: greedy, T = 1) and which rows are real
        self.temps = torch.ones(n, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=dev)
        self.offsets = torch.zeros(n, dtype=torch.int64, device=dev)
        self.greedy = torch.ones(n, dtype=torch.bool, device=dev)
        self.live = torch.zeros(n, dtype=torch.bool, device=dev)
        self.block_size = cfg.block_size
        self.pool = streams.graph_pool_handle()
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.launch_graphs: dict[tuple[int, int], tuple[object, torch.Tensor, torch.Tensor]] = {}
        self.capture_s = 0.0  # wall time spent capturing (warm-up forwards included)
        self.device = dev

    def bucket(self, bs: int) -> int:
        for s in self.sizes:
            if s >= bs:
                return s
        raise ValueError(f"batch {bs} exceeds the largest graph bucket {self.sizes[-1]}")

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttnMetadata(
            cu_seqlens=self.cu_seqlens[: b + 1],
            max_seqlen=1,
            kv_caches=self.kv.caches,
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b],
        )
        if self.kv.routing is None:
            hidden = self.model(self.input_ids[:b], self.positions[:b], meta)
        else:  # the chosen experts, written by slot inside the graph (padded rows: slot -1, the spare row)
            routing = Routing(record=True, keep_logits=False)
            hidden = self.model(self.input_ids[:b], self.positions[:b], meta, routing=routing)
            self.kv.write_routing(self.slot_mapping[:b], routing.topk_ids)
        return self.model.compute_logits(hidden, upcast=False)  # the sampler reads them as fp32

    def _advance(self, b: int, tokens: torch.Tensor) -> None:
        """The next decode step's inputs of rows [0, b) on the device; padded rows (``live`` False) stay put."""
        live = self.live[:b]
        pos = self.positions[:b]
        self.input_ids[:b].copy_(tokens)
        pos.add_(live)
        self.context_lens[:b].add_(live)
        block = self.block_tables[:b].gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1)
        slot = block.to(torch.int64) * self.block_size + pos % self.block_size
        self.slot_mapping[:b].copy_(torch.where(live, slot, torch.full_like(slot, -1)))

    def _launch(self, b: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logprobs = [], []
        for j in range(k):
            offsets = self.offsets[:b] + j if j else self.offsets[:b]
            tok, lp = kernels.sample_tokens(self._forward(b), self.temps[:b], self.seeds[:b], offsets, self.greedy[:b])
            tokens.append(tok)
            logprobs.append(lp)
            if j + 1 < k:
                self._advance(b, tok)
        return torch.stack(tokens), torch.stack(logprobs)

    def _capture_launch(self, b: int, k: int) -> None:
        # Warm up (one launch on a side stream, every row padded: no KV written, nothing advances), then capture.
        self.slot_mapping[:b].fill_(-1)
        self.context_lens[:b].fill_(1)
        self.positions[:b].zero_()
        self.live[:b].fill_(False)
        self.greedy[:b].fill_(True)
        self.temps[:b].fill_(1.0)
        side = self.streams.Stream()
        side.wait_stream(self.streams.current_stream())
        with self.streams.stream(side):
            self._launch(b, k)
        self.streams.current_stream().wait_stream(side)
        graph = self.graph_cls()
        with self.graph_ctx(graph, pool=self.pool):
            tokens, logprobs = self._launch(b, k)
        self.launch_graphs[(b, k)] = (graph, tokens, logprobs)

    def _capture(self, b: int) -> None:
        # Warm up on a side stream (lazy inits, autotuning) with the same padded buffers, then capture.
        self.slot_mapping[:b].fill_(-1)
        self.context_lens[:b].fill_(1)
        side = self.streams.Stream()
        side.wait_stream(self.streams.current_stream())
        with self.streams.stream(side):
            for _ in range(2):
                self._forward(b)
        self.streams.current_stream().wait_stream(side)
        graph = self.graph_cls()
        with self.graph_ctx(graph, pool=self.pool):
            out = self._forward(b)
        self.graphs[b] = (graph, out)

    @torch.inference_mode()
    def capture_up_to(self, batch: int, launch_steps: int = 0) -> None:
        """Capture every bucket a decode batch of at most ``batch`` sequences uses (ahead of time, as a server or an
        RL loop that keeps its cache would: a first-use capture costs ~0.1 s in the middle of a rollout): the step
        graphs, and with ``launch_steps`` > 0 the launch graphs of that many steps too."""
        top = self.bucket(min(max(batch, 1), self.sizes[-1]))
        for b in self.sizes:
            if b <= top:
                self._ensure(b)
                if launch_steps:
                    self._ensure_launch(b, launch_steps)

    def _ensure(self, b: int) -> None:
        if b not in self.graphs:
            self._timed(f"batch-{b} decode", lambda: self._capture(b))

    def _ensure_launch(self, b: int, k: int) -> None:
        if (b, k) not in self.launch_graphs:
            self._timed(f"batch-{b} x {k}-step decode launch", lambda: self._capture_launch(b, k))

    def _timed(self, what: str, capture) -> None:
        t0 = time.perf_counter()
        try:
            capture()
        except Exception as exc:  # noqa: BLE001 - any capture failure means "this model decodes eagerly"
            raise GraphCaptureError(f"capturing the {what} graph failed: {exc}") from exc
        self.capture_s += time.perf_counter() - t0

    def decode_buffers(self, bs: int) -> DecodeBuffers:
        """The static buffers' first ``bs`` rows and a replay of the bucket last run (for ``execute_steps``)."""
        graph, out = self.graphs[self.bucket(bs)]

        def replay() -> torch.Tensor:
            graph.replay()
            return out[:bs]

        return DecodeBuffers(
            self.input_ids[:bs],
            self.positions[:bs],
            self.slot_mapping[:bs],
            self.context_lens[:bs],
            self.block_tables[:bs],
            replay,
        )

    @torch.inference_mode()
    def run(self, arrays: dict[str, np.ndarray], fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the bucket's graph on ``arrays``; ``fed = (rows [bs], prev_tokens)`` overrides input ids on the
        device (``overlap.feed_input_ids``)."""
        bs = int(arrays["context_lens"].size)
        b = self.bucket(bs)
        self._ensure(b)
        self._fill(arrays, b, fed)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:bs]

    @torch.inference_mode()
    def run_launch(
        self,
        arrays: dict[str, np.ndarray],
        fed: tuple[torch.Tensor, torch.Tensor] | None,
        rows: SamplingRows,
        steps: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the (bucket, ``steps``) launch graph: ``steps`` decode steps with their draws; returns (tokens
        int64, logprobs fp32), each ``[steps, bs]`` (fresh tensors, not the graph's outputs)."""
        bs = int(arrays["context_lens"].size)
        b = self.bucket(bs)
        self._ensure_launch(b, steps)
        self._fill(arrays, b, fed, rows)
        graph, tokens, logprobs = self.launch_graphs[(b, steps)]
        graph.replay()
        return tokens[:, :bs].clone(), logprobs[:, :bs].clone()

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the device without waiting for it (pinned, non-blocking; as is on the CPU)."""
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)

    def _fill(self, arrays, b: int, fed, rows: SamplingRows | None = None) -> None:
        """The step's host arrays (and the launch's sampling rows) into the buffers' first ``b`` rows: one pinned
        int64 transfer (plus one fp32 for the temperatures), padded rows as the module docstring says."""
        bs = int(arrays["context_lens"].size)
        width = arrays["block_tables"].shape[1]
        pad = b - bs
        parts = [
            arrays["input_ids"], np.zeros(pad, np.int64), arrays["positions"], np.zeros(pad, np.int64),
            arrays["slot_mapping"], np.full(pad, -1, np.int64), arrays["context_lens"], np.ones(pad, np.int64),
        ]  # fmt: skip
        if rows is not None:
            parts += [rows.seeds, np.zeros(pad, np.int64), rows.offsets, np.zeros(pad, np.int64), rows.greedy,
                      np.ones(pad, np.int64), np.ones(bs, np.int64), np.zeros(pad, np.int64)]  # fmt: skip
        tables = np.zeros((b, width), np.int64)
        tables[:bs] = arrays["block_tables"]
        parts.append(tables.reshape(-1))
        buf = self._upload(np.concatenate(parts))
        cols = [self.input_ids, self.positions, self.slot_mapping, self.context_lens]
        if rows is not None:
            cols += [self.seeds, self.offsets, self.greedy, self.live]
            temps = np.concatenate([rows.temps, np.ones(pad, np.float32)])
            self.temps[:b].copy_(self._upload(temps))
        for i, col in enumerate(cols):
            col[:b].copy_(buf[i * b : (i + 1) * b])
        self.block_tables[:b, :width].copy_(buf[len(cols) * b :].view(b, width))
        if fed is not None:
            feed_input_ids(self.input_ids[:bs], *fed)
