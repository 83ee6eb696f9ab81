"""``DecoderLM``: one config-driven decoder for Llama / Mistral / Qwen2 / Qwen2.5 / Qwen3 and the MoE families
(Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral: each MoE layer's MLP is a ``moe.SparseMoeBlock``), built on
``polyrl.kernels``.

Parameter names equal the Hugging Face ones, so checkpoints load by name. Two input paths share all
code except attention: packed variable-length tokens (``AttnMetadata`` with ``cu_seqlens``; training and
cache-free prefill) and paged KV (``meta.kv_caches`` set: new k/v are written with ``write_kv_cache`` at
``meta.slot_mapping``, then ``paged_attention`` reads the cache). The paged path has no host syncs in this
module, so the rollout engine can capture decode in a CUDA graph.

Projections (``project``, ``project_group``): a plain ``nn.Linear`` fed at most ``skinny_linear.ROUTE_MAX_ROWS`` rows
with autograd off (a batch-1 decode step) runs ``kernels.skinny_linear``, which streams the weight where cuBLAS's
small-M tiles leave bandwidth unused, q/k/v in one launch and gate/up in one; everything else is the module's call.
Inside ``projection_override(o)`` (this thread only; the rollout engine's FP8 weights, ``polyrl.infer.fp8_weights``,
or its fused q/k/v and gate/up copies, ``polyrl.infer.fused_projections``)
``o.project(linears, x)`` runs first and its result, unless None, replaces all of that (skinny path included).

Where there is more than one way to run a part (grouped or concurrent projections, the fused q/k norms + RoPE, the
frozen down projection after a checkpoint), ``DecoderOptions`` picks it: held by the model (``DecoderLM.options``),
read at each forward and handed to every layer, never module state.

The residual stream runs through the fused ``rmsnorm(x, w, residual=r)`` op: each layer hands on
``(branch_output, residual)`` and the next norm adds them, which is bit-identical to HF's ``h = r + f(h)``
because float addition is commutative.

Deliberately not here: the loss and log-prob heads (``polyrl.kernels.linear_cross_entropy`` /
``token_logprobs`` take ``lm_head_weight``), KV-cache allocation and scheduling (``polyrl.infer``),
weight loading (``checkpoint.py``), sharding (``polyrl.train.parallel``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from polyrl import kernels
from polyrl.kernels.rope.reference import inv_frequencies
from polyrl.kernels.skinny_linear import ROUTE_MAX_ROWS as SKINNY_ROWS
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.config import ModelConfig
from polyrl.models.moe import Experts, Routing, SparseMoeBlock
from polyrl.platform import device


@dataclass(frozen=True)
class DecoderOptions:
    """Which implementation the decoder's forward takes where there is a choice; every choice gives the same numbers
    (up to float rounding) and only speed differs. Held by the model (``DecoderLM.options``) and read at each forward,
    so ``model.options = dataclasses.replace(model.options, ...)`` reaches every layer. Set it before an ``LLM``
    captures its CUDA graphs: a captured graph replays the path taken at capture (``LLM`` recaptures after
    ``runner.invalidate_graphs()``)."""

    # One skinny_linear launch for q/k/v and one for gate/up, only at decode batch 1 with autograd off (False: one
    # launch per projection). H200, bench rollout --compare-parts (gpu_stage.sh decode-candidates, run24): batch-1
    # decode 1.41 vs 1.55 ms/token.
    group_projections: bool = True
    # q/k/v (and gate/up) as concurrent GEMMs on forked streams when autograd is off and the grouped launch does not
    # apply (parallel branches of a decode graph): the same cuBLAS kernels, so the same numbers, overlapping their
    # launch and tail latency (each small GEMM of a decode step takes ~5 us however wide it is, H200 profile). Off:
    # measured mixed (run24, interleaved medians): B256 48.3k vs 46.0k tokens/s, B512 72.7k vs 74.8k (the concurrent
    # GEMMs contend for the SMs at large batches).
    parallel_projections: bool = False
    # Qwen3's q/k norms and RoPE as one kernel (kernels.qk_norm_rope), only for models with q/k norms and with
    # autograd off: 2 of every layer's decode launches fewer. H200 (run24, interleaved medians): B256 51.1k vs 47.8k
    # tokens/s, B512 78.0k vs 74.5k, batch-1 decode 1.47 vs 1.55 ms/token.
    fused_qk_norm_rope: bool = True
    # Only under activation checkpointing: a layer whose down_proj is a LoRA / QLoRA layer on a frozen base
    # (``down_splits``) runs that base GEMM after the checkpoint instead of inside it: the recomputed forward stops at
    # the adapter's product (the non-reentrant checkpoint stops once every saved tensor is back), so the layer's
    # largest frozen GEMM (and, for QLoRA, its dequantization) runs twice per step instead of three times. Nothing
    # more is saved (the base's backward needs only the weight). A frozen down_proj without an adapter saves nothing
    # and is not recomputed anyway. H200, qwen3-8b shape, 2 x 4096 tokens, checkpointed, back to back in one call
    # (scripts/gpu_stage.sh frozen-down, run29): LoRA 11,317 vs 10,783 tokens/s (+5.0%), QLoRA 10,985 vs 10,331
    # (+6.3%), peak memory the same (19.7 / 10.5 GiB).
    skip_frozen_down_recompute: bool = True


def _skinny_ok(linears: tuple[nn.Module, ...], x: torch.Tensor) -> bool:
    """Whether ``linears`` applied to ``x`` take ``kernels.skinny_linear``: a decode-sized input (at most
    ``ROUTE_MAX_ROWS`` rows) with autograd off, plain ``nn.Linear`` modules with plain weights of ``x``'s dtype, and a
    fast implementation selected here (the reference gains nothing over the modules' own GEMM)."""
    if x.dim() != 2 or x.shape[0] > SKINNY_ROWS or torch.is_grad_enabled():
        return False
    for lin in linears:
        if type(lin) is not nn.Linear or type(lin.weight) is not nn.Parameter or lin.weight.dtype != x.dtype:
            return False
    if len({lin.bias is None for lin in linears}) != 1:
        return False
    return kernels.registry.select("skinny_linear", x.device.type, kernels.dtype_name(x.dtype))[0] != ("reference")


# The projection override of this thread (``projection_override``); None: the decoder's own path, at one lookup's cost.
_OVERRIDE: contextvars.ContextVar[Any] = contextvars.ContextVar("polyrl_projection_override", default=None)


class ProjectionOverride:
    """What the decoder asks an override (``projection_override``) first; each method returns None to run as usual.

    - ``project(linears, x)``: ``tuple(l(x) for l in linears)``;
    - ``norm(module, x, residual)``: ``module(x, residual)`` of an ``RMSNorm`` (its output then feeds projections the
      override runs, which may take what the override kept of it: ``Fp8Weights``' quantised copy);
    - ``activation(mlp, gate, up)``: the SwiGLU of ``mlp`` (the input of its down projection), likewise."""

    def project(self, linears: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        return None

    def norm(self, module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
        return None

    def activation(self, mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        return None


@contextlib.contextmanager
def projection_override(override: ProjectionOverride | None) -> Iterator[None]:
    """Within the block (this thread), ``project`` / ``project_group`` first ask ``override.project(linears, x)`` (a
    tuple of outputs, or None to run as usual), ``RMSNorm`` ``override.norm`` and ``MLP.activation``
    ``override.activation`` (``ProjectionOverride``); ``override`` None changes nothing. The rollout engine enters it
    around its forwards (and graph captures) with its FP8 weights or fused copies; the training forward of the same
    module never sees it."""
    token = _OVERRIDE.set(override)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for ``x [T, in]``; a batch-1 decode input goes to ``kernels.skinny_linear`` (``_skinny_ok``)."""
    override = _OVERRIDE.get()
    if override is not None:
        out = override.project((linear,), x)
        if out is not None:
            return out[0]
    if _skinny_ok((linear,), x):
        return kernels.skinny_linear(x, linear.weight, linear.bias)
    return linear(x)


def project_group(linears: tuple[nn.Module, ...], x: torch.Tensor, options: DecoderOptions) -> tuple[torch.Tensor, ...]:
    """``tuple(l(x) for l in linears)``; at batch 1 (``_skinny_ok``) with ``options.group_projections`` one
    ``skinny_linear`` launch computes them all side by side and the results are its column slices (contiguous: one
    row); otherwise, with ``options.parallel_projections`` and autograd off, concurrent GEMMs."""
    override = _OVERRIDE.get()
    if override is not None:
        out = override.project(linears, x)
        if out is not None:
            return out
    if options.group_projections and x.shape[0] == 1 and _skinny_ok(linears, x):
        biases = None if linears[0].bias is None else tuple(lin.bias for lin in linears)
        y = kernels.skinny_linear(x, tuple(lin.weight for lin in linears), biases)
        return tuple(y.split([lin.out_features for lin in linears], dim=-1))
    if options.parallel_projections and not torch.is_grad_enabled():
        return tuple(device.run_concurrently([functools.partial(project, lin, x) for lin in linears]))
    return tuple(project(lin, x) for lin in linears)


class RMSNorm(nn.Module):
    """Holds ``weight`` (HF name); the op is ``kernels.rmsnorm`` (fp32 statistics, optional fused residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        override = _OVERRIDE.get()
        if override is not None:
            out = override.norm(self, x, residual)
            if out is not None:
                return out
        return kernels.rmsnorm(x, self.weight, self.eps, residual)


class Rotary:
    """cos/sin ``[T, D]`` for a forward's ``position_ids``, computed once and shared by all layers.

    ``kernels.rope_cos_sin`` rebuilds the inverse frequencies on the host each call (a host-to-device copy,
    which a CUDA graph cannot capture). Here they are built once per device with the same spec function and
    kept, and the per-token part is the same arithmetic: fp32 ``pos * inv_freq``, ``cat([f, f])``, cos/sin, cast.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.head_dim, self.theta, self.scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq.get(device)
        if cached is None:
            cached = inv_frequencies(self.head_dim, self.theta, self.scaling).to(device)
            self._inv_freq[device] = cached
        return cached

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[:, None] * self.inv_freq(position_ids.device)[None, :]  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.layer_window(layer)
        h, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_out, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, kv_out, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, kv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_out, h, bias=cfg.o_bias)
        # Qwen3: RMSNorm over head_dim of each head, before RoPE; OLMoE ("proj"): over the whole q / k projection.
        self.norm_per_head = cfg.family.qk_norm_scope == "head"
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim if self.norm_per_head else q_out, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim if self.norm_per_head else kv_out, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata, options: DecoderOptions
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project_group((self.q_proj, self.k_proj, self.v_proj), x, options)
        if self.q_norm is not None and not self.norm_per_head:  # OLMoE: norm over [T, Hq * D] before the heads split
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        per_head = self.q_norm is not None and self.norm_per_head
        fused = per_head and options.fused_qk_norm_rope and not torch.is_grad_enabled()
        if fused and meta.kv_caches is not None:  # a paged step: k' and v go straight to the cache, one launch
            k_cache, v_cache = meta.kv_caches[self.layer]
            q = kernels.qk_norm_rope_cache(
                q, k, v, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps, k_cache, v_cache,
                meta.slot_mapping,
            )  # fmt: skip
            return self._paged(q, k_cache, v_cache, meta, t)
        if fused:
            q, k = kernels.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)
        else:
            if per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = kernels.apply_rope(q, k, cos, sin)
        if meta.kv_caches is None:
            o = kernels.varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, self.scale, self.window)
            return project(self.o_proj, o.reshape(t, self.num_heads * self.head_dim))
        k_cache, v_cache = meta.kv_caches[self.layer]
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._paged(q, k_cache, v_cache, meta, t)

    def _paged(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, t: int
    ) -> torch.Tensor:
        """Attention of q over the paged cache (this step's k/v already written), then the output projection."""
        o = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.cu_seqlens,
            meta.max_seqlen,
            self.scale,
            self.window,
        )
        return project(self.o_proj, o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, size: int | None = None) -> None:
        """A SwiGLU MLP of width ``size`` (default ``cfg.intermediate_size``; a shared expert passes its own)."""
        super().__init__()
        size = cfg.intermediate_size if size is None else size
        self.gate_proj = nn.Linear(cfg.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=False)

    def activation(self, x: torch.Tensor, options: DecoderOptions) -> torch.Tensor:
        """``swiglu(gate(x), up(x))``: the down projection's input."""
        gate, up = project_group((self.gate_proj, self.up_proj), x, options)
        override = _OVERRIDE.get()
        if override is not None:
            out = override.activation(self, gate, up)
            if out is not None:
                return out
        return kernels.swiglu(gate, up)

    def forward(self, x: torch.Tensor, options: DecoderOptions) -> torch.Tensor:
        return project(self.down_proj, self.activation(x, options))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer_index = layer
        self.self_attn = Attention(cfg, layer)
        # MoE families: a sparse block on the layers HF makes sparse (decoder_sparse_step, mlp_only_layers).
        self.is_moe = cfg.is_moe_layer(layer)
        if self.is_moe:
            shared = cfg.shared_expert_intermediate_size
            self.mlp = SparseMoeBlock(cfg, MLP(cfg, shared) if shared else None)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h,
        residual,
        cos,
        sin,
        meta: AttnMetadata,
        options: DecoderOptions,
        split_down: bool = False,
        routing: Routing | None = None,
    ):
        """``h + residual`` is the stream entering the layer (``residual`` None at layer 0); ``options`` are the
        model's (``DecoderLM.options``).
        Returns ``(mlp_out, residual)`` whose sum is the stream leaving it. ``split_down`` (``down_splits``): returns
        ``(act, adapter, residual)`` instead, the down projection's input and its adapter's product; ``down_onto``
        finishes the layer. An MoE layer given a ``routing`` (read only: its ``replay``) returns
        ``(mlp_out, residual, router_logits, topk_ids)``; the caller records them (outside any checkpoint)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta, options), residual)
        if self.is_moe:
            replay = None if routing is None else routing.replay_ids(self.layer_index, x.shape[0])
            out, logits, ids = self.mlp(x, options, replay)
            return (out, residual) if routing is None else (out, residual, logits, ids)
        if not split_down:
            return self.mlp(x, options), residual
        act = self.mlp.activation(x, options)
        return act, self.mlp.down_proj.adapter_product(act), residual


def _sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds distributed tensors (FSDP2 shards, gathered only inside its owner's forward)."""
    if not torch.distributed.is_available():
        return False
    # lazy: torch.distributed.tensor exists only where torch.distributed is available (checked just above)
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in (*module.parameters(), *module.buffers()))


def down_splits(layer: DecoderLayer) -> bool:
    """Whether ``layer``'s down projection can run after the layer's checkpoint
    (``DecoderOptions.skip_frozen_down_recompute``): a LoRA layer (``splits_at_checkpoint``: an active dropout-free
    adapter on a frozen base, dense or NF4) on unsharded weights."""
    down = getattr(layer.mlp, "down_proj", None)  # an MoE block has none
    return hasattr(down, "splits_at_checkpoint") and down.splits_at_checkpoint() and not _sharded(down)


def down_onto(layer: DecoderLayer, adapter: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """The layer's MLP output from ``forward(..., split_down=True)``: ``adapter + act W_down^T``, saving no
    activation (a frozen base needs only its weight for the input gradient)."""
    return layer.mlp.down_proj.base_onto(adapter, act)


class Backbone(nn.Module):
    """HF's ``model.*`` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """Causal LM over packed tokens. ``forward`` returns the final-norm hidden states ``[T, H]``; logits are
    ``compute_logits`` (or a fused loss/log-prob kernel over ``lm_head_weight``). ``options`` (``DecoderOptions``,
    default all defaults) picks the implementation where there is a choice; it is read at each forward, so
    ``model.options = dataclasses.replace(model.options, fused_qk_norm_rope=False)`` reaches every layer (before an
    ``LLM`` captures its CUDA graphs: a graph replays what was captured)."""

    def __init__(self, cfg: ModelConfig, options: DecoderOptions | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.options = DecoderOptions() if options is None else options
        self.model = Backbone(cfg)
        # Tied: no lm_head module at all (HF checkpoints omit lm_head.weight too), the embedding is the head.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.gradient_checkpointing = False
        # With gradient_checkpointing: recompute only the first this-many layers (None: all), the rest keep their
        # activations (Megatron's recompute_num_layers, block method): less recomputation for the memory it costs.
        self.checkpoint_layers: int | None = None
        # MoE: the Routing a forward without a ``routing`` argument uses (``moe.routing_scope``; the training engine)
        self.default_routing: Routing | None = None

    @property
    def options(self) -> DecoderOptions:
        return self._options

    @options.setter
    def options(self, options: DecoderOptions) -> None:
        if not isinstance(options, DecoderOptions):
            raise TypeError(f"DecoderLM.options takes a DecoderOptions, got {type(options).__name__}")
        self._options = options

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]``: the output projection (the embedding matrix when embeddings are tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: AttnMetadata,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """input_ids, position_ids int64 ``[T]`` (packed; positions restart per sequence) -> hidden ``[T, H]``.
        ``routing`` (MoE models; default ``self.default_routing``): records each MoE layer's router logits and experts
        and/or replays given experts (``polyrl.models.moe.Routing``); dense models ignore it."""
        if routing is None:
            routing = self.default_routing
        h = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary(position_ids, h.dtype)  # [T, D], shared by every layer
        residual = None
        options = self.options  # one read per forward: every layer takes the same options
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        capturing = ckpt and device.is_capturing(h)
        n_ckpt = len(self.model.layers) if self.checkpoint_layers is None else self.checkpoint_layers
        for index, layer in enumerate(self.model.layers):
            moe_routing = routing if layer.is_moe else None
            if ckpt and index < n_ckpt:
                # One stream crosses each checkpoint: it keeps [T, H] per layer, not the (h, residual) pair; the
                # add is rounded as the fused residual-norm rounds it, so the result is the same.
                stream = h if residual is None else h + residual
                # Under CUDA-graph capture (train/graphed_step.py, deterministic models only) the RNG state cannot be
                # read; there is no randomness to preserve then.
                if options.skip_frozen_down_recompute and down_splits(layer):
                    act, adapter, residual = checkpoint(
                        layer, stream, None, cos, sin, meta, options, split_down=True, use_reentrant=False,
                        preserve_rng_state=not capturing,
                    )  # fmt: skip
                    h = down_onto(layer, adapter, act)
                else:
                    out = checkpoint(
                        layer,
                        stream,
                        None,
                        cos,
                        sin,
                        meta,
                        options,
                        routing=moe_routing,
                        use_reentrant=False,
                        preserve_rng_state=not capturing,
                    )
                    h, residual = out[:2]
            else:
                out = layer(h, residual, cos, sin, meta, options, routing=moe_routing)
                h, residual = out[:2]
            if moe_routing is not None:
                # Recorded here, from the layer's outputs: a checkpointed layer's recomputation (in backward) returns
                # nothing to this loop, so it never records twice.
                moe_routing.add(index, out[2], out[3])
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[T, H] -> [T, V]`` fp32 (matmul in the weights' dtype, as HF, then upcast; ``upcast=False`` keeps the
        weights' dtype, e.g. for a sampler that reads bf16 as fp32 itself). Materialises all logits: for losses and
        log-probs over many tokens use the fused kernels with ``lm_head_weight``."""
        logits = F.linear(hidden, self.lm_head_weight)
        return logits.float() if upcast else logits

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Unique parameters (a tied embedding/head counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def active_parameters(self) -> int:
        """Parameters one token goes through: ``num_parameters()`` less, in every MoE layer, the ``E - k`` routed
        experts it does not use (router, shared expert, attention, embeddings and head all count). Dense: all."""
        c = self.config
        if not c.is_moe:
            return self.num_parameters()
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size  # gate, up, down
        # the routed experts held as parameters (none under QLoRA, whose NF4 experts are buffers): replaced by the k
        # a token uses, so both storages count the same active parameters
        routed = sum(p.numel() for n, p in self.named_parameters() if n.endswith(_ROUTED_EXPERT_TENSORS))
        return self.num_parameters() - routed + len(c.moe_layers) * c.num_experts_per_tok * per_expert

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) for sequences of ``seq_len``:
        ``6 * N + 6 * layers * seq_len * heads * head_dim``, N = ``num_parameters()`` for a dense model (LM head
        included; tied counts once); for an MoE model ``active_parameters()`` (the k routed experts a token uses, not
        all E) less an untied input embedding.
        The second term is causal attention (QK^T and PV: 2 matmuls x 2 FLOPs x 3 for fwd+bwd, halved by
        causality). Same formula as the project's baseline measurements (BASELINES.md), so MFU compares."""
        c = self.config
        n = self.active_parameters()
        if c.is_moe and self.lm_head is not None:
            # MoE: matmul parameters only, as issue 32's baseline MFU counts them (q/k/v/o, router, the k experts,
            # LM head): an untied input embedding is a lookup, no FLOPs. Dense models keep BASELINES.md's 6N.
            n -= self.model.embed_tokens.weight.numel()
        return 6.0 * n + 6.0 * c.num_layers * seq_len * c.num_heads * c.head_dim


_ROUTED_EXPERT_TENSORS = (".experts.gate_up_proj", ".experts.down_proj")


@torch.no_grad()
def init_weights(model: DecoderLM, seed: int | None = None, std: float | None = None) -> DecoderLM:
    """HF-style random init in place: Linear/Embedding weights ~ N(0, initializer_range), biases 0, norms 1.
    Works on a model materialised from the meta device (``to_empty``). Deterministic for a given seed."""
    std = model.config.initializer_range if std is None else std
    gen = None
    if seed is not None:
        gen = torch.Generator(device=model.lm_head_weight.device)
        gen.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std, generator=gen)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, Experts):
            module.reset_parameters(std, gen)
    return model


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    init: bool = True,
    options: DecoderOptions | None = None,
) -> DecoderLM:
    """A randomly initialised (or, ``init=False``, uninitialised) model, allocated once on ``device`` in ``dtype``;
    ``options`` as ``DecoderLM``'s."""
    with torch.device("meta"):
        model = DecoderLM(cfg, options)
    model = model.to(dtype).to_empty(device=device)  # dtype cast on meta is free: one allocation
    if init:
        init_weights(model, seed)
    return model
