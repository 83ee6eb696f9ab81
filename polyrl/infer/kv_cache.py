"""Paged KV cache tensors: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hk, D]``.

Sizing: a given ``num_blocks``; else on an accelerator the memory left under the utilisation line
(``free - total * (1 - utilisation)``, so colocated training memory already allocated is respected)
minus an estimate of the step's activations; else on the CPU ``cpu_kv_cache_bytes``.
``release()`` frees the tensors (colocated training gets the memory back) and ``allocate()`` takes it
again with the same shape, so block ids stay meaningful for the block manager after a reset.

Routing record (``RolloutConfig.record_routing``, MoE models): ``routing`` ``[num_slots + 1, L, k]`` (L = the MoE
layers, in order; int8 / int16 / int32 as the expert count allows) holds, per cache slot, the experts each MoE layer
chose for the token whose keys sit there; every forward writes its tokens' rows by slot (``write_routing``, inside
CUDA graphs too; slot -1, a padded row, lands in the spare last row). A token served from the prefix cache so has
the row its block's first computation wrote, and ``read_routing`` gathers a sequence's rows before its blocks are
freed.

FP8 (``RolloutConfig.kv_cache_dtype = "fp8_e4m3"``): the blocks are ``float8_e4m3fn``, one byte per element, so the
same memory holds twice the blocks of a bf16 cache and a decode step reads half the KV bytes (qwen3-8b, B256 at a
~256-token context: ~9.7 GB -> ~4.8 GB per step). The write op quantises (``kernels.write_kv_cache``: prefill chunks
and decode tokens alike) and the paged-attention kernel upcasts the FP8 tiles in registers; the references dequantise
explicitly (``polyrl/kernels/paged_attention/reference.py``, the spec).

The scale is static and 1.0 for every layer and head, which is what vLLM ships for ``fp8`` / ``fp8_e4m3`` without
calibrated k/v scales: no scale bytes stored or read per key, nothing computed at write time, nothing that can go
stale when RL changes the weights, and the Triton write and the reference store the same bytes on the GPU. Values
beyond e4m3's range saturate at +-448 (never NaN). Why that range is enough for keys here: with Qwen3's per-head
qk-norm, a key is ``gamma * x / rms(x)`` before RoPE (a rotation of pairs, norm-preserving), so
``|k| <= sqrt(head_dim) * max|gamma|`` = 11.3 * max|gamma| at head_dim 128, inside 448 for any ``k_norm`` weight
under ~39. Values (and the keys of models without qk-norm) have no such bound: one past 448 is clipped.
Precision is e4m3's 3 mantissa bits (relative rounding <= 1/16) down to 2^-6, then a fixed 2^-9 step. The
alternative, a scale per (token, kv-head) computed at write, would add 4 bytes per 128 values to store and read and a
reduction per write; per-(layer, head) calibrated scales would need a calibration pass and re-calibration after
every RL update.

This module owns tensors only; which block holds what is ``block_manager.py``'s business. It does not calibrate
scales.
"""

from __future__ import annotations

import torch

from polyrl.errors import ConfigError
from polyrl.infer.config import RolloutConfig
from polyrl.kernels import ops, registry
from polyrl.platform import device

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def check_fp8_kv_supported(dev: torch.device, model_dtype: torch.dtype) -> None:
    """Refuse an FP8 cache on a CUDA device whose Triton kernels cannot convert FP8 (compute capability < 8.9, the
    same line as the FP8 GEMM), unless POLYRL_KERNELS forces the reference paged attention (slow, any device)."""
    if dev.type != "cuda" or device.supports_fp8_gemm(dev.index or 0):
        return
    name = ops.dtype_name(model_dtype)
    if registry.select("paged_attention", "cuda", name)[0] == "reference":
        return
    raise ConfigError(
        f"kv_cache_dtype='fp8_e4m3' (--kv-cache-dtype fp8) needs FP8 conversions in the paged-attention kernels, "
        f"which this device ({device.name()}) lacks (NVIDIA compute capability >= 8.9); drop the FP8 KV cache, or "
        f"set POLYRL_KERNELS=paged_attention:reference,kv_cache_write:reference to run the slow reference"
    )


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def activation_reserve(cfg: RolloutConfig, model_cfg, act_dtype: torch.dtype) -> int:
    """Bytes a step may need beyond weights and cache: hidden-size activations of the token budget,
    the MLP's [T, 2I] and the fp32 logits of the sampled rows (x3 for softmax/sort temporaries)."""
    elem = torch.empty((), dtype=act_dtype).element_size()
    t = cfg.max_num_batched_tokens
    acts = t * (8 * model_cfg.hidden_size + 3 * model_cfg.intermediate_size) * elem
    logits = cfg.max_num_seqs * model_cfg.vocab_size * 4 * 4
    return int(acts + logits) + (256 << 20)


class KVCache:
    def __init__(self, cfg: RolloutConfig, model_cfg, model_dtype: torch.dtype, dev: torch.device) -> None:
        self.cfg = cfg
        self.num_layers = model_cfg.num_layers
        self.num_kv_heads = model_cfg.num_kv_heads
        self.head_dim = model_cfg.head_dim
        self.block_size = cfg.block_size
        self.dtype = _DTYPES[cfg.kv_cache_dtype] if cfg.kv_cache_dtype else model_dtype
        if self.dtype == torch.float8_e4m3fn:
            check_fp8_kv_supported(dev, model_dtype)
        self.device = dev
        self.block_bytes = bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
        self.routing_shape: tuple[int, int] | None = None  # (MoE layers, k) when recording routing
        self.routing: torch.Tensor | None = None
        if cfg.record_routing and getattr(model_cfg, "is_moe", False) and model_cfg.moe_layers:
            self.routing_shape = (len(model_cfg.moe_layers), model_cfg.num_experts_per_tok)
            self.routing_dtype = routing_dtype(model_cfg.num_experts)
            elem = torch.empty((), dtype=self.routing_dtype).element_size()
            self.block_bytes += self.block_size * self.routing_shape[0] * self.routing_shape[1] * elem
        self.num_blocks = self._size(model_cfg, model_dtype)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.allocate()

    def _size(self, model_cfg, model_dtype: torch.dtype) -> int:
        if self.cfg.num_blocks is not None:
            return self.cfg.num_blocks
        if self.device.type == "cpu":
            # No more than every sequence at full length could use: CPU memory is not free to hoard.
            max_len = self.cfg.max_model_len or model_cfg.max_position_embeddings
            useful = self.cfg.max_num_seqs * -(-max_len // self.block_size) * self.block_bytes
            budget = min(self.cfg.cpu_kv_cache_bytes, useful)
        else:
            free, total = device.mem_get_info()
            budget = free - int(total * (1.0 - self.cfg.gpu_memory_utilization))
            budget -= activation_reserve(self.cfg, model_cfg, model_dtype)
        n = budget // self.block_bytes
        if self.cfg.max_num_blocks is not None:
            n = min(n, self.cfg.max_num_blocks)
        if n < 1:
            raise ConfigError(
                f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB, one block needs "
                f"{self.block_bytes / 2**20:.2f} MiB); raise gpu_memory_utilization, lower max_num_batched_tokens "
                f"or max_num_seqs, or set num_blocks"
            )
        return int(n)

    @property
    def allocated(self) -> bool:
        return self.caches is not None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def allocate(self) -> None:
        if self.caches is not None:
            return
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # FP8 blocks are zeroed as bytes (all-zero bits are +0.0 in e4m3), whatever float8 fills a backend has
        raw = torch.uint8 if self.dtype == torch.float8_e4m3fn else self.dtype
        self.caches = [
            (
                torch.zeros(shape, dtype=raw, device=self.device).view(self.dtype),
                torch.zeros(shape, dtype=raw, device=self.device).view(self.dtype),
            )
            for _ in range(self.num_layers)
        ]
        if self.routing_shape is not None:
            rows = self.num_blocks * self.block_size + 1  # + the row padded slots (-1) write into
            self.routing = torch.full((rows, *self.routing_shape), -1, dtype=self.routing_dtype, device=self.device)

    def release(self) -> None:
        self.caches = None
        self.routing = None
        device.empty_cache()

    def write_routing(self, slot_mapping: torch.Tensor, topk_ids: dict[int, torch.Tensor]) -> None:
        """Store one forward's chosen experts (``Routing.topk_ids``: MoE layer -> ``[T, k]``) at its tokens' slots
        ``[T]`` (-1: a padded row, into the spare row). Device ops only: capturable in a CUDA graph."""
        ids = torch.stack([topk_ids[i] for i in sorted(topk_ids)], dim=1).to(self.routing.dtype)  # [T, L, k]
        spare = self.routing.shape[0] - 1
        self.routing.index_copy_(0, torch.where(slot_mapping < 0, spare, slot_mapping), ids)

    def read_routing(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored rows of ``slots`` (int64 ``[n]`` on the device): ``[n, L, k]``, a new tensor."""
        return self.routing.index_select(0, slots)


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed int that holds every expert id and -1 (a missing row)."""
    if num_experts <= 128:
        return torch.int8
    return torch.int16 if num_experts <= 32768 else torch.int32
