"""Model families: HF ``model_type`` -> the few facts that make one decoder cover all of them.

A family is data (bias placement, q/k norm, how the sliding window is configured, HF class name), so
adding a Llama-like architecture is adding a row to ``FAMILIES``. This module does not build modules or
read checkpoints; ``decoder.py`` and ``checkpoint.py`` do, from what is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.errors import UserError


@dataclass(frozen=True)
class MoESpec:
    """How one MoE family routes and stores its experts (see ``FamilySpec``)."""

    experts_key: str = "num_experts"
    expert_size_key: str = "moe_intermediate_size"
    topk_norm: str = "config"
    shared_expert: bool = False
    sparse_step: bool = False
    weights_fp32: bool = False
    checkpoint_prefix: str = "mlp"
    # (gate, up, down) names of one expert's matrices in the hub's per-expert layout
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class FamilySpec:
    """How one HF architecture maps onto ``DecoderLM``.

    ``qkv_bias`` / ``o_bias``: ``"config"`` reads ``attention_bias`` from config.json, otherwise a fixed bool.
    ``sliding``: ``"none"`` (never), ``"all"`` (every layer when ``sliding_window`` is set, Mistral),
    ``"layer_types"`` (Qwen: ``use_sliding_window`` + ``max_window_layers`` or an explicit ``layer_types``) or
    ``"flag"`` (Qwen3-MoE: every layer when ``use_sliding_window``). ``window_rule``: which layers slide when a
    ``"layer_types"`` config has no explicit list: ``"from_max"`` (Qwen2: layers >= max_window_layers) or
    ``"odd_below_max"`` (Qwen2-MoE: even 0-based layers below max_window_layers).
    ``qkv_bias_key``: the config.json key of the q/k/v bias flag (``qkv_bias`` for Qwen2-MoE).
    ``qk_norm_scope``: ``"head"`` (Qwen3: RMSNorm over each head's head_dim) or ``"proj"`` (OLMoE: over the whole
    q / k projection, ``heads * head_dim`` wide).

    Mixture-of-experts facts (``moe`` set; ``polyrl/models/moe.py``): ``moe.experts_key`` names the expert count in
    config.json, ``moe.expert_size_key`` the experts' intermediate size, ``moe.topk_norm`` ``"config"``
    (``norm_topk_prob``) or ``"always"`` (Mixtral renormalises the top-k), ``moe.shared_expert`` (Qwen2-MoE's gated
    shared expert), ``moe.sparse_step`` (``decoder_sparse_step`` / ``mlp_only_layers`` make some layers dense),
    ``moe.weights_fp32`` (Mixtral keeps the routing weights fp32; the others cast them to the hidden dtype),
    ``moe.checkpoint_prefix`` (the hub's per-expert layout: ``mlp`` with ``gate_proj/up_proj/down_proj``, or Mixtral's
    ``block_sparse_moe`` with ``w1/w3/w2``).
    """

    model_type: str
    architecture: str  # HF class written to config.json "architectures"
    qkv_bias: bool | str = "config"
    o_bias: bool | str = "config"
    qk_norm: bool = False
    sliding: str = "none"
    default_sliding_window: int | None = None  # HF's default when config.json has no sliding_window key
    window_rule: str = "from_max"
    qkv_bias_key: str = "attention_bias"
    qk_norm_scope: str = "head"
    moe: MoESpec | None = None


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", "LlamaForCausalLM"),
    "mistral": FamilySpec(
        "mistral", "MistralForCausalLM", qkv_bias=False, o_bias=False, sliding="all", default_sliding_window=4096
    ),
    # Qwen2 and Qwen2.5 share model_type "qwen2": bias on q/k/v only, never on o_proj.
    "qwen2": FamilySpec(
        "qwen2", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False, sliding="layer_types", default_sliding_window=4096
    ),
    "qwen3": FamilySpec("qwen3", "Qwen3ForCausalLM", qk_norm=True, sliding="layer_types", default_sliding_window=4096),
    # Mixture-of-experts families (polyrl/models/moe.py).
    "qwen3_moe": FamilySpec(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        qk_norm=True,
        sliding="flag",
        default_sliding_window=4096,
        moe=MoESpec(sparse_step=True),
    ),
    # Qwen1.5-MoE / Qwen2-MoE: q/k/v bias from ``qkv_bias`` (default true), a sigmoid-gated shared expert.
    "qwen2_moe": FamilySpec(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        qkv_bias="config",
        o_bias=False,
        sliding="layer_types",
        default_sliding_window=4096,
        window_rule="odd_below_max",
        qkv_bias_key="qkv_bias",
        moe=MoESpec(shared_expert=True, sparse_step=True),
    ),
    # OLMoE: q/k RMSNorm over the whole projection; experts sized by intermediate_size; every layer sparse.
    "olmoe": FamilySpec(
        "olmoe",
        "OlmoeForCausalLM",
        qk_norm=True,
        qk_norm_scope="proj",
        moe=MoESpec(expert_size_key="intermediate_size"),
    ),
    # Mixtral: softmax, top-k, always renormalised, weights kept fp32; Mistral's sliding window; hub layout
    # block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down).
    "mixtral": FamilySpec(
        "mixtral",
        "MixtralForCausalLM",
        qkv_bias=False,
        o_bias=False,
        sliding="all",
        moe=MoESpec(
            experts_key="num_local_experts",
            expert_size_key="intermediate_size",
            topk_norm="always",
            weights_fp32=True,
            checkpoint_prefix="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        ),
    ),
}


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def get_family(model_type: str) -> FamilySpec:
    """The family for an HF ``model_type``; a clear ``UserError`` listing the supported ones otherwise."""
    spec = FAMILIES.get(model_type)
    if spec is None:
        raise UserError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())} "
            "(Qwen2.5 checkpoints use 'qwen2'). Use a checkpoint of one of these families."
        )
    return spec
