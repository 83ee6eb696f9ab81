"""RolloutConfig: how the rollout engine sizes its KV cache and batches, validated on construction.

It only holds numbers; ``kv_cache.py`` turns them into tensors and ``llm.py`` wires the parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.errors import ConfigError

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
KV_CACHE_DTYPES = (None, "bfloat16", "float16", "float32", "fp8_e4m3")  # and "fp8", normalised to "fp8_e4m3"


@dataclass
class RolloutConfig:
    block_size: int = 16
    # KV cache size: a fixed number of blocks, or (on an accelerator) the share of device memory the
    # engine may fill, weights and activations included: cache = free - total * (1 - utilisation).
    num_blocks: int | None = None
    max_num_blocks: int | None = None  # upper bound when sizing from memory (what the workload can use)
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_bytes: int = 256 << 20  # CPU without num_blocks: at most this many bytes of cache
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 8192  # tokens computed in one step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output tokens; None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    cuda_graphs: bool | None = None  # None = where polyrl.platform.device.supports_graphs()
    max_graph_batch_size: int = 512  # decode batches up to this size replay captured graphs (RL: n x prompts)
    # None = the model's dtype; or "bfloat16"/"float16"/"float32"; or "fp8_e4m3" ("fp8" is the same): float8_e4m3fn
    # blocks with a static unit scale (``kv_cache.py``), twice the blocks of bf16 in the same memory, half the bytes
    # read per decode step. On CUDA it needs FP8 conversions (compute capability >= 8.9, as the FP8 GEMM)
    kv_cache_dtype: str | None = None
    # generate(): queue decode step N+1 before reading step N's tokens, so host work overlaps the device. None = on
    # an accelerator only: on the CPU nothing runs asynchronously, so launching ahead only computes the rows of
    # sequences that already stopped (a GRPO rollout of 4-token answers computed twice the forwards)
    overlap_decode: bool | None = None
    # ... and queue this many decode steps per launch when no row needs the host between steps (its tokens past a
    # stop are computed and dropped): the host's per-step work is paid once per that many tokens
    decode_steps: int = 4
    # ... and replay such a launch (decode_steps steps, sampling and the on-device input advance included) as one
    # CUDA graph when every row's draw needs only temperature / seed (no top-k/top-p/min-p): infer/cuda_graphs.py
    launch_graphs: bool = True
    # generate(): Python's cyclic garbage collector off until every prompt finished (platform.host.gc_paused); in
    # scripts/engine_host_overhead.py (B512 x 256 tokens) it ran 82 young and 8 middle-generation passes inside
    # generate(), ~2% of the host time, each a pause of up to a few ms between launches
    pause_gc: bool = True
    # MoE models: record the experts every MoE layer chose for each token a sequence computed
    # (``CompletionOutput.routed_experts``, rollout-routing replay; ``kv_cache.py``). Off: no cost at all
    record_routing: bool = False
    # The projection weights the engine samples with: None = the model's own (shared with colocated training); "fp8" =
    # its own float8_e4m3fn copies, per-output-channel scales, activations quantised per token at run time
    # (``fp8_weights.py``), requantised after every weight update; about half the bf16 weights' bytes of extra memory.
    # Needs an FP8 GEMM (``platform.device.supports_fp8_gemm``) unless POLYRL_KERNELS forces fp8_weight_linear:reference
    weight_precision: str | None = None
    # q/k/v and gate/up as one GEMM each (``fused_projections.py``): the engine's own concatenated copies of those
    # weights (one more copy of ~2/3 of the layers' projection bytes, counted before the KV cache is sized), rewritten
    # in place after every weight update; batch-1 decode keeps its skinny kernels. Off by default until the H200 A/B
    # (``bench rollout --fuse-projections``) says it pays. With weight_precision="fp8" the FP8 copies fuse their groups
    # instead (row slices of one buffer per group: no extra memory)
    fuse_projections: bool = False
    # Structured outputs: separately compiled grammar matchers (lexers) per schema (``structured.GrammarCache``).
    # None = automatic: one per grammar-executor thread on a host with >= 4 of them, rows handed out 16 per lane
    # (so a schema with few rows in flight compiles once); N = N lanes, round-robin
    grammar_lanes: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_blocks is not None and self.max_num_blocks < 1:
            raise ConfigError(f"max_num_blocks must be >= 1 (or None for no bound), got {self.max_num_blocks}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1 (or None to size the cache from memory), got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be None (the model's dtype), bfloat16, float16, float32 or fp8_e4m3 (alias "
                f"fp8), got {self.kv_cache_dtype!r}"
            )
        if self.weight_precision not in (None, "fp8"):
            raise ConfigError(f"weight_precision must be None (the model's) or 'fp8', got {self.weight_precision!r}")
        if not isinstance(self.fuse_projections, bool):
            raise ConfigError(f"fuse_projections must be True or False, got {self.fuse_projections!r}")
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps must be >= 1 (1 = one decode step per launch), got {self.decode_steps}")
        if self.grammar_lanes is not None and self.grammar_lanes < 1:
            raise ConfigError(f"grammar_lanes must be >= 1 (or None: automatic), got {self.grammar_lanes}")
        if self.max_graph_batch_size < 1:
            raise ConfigError(f"max_graph_batch_size must be >= 1, got {self.max_graph_batch_size}")

    def graph_batch_sizes(self) -> list[int]:
        limit = min(self.max_graph_batch_size, self.max_num_seqs)
        sizes = [s for s in DEFAULT_GRAPH_SIZES if s <= limit]
        if not sizes or sizes[-1] < limit:
            sizes.append(limit)
        return sizes
