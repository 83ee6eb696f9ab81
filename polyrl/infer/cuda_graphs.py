"""CUDA graphs for decode steps, one per batch-size bucket, captured lazily on first use.

Static device buffers (sized for the largest bucket) hold ``input_ids``, ``positions``, ``slot_mapping``,
``cu_seqlens``, ``context_lens`` and ``block_tables [max_bs, max_blocks_per_seq]``; a graph for bucket ``b``
runs forward + ``compute_logits`` on their first ``b`` rows and leaves fp32 logits ``[b, V]`` in its own
output tensor. A step copies its host arrays into the buffers with one H2D transfer per buffer, pads to
the bucket (slot -1: nothing written; context length 1 over block 0, so padded rows read a real slot and
stay finite - their logits are discarded) and replays. Nothing inside the captured region syncs the host.

Graphs share one memory pool (they never run concurrently) and reference the KV-cache and weight tensors
by address: after ``KVCache.release()`` or replacing parameter tensors (not in-place updates), drop them.
Only ``polyrl.platform.device`` is asked for the graph API.
"""

from __future__ import annotations

import numpy as np
import torch

from polyrl.infer.config import EngineConfig
from polyrl.infer.kv_cache import KVCache
from polyrl.infer.overlap import feed_input_ids
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.platform import device


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed (``device.graph_capture`` has already cleaned up); decode eagerly."""


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv: KVCache, cfg: EngineConfig, max_blocks_per_seq: int) -> None:
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
        self.pool = streams.graph_pool_handle()
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
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
        hidden = self.model(self.input_ids[:b], self.positions[:b], meta)
        return self.model.compute_logits(hidden)

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
    def capture_up_to(self, batch: int) -> None:
        """Capture every bucket a decode batch of at most ``batch`` sequences uses (ahead of time, as a server or an
        RL loop that keeps its cache would: a first-use capture costs ~0.1 s in the middle of a rollout)."""
        import time

        top = self.bucket(min(max(batch, 1), self.sizes[-1]))
        for b in self.sizes:
            if b <= top and b not in self.graphs:
                t0 = time.perf_counter()
                try:
                    self._capture(b)
                except Exception as exc:  # noqa: BLE001 - as in run()
                    raise GraphCaptureError(f"capturing the batch-{b} decode graph failed: {exc}") from exc
                self.capture_s += time.perf_counter() - t0

    def decode_buffers(self, bs: int):
        """The static buffers' first ``bs`` rows and a replay of the bucket last run (for ``execute_steps``)."""
        from polyrl.infer.model_runner import DecodeBuffers

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
        if b not in self.graphs:
            import time

            t0 = time.perf_counter()
            try:
                self._capture(b)
            except Exception as exc:  # noqa: BLE001 - any capture failure means "this model decodes eagerly"
                raise GraphCaptureError(f"capturing the batch-{b} decode graph failed: {exc}") from exc
            self.capture_s += time.perf_counter() - t0
        width = arrays["block_tables"].shape[1]
        pad = b - bs
        ids = np.concatenate([arrays["input_ids"], np.zeros(pad, np.int64)])
        pos = np.concatenate([arrays["positions"], np.zeros(pad, np.int64)])
        slots = np.concatenate([arrays["slot_mapping"], np.full(pad, -1, np.int64)])
        ctx = np.concatenate([arrays["context_lens"], np.ones(pad, np.int64)])
        tables = np.zeros((b, width), np.int64)
        tables[:bs] = arrays["block_tables"]
        flat = torch.from_numpy(np.concatenate([ids, pos, slots, ctx, tables.reshape(-1)])).pin_memory()
        buf = flat.to(self.device, non_blocking=True)
        self.input_ids[:b].copy_(buf[:b])
        self.positions[:b].copy_(buf[b : 2 * b])
        self.slot_mapping[:b].copy_(buf[2 * b : 3 * b])
        self.context_lens[:b].copy_(buf[3 * b : 4 * b])
        self.block_tables[:b, :width].copy_(buf[4 * b :].view(b, width))
        if fed is not None:
            feed_input_ids(self.input_ids[:bs], *fed)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:bs]
