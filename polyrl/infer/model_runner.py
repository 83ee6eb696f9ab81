"""Model runner: one engine step on the device - inputs in, fp32 logits of the sampling rows out.

Eager path (any device, any batch): build ``StepInputs`` (``batch.py``), run ``DecoderLM.forward`` with
paged ``AttnMetadata``, gather the hidden state of each sampling sequence's last token and call
``compute_logits`` on those rows only (never ``[T, V]``).

Decode-only steps with at most ``max_graph_batch_size`` sequences replay a CUDA graph where
``polyrl.platform.device.supports_graphs()``: ``cuda_graphs.py`` captures forward + logits per batch-size
bucket over static buffers; the batch is padded to the bucket.

The runner holds a reference to the model (colocated training shares its weights: no copy). It does
not schedule, sample or own the cache's block accounting.
"""

from __future__ import annotations

import torch

from polyrl.infer.batch import StepInputs, host_arrays, to_device
from polyrl.infer.config import EngineConfig
from polyrl.infer.kv_cache import KVCache
from polyrl.infer.scheduler import SchedulerOutput
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.platform import device


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, cfg: EngineConfig, max_model_len: int) -> None:
        self.model = model
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
            from polyrl import kernels

            head_dim = getattr(getattr(model, "config", None), "head_dim", None)
            # a decode step whose attention runs the host-syncing reference cannot be captured: run it eagerly
            self.use_graphs = head_dim is None or kernels.paged_attention_graph_safe("cuda", self.dtype, head_dim)
        self.graphs = None
        self.last_step_used_graph = False
        self.released_capture_s = 0.0  # capture time of graph sets dropped by invalidate_graphs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """fp32 logits ``[S, V]`` for the scheduled sequences that sample, in scheduling order."""
        if self.kv.caches is None:
            raise RuntimeError("the KV cache is released; call LLM.reallocate() before generating")
        arrays = host_arrays(sched.items, self.cfg.block_size)
        bs = len(sched.items)
        bank = getattr(self.model, "lora_bank", None)
        if bank is not None:  # LoRA adapters per request: each token's adapter slot, eager forward
            bank.index = _adapter_index(sched, bank, self.device)
            self.last_step_used_graph = False
            return self._eager(to_device(arrays, self.device))
        if self.use_graphs and sched.is_decode_only and bs <= self.cfg.max_graph_batch_size:
            if self.graphs is None:
                from polyrl.infer.cuda_graphs import DecodeGraphs

                self.graphs = DecodeGraphs(self.model, self.kv, self.cfg, self.max_blocks_per_seq)
            self.last_step_used_graph = True
            return self.graphs.run(arrays)
        self.last_step_used_graph = False
        inputs = to_device(arrays, self.device)
        return self._eager(inputs)

    def _eager(self, x: StepInputs) -> torch.Tensor:
        meta = AttnMetadata(
            cu_seqlens=x.cu_seqlens,
            max_seqlen=x.max_seqlen,
            kv_caches=self.kv.caches,
            slot_mapping=x.slot_mapping,
            block_tables=x.block_tables,
            context_lens=x.context_lens,
        )
        hidden = self.model(x.input_ids, x.positions, meta)  # [T, H]
        if x.sample_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if x.sample_rows.numel() != x.num_tokens:
            hidden = hidden.index_select(0, x.sample_rows)  # [S, H]
        return self.model.compute_logits(hidden)

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
