"""``polyrl bench sft``: SFT step throughput of polyrl's engine and of HF transformers (+ Liger), in one run.

Every config trains the same model shape, from the same initial weights, on the same random tokens
(``--batch`` sequences of ``--seq`` tokens; polyrl packs them into one varlen micro-batch, HF gets the
``[batch, seq]`` tensor), a full step each: forward, backward, grad-norm clip at 1.0, AdamW. Configs:

- ``polyrl``: ``TrainEngine`` with its default numerics (bf16 compute, fp32 masters and moments on
  accelerators; fp32 on the CPU), fused kernels chosen by the registry.
- ``hf-autocast`` / ``hf-bf16``: ``AutoModelForCausalLM`` (sdpa attention) + torch AdamW (fused on
  accelerators), fp32 weights under bf16 autocast (our numerics) / pure bf16 weights.
- ``hf-liger-autocast`` / ``hf-liger-bf16``: the same with Liger-Kernel applied to the model instance,
  when ``liger_kernel`` is importable (skipped otherwise). Liger patches transformers globally, so
  these run last.
- ``polyrl-fp8`` (``--precision fp8`` or ``both``; ``polyrl-lora-fp8`` with ``--lora``): our engine with
  ``precision.linear = "fp8"`` (the decoder's projections in FP8, ``--fp8-scaling``; LoRA: the frozen base's GEMMs);
  ``torchao-fp8-bf16`` / ``torchao-fp8-compile-bf16`` (baseline ``torchao-fp8``): the pure-bf16 HF model with
  torchao's ``convert_to_float8_training`` (tensor-wise, its default recipe; every linear but the lm_head, as ours),
  eager and under ``torch.compile`` (the setting torchao documents for speed: its casts fuse into the surrounding
  kernels), torch AdamW.

Configs run sequentially in this process; memory is freed and the peak counter reset in between;
``--warmup`` steps are not timed. Reports tokens/s, MFU (6N + causal attention FLOPs per token, as
``DecoderLM.flops_per_token``, over ``device.peak_bf16_flops``), peak memory, the last loss (same weights
and tokens, so losses should agree) and ratios vs the fastest baseline. An out-of-memory config is
reported as such. This module does not check targets; the numbers go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from polyrl.bench import sft_lora
from polyrl.bench.common import (
    add_decoder_options,
    decoder_options,
    enable_hf_checkpointing,
    free_memory,
    hf_moe_kwargs,
    shape_preset,
)
from polyrl.bench.profile import kernel_table, print_kernel_table
from polyrl.data import TokenizedSeq, pack_sequences
from polyrl.errors import ConfigError
from polyrl.models.decoder import DecoderLM, build_model
from polyrl.models.presets import preset_config
from polyrl.platform import device
from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine
from polyrl.train.precision import check_fp8_supported

SHAPES = {
    "tiny": "tiny",
    "small": "small",
    "qwen3-0.6b": "qwen3-0.6b-shape",
    "qwen3-1.7b": "qwen3-1.7b-shape",
    "qwen3-8b": "qwen3-8b-shape",
    "llama3.2-1b": "llama3.2-1b-shape",
    "tiny-moe": "tiny-moe",
    "qwen3-30b-a3b": "qwen3-30b-a3b",  # MoE; with -LN (qwen3-30b-a3b-L8) the first N layers
}
BASELINES = {
    "hf": ("hf-autocast", "hf-bf16"),
    "hf-liger": ("hf-liger-autocast", "hf-liger-bf16"),
    # MoE shapes: transformers' per-expert loop (experts_implementation="eager") next to its grouped_mm default
    "hf-eager-experts": ("hf-eager-experts-autocast", "hf-eager-experts-bf16"),
    # HF + bitsandbytes' 8-bit AdamW (docs/optim8.md), next to polyrl --optim adamw8bit
    "hf-bnb8bit": ("hf-bnb8bit-autocast", "hf-bnb8bit-bf16"),
    # torchao float8 training (pinned torchao==0.18.0, pyproject's bench extra) on the pure-bf16 HF model
    "torchao-fp8": ("torchao-fp8-bf16", "torchao-fp8-compile-bf16"),
}
PRECISIONS = {"bf16": ("polyrl",), "fp8": ("polyrl-fp8",), "both": ("polyrl", "polyrl-fp8")}
GIB = 1024**3


@dataclass
class Result:
    name: str
    status: str  # ok | oom | skipped: reason
    tokens_per_s: float | None = None
    step_s: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    loss: float | None = None
    profile: dict | None = None  # polyrl with --profile: bench.profile.kernel_table of one step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape",
        default="qwen3-0.6b",
        help=f"model shape (random weights): {', '.join(SHAPES)}; a -LN suffix keeps the first N layers",
    )
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per config")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (polyrl with CUDA graphs: at least 2, the capture)"
    )
    parser.add_argument(
        "--baselines", default="hf,hf-liger", help=f"comma list of {', '.join(BASELINES)}; 'none' for polyrl only"
    )
    parser.add_argument("--numerics", choices=["both", "autocast", "bf16"], default="both", help="HF variants to run")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute activations (polyrl and the HF baselines)"
    )
    parser.add_argument(
        "--checkpoint-layers",
        type=int,
        metavar="N",
        help="polyrl, with --activation-checkpointing: recompute only the first N layers (engine.checkpoint_layers)",
    )
    parser.add_argument(
        "--master-dtype",
        choices=["fp32", "none"],
        default="fp32",
        help="polyrl full SFT (optim.master_dtype): fp32 master weights and moments, or none (pure bf16 weights and "
        "moments, the numerics of the HF pure-bf16 baselines; what fits a full 8b step on one 141 GB GPU)",
    )
    parser.add_argument(
        "--optim", choices=["adamw", "adamw8bit"], default="adamw", help="polyrl full SFT: optim.name (docs/optim8.md)"
    )
    parser.add_argument(
        "--optim-offload", choices=["none", "cpu"], default="none", help="polyrl full SFT: optim.offload"
    )
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="bf16",
        help="polyrl rows: bf16 (the compute dtype), fp8 (precision.linear = 'fp8': the decoder projections' GEMMs in "
        "FP8), or both",
    )
    parser.add_argument(
        "--fp8-scaling", choices=["tensorwise", "rowwise"], default="tensorwise", help="polyrl-fp8's forward scaling"
    )
    parser.add_argument("--compile", action="store_true", help="polyrl: torch.compile the decoder layers")
    parser.add_argument("--no-ours", action="store_true", help="run the baselines only")
    parser.add_argument(
        "--cuda-graphs",
        choices=["auto", "off", "both"],
        default="auto",
        help="polyrl: replay the step as a CUDA graph (engine.cuda_graphs); both: also a '<config>-eager' row",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="after timing, profile one polyrl step: top N kernels"
    )
    parser.add_argument(
        "--profile-baselines", action="store_true", help="with --profile: profile one step of every baseline too"
    )
    parser.add_argument(
        "--lora",
        nargs="?",
        const="",
        metavar="SPEC",
        help="LoRA configs instead (polyrl-lora vs hf-peft[-liger]), e.g. --lora r=16,alpha=32 (sft_lora.py)",
    )
    parser.add_argument("--qlora", action="store_true", help="QLoRA: NF4 base (polyrl-qlora vs hf-qlora)")
    add_decoder_options(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--seed", type=int, default=0)


# ---- shared setup -------------------------------------------------------------------------------
def model_config(shape: str) -> Any:
    return preset_config(shape_preset(shape, SHAPES))


def random_tokens(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """``[batch, seq]`` int64 tokens, identical for every config."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def initial_weights(cfg: Any, dev: torch.device, seed: int) -> Any:
    return build_model(cfg, dtype=torch.float32, device=dev, seed=seed)


def flops_per_token(cfg: Any, seq: int) -> float:
    """``DecoderLM.flops_per_token``: 6N + 6 * layers * seq * heads * head_dim, N with the (tied) LM head counted once
    (an MoE shape: the parameters one token's matmuls use)."""
    with torch.device("meta"):
        return DecoderLM(cfg).flops_per_token(seq)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def time_steps(step_fn: Any, warmup: int, steps: int) -> tuple[float, float]:
    """Seconds per timed step and the last loss; ``step_fn()`` returns the loss (a float)."""
    loss = float("nan")
    for _ in range(warmup):
        loss = step_fn()
    device.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step_fn()
    device.synchronize()
    return (time.perf_counter() - t0) / max(steps, 1), loss


# ---- the configs --------------------------------------------------------------------------------
def ours_step_fn(
    cfg: Any,
    tokens: torch.Tensor,
    args: argparse.Namespace,
    dev: torch.device,
    cuda_graphs: bool | None = None,
    fp8: bool = False,
) -> Any:
    model = initial_weights(cfg, dev, args.seed)
    model.options = decoder_options(args.decoder_options)
    ecfg = StepConfig(
        micro_batch_tokens=tokens.numel(),
        activation_checkpointing=args.activation_checkpointing,
        checkpoint_layers=args.checkpoint_layers,
        compile=args.compile,
        seed=args.seed,
        cuda_graphs=cuda_graphs,
    )
    engine = TrainEngine(
        model,
        OptimConfig(
            lr=args.lr,
            master_dtype=args.master_dtype,
            name=getattr(args, "optim", "adamw"),
            offload=getattr(args, "optim_offload", "none"),
        ),
        ScheduleConfig(decay="constant"),
        PrecisionConfig(linear="fp8" if fp8 else "default", fp8_scaling=getattr(args, "fp8_scaling", "tensorwise")),
        engine=ecfg,
        total_steps=None,
    )
    seqs = [TokenizedSeq(row.tolist(), [1] * row.numel()) for row in tokens]
    batch = pack_sequences(seqs).to(dev)
    return lambda: engine.step([batch]).loss


def hf_step_fn(cfg: Any, tokens: torch.Tensor, args: argparse.Namespace, dev: torch.device, variant: str) -> Any:
    """One HF training step closure; ``variant`` is e.g. "hf-liger-bf16"."""
    # lazy: transformers is an optional baseline, imported only when an HF config runs
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, attn_implementation="sdpa", **hf_moe_kwargs(cfg, variant)
        )
    ref = initial_weights(cfg, dev, args.seed)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    del ref
    if unexpected or any("rotary" not in m and m != "lm_head.weight" for m in missing):
        raise RuntimeError(f"HF model does not match polyrl's parameter names: {missing[:3]} {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if "liger" in variant:
        # lazy: Liger-Kernel is optional, imported only for the hf-liger configs (``liger_available`` says when not)
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{cfg.model_type}")(model=model)
    pure_bf16 = variant.endswith("bf16")
    if pure_bf16:
        model = model.to(torch.bfloat16)
    if args.activation_checkpointing:
        enable_hf_checkpointing(model)
    if variant.startswith("torchao-fp8"):
        model = torchao_float8(model, compile_model="compile" in variant)
    model.train()
    fused = dev.type != "cpu"
    if "bnb8bit" in variant:
        # lazy: bitsandbytes is an optional baseline (``bnb_available`` says when it is not importable)
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)
    ids = tokens.to(dev)
    autocast = not pure_bf16 and dev.type != "cpu"

    def step() -> float:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return lambda: float(step())


def torchao_float8(model: Any, compile_model: bool) -> Any:
    """torchao's float8 training on an HF model, as its README sets it up: ``convert_to_float8_training`` with the
    default (tensor-wise, dynamic) config on every ``nn.Linear`` except the lm_head and those whose dims are not
    multiples of 16 (``torch._scaled_mm``'s constraint), then ``torch.compile`` of the whole model when asked."""
    # lazy: torchao is an optional bench baseline (pinned in pyproject's bench extra)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        if fqn.endswith("lm_head") or not isinstance(module, torch.nn.Linear):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=keep)
    return torch.compile(model) if compile_model else model


def torchao_available() -> str | None:
    """None when torchao's float8 training imports and this device has FP8 GEMMs, else why not."""
    if not device.supports_fp8_gemm():
        return "this device has no FP8 GEMM (polyrl env: fp8 gemm)"
    try:
        # lazy: the point of this function is to try the optional import
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"torchao.float8 not importable ({type(exc).__name__}: {exc})"
    return None


def fp8_unavailable(dev: torch.device) -> str | None:
    """None when polyrl's FP8 training runs here (an FP8 GPU, or emulation forced by POLYRL_KERNELS), else why not."""
    try:
        check_fp8_supported(dev.type)
    except ConfigError as exc:
        return str(exc).split(";")[0]
    return None


def liger_available(model_type: str | None = None) -> str | None:
    """None when Liger-Kernel imports (and, given ``model_type``, patches that family), else why not."""
    try:
        # lazy: the point of this function is to try the optional import
        import liger_kernel.transformers as liger
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"liger_kernel not importable ({type(exc).__name__})"
    if model_type is not None and not hasattr(liger, f"apply_liger_kernel_to_{model_type}"):
        return f"this liger_kernel has no patch for {model_type}"
    return None


def bnb_available() -> str | None:
    """None when bitsandbytes imports, else why not (the hf-bnb8bit rows are then skipped)."""
    try:
        # lazy: the point of this function is to try the optional import
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"bitsandbytes not importable ({type(exc).__name__})"
    return None


def configs(args: argparse.Namespace) -> list[str]:
    if getattr(args, "lora", None) is not None or getattr(args, "qlora", False):
        configs_check = [b.strip() for b in args.baselines.split(",") if b.strip() and b.strip() != "none"]
        if any(b not in BASELINES for b in configs_check):
            raise ConfigError(f"unknown baseline(s) {configs_check}; choose from {', '.join(BASELINES)} or none")
        return _with_eager_rows(sft_lora.config_names(args), args)
    names = [] if args.no_ours else list(PRECISIONS[getattr(args, "precision", "bf16")])
    wanted = [b.strip() for b in args.baselines.split(",") if b.strip() and b.strip() != "none"]
    unknown = [b for b in wanted if b not in BASELINES]
    if unknown:
        raise ConfigError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)} or none")
    for b in wanted:
        for v in BASELINES[b]:
            if args.numerics == "both" or v.endswith(args.numerics):
                names.append(v)
    return _with_eager_rows(names, args)


EAGER_SUFFIX = "-eager"


def _with_eager_rows(names: list[str], args: argparse.Namespace) -> list[str]:
    """``--cuda-graphs both``: each polyrl config runs a second time with engine.cuda_graphs = False."""
    if getattr(args, "cuda_graphs", "auto") != "both":
        return names
    out = []
    for n in names:
        out.append(n)
        if n.startswith("polyrl"):
            out.append(n + EAGER_SUFFIX)
    return out


# The engine runs a new micro-batch shape eagerly once and captures it as a CUDA graph on its second step: timing that
# step would count the capture (run35: 8b full SFT timed after 1 warm-up step 7,889-8,280 tokens/s, after 2: 9,168).
GRAPH_WARMUP = 2


def warmup_steps(name: str, args: argparse.Namespace, dev: torch.device) -> int:
    """Untimed steps for config ``name``: ``--warmup``, and at least ``GRAPH_WARMUP`` for a polyrl config that may
    replay CUDA graphs on an accelerator, so the capture is never timed."""
    graphed = name.startswith("polyrl") and graphs_mode(name, args) is not False and dev.type != "cpu"
    return max(args.warmup, GRAPH_WARMUP) if graphed else args.warmup


def graphs_mode(name: str, args: argparse.Namespace) -> bool | None:
    """engine.cuda_graphs for config ``name``: False for the eager rows and ``--cuda-graphs off``, else auto."""
    if name.endswith(EAGER_SUFFIX) or getattr(args, "cuda_graphs", "auto") == "off":
        return False
    return None


def measure(name: str, cfg: Any, tokens: torch.Tensor, args: argparse.Namespace, dev: torch.device) -> Result:
    if name in sft_lora.LORA_CONFIGS and (why := sft_lora.unavailable(name)):
        return Result(name, f"skipped: {why}")
    if "liger" in name and (why := liger_available(cfg.model_type)):
        return Result(name, f"skipped: {why}")
    if "bnb8bit" in name and (why := bnb_available()):
        return Result(name, f"skipped: {why}")
    if "eager-experts" in name and not cfg.is_moe:
        return Result(name, "skipped: a dense shape has no experts")
    if name.startswith("torchao-fp8") and (why := torchao_available()):
        return Result(name, f"skipped: {why}")
    if name.startswith("polyrl") and "-fp8" in name and (why := fp8_unavailable(dev)):
        return Result(name, f"skipped: {why}")
    free_memory()
    step_fn = None
    try:
        base_name = name.removesuffix(EAGER_SUFFIX)
        if base_name in ("polyrl", "polyrl-fp8"):
            step_fn = ours_step_fn(cfg, tokens, args, dev, graphs_mode(name, args), fp8=base_name == "polyrl-fp8")
        elif base_name in ("polyrl-lora", "polyrl-qlora", "polyrl-lora-fp8"):
            fp8 = base_name == "polyrl-lora-fp8"
            step_fn = sft_lora.ours_step_fn(cfg, tokens, args, dev, graphs_mode(name, args), fp8=fp8)
        elif name in sft_lora.LORA_CONFIGS:
            step_fn = sft_lora.hf_step_fn(cfg, tokens, args, dev, name)
        else:
            step_fn = hf_step_fn(cfg, tokens, args, dev, name)
        step_s, loss = time_steps(step_fn, warmup_steps(name, args, dev), args.steps)
        table = None
        if _profiled(name, args) and dev.type != "cpu":
            table = kernel_table(step_fn, args.profile)
            print_kernel_table(table, f"{name} step profile")
    except Exception as exc:
        if not _is_oom(exc):
            raise
        step_fn = None
        free_memory()
        return Result(name, "oom")
    finally:
        step_fn = None
        peak = device.max_memory_allocated()
        free_memory()
    tps = tokens.numel() / step_s
    peak_flops = device.peak_bf16_flops()
    mfu = tps * flops_per_token(cfg, tokens.shape[1]) / peak_flops if peak_flops else None
    return Result(name, "ok", tps, step_s, mfu, peak / GIB if peak else None, loss, table)


def _profiled(name: str, args: argparse.Namespace) -> bool:
    """``--profile N`` profiles polyrl's configs; ``--profile-baselines`` adds every baseline."""
    if not getattr(args, "profile", 0):
        return False
    return name.startswith("polyrl") or bool(getattr(args, "profile_baselines", False))


# ---- report -------------------------------------------------------------------------------------
def ratios(results: list[Result], ours_name: str | None = None) -> dict[str, float]:
    """polyrl tokens/s (the first polyrl row, or the row ``ours_name``) divided by each measured baseline's, and by
    the fastest one's (key "fastest")."""
    ours = next(
        (r for r in results if r.name.startswith("polyrl") and r.status == "ok" and ours_name in (None, r.name)), None
    )
    base = [r for r in results if not r.name.startswith("polyrl") and r.status == "ok"]
    if ours is None or not base:
        return {}
    out = {r.name: ours.tokens_per_s / r.tokens_per_s for r in base}
    out["fastest"] = ours.tokens_per_s / max(r.tokens_per_s for r in base)
    return out


def _fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def print_table(results: list[Result], header: str) -> None:
    print(header)
    print(f"{'config':24} {'tokens/s':>10} {'step s':>8} {'MFU':>7} {'peak GiB':>9} {'loss':>8}  status")
    for r in results:
        print(
            f"{r.name:24} {_fmt(r.tokens_per_s, ',.0f'):>10} {_fmt(r.step_s, '.3f'):>8} "
            f"{_fmt(r.mfu, '.1f', 100) + ('%' if r.mfu is not None else ''):>7} "
            f"{_fmt(r.peak_memory_gib, '.1f'):>9} {_fmt(r.loss, '.4f'):>8}  {r.status}"
        )
    rs = ratios(results)
    if rs:
        fastest = rs.pop("fastest")
        print("polyrl tokens/s ratio: " + ", ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
        print(f"polyrl vs the fastest baseline: {fastest:.2f}x")
    first = next((r.name for r in results if r.name.startswith("polyrl") and r.status == "ok"), None)
    for r in results:  # further polyrl rows (polyrl-fp8 next to polyrl): their own ratios
        if r.name.startswith("polyrl") and r.status == "ok" and r.name != first and (more := ratios(results, r.name)):
            more.pop("fastest")
            ours_bf16 = next((x for x in results if x.name == first), None)
            vs_ours = f", {first} {r.tokens_per_s / ours_bf16.tokens_per_s:.2f}x" if ours_bf16 else ""
            print(f"{r.name} tokens/s ratio: " + ", ".join(f"{k} {v:.2f}x" for k, v in more.items()) + vs_ours)


def run(args: argparse.Namespace) -> int:
    if min(args.seq, args.batch, args.steps) < 1 or args.warmup < 0:
        raise ConfigError("--seq, --batch and --steps must be >= 1 and --warmup >= 0")
    names = configs(args)
    cfg = model_config(args.shape)
    if args.seq > cfg.max_position_embeddings:
        raise ConfigError(f"--seq {args.seq} exceeds the {args.shape} context ({cfg.max_position_embeddings})")
    dev = device.torch_device()
    tokens = random_tokens(cfg.vocab_size, args.batch, args.seq, args.seed)
    header = (
        f"bench sft: {args.shape} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}), "
        f"batch {args.batch} x seq {args.seq}, {args.steps} timed steps after {args.warmup} warm-up, "
        f"device {device.name() if dev.type != 'cpu' else 'cpu'}, torch {torch.__version__}"
    )
    if args.activation_checkpointing:
        header += ", activation checkpointing" + (
            "" if args.checkpoint_layers is None else f" (polyrl: the first {args.checkpoint_layers} layers)"
        )
    if getattr(args, "precision", "bf16") != "bf16":
        header += f", polyrl precision {args.precision} ({args.fp8_scaling} FP8 forward)"
    if args.master_dtype != "fp32" and not (args.lora is not None or args.qlora):
        header += f", polyrl optim.master_dtype={args.master_dtype}"
    if getattr(args, "optim", "adamw") != "adamw" or getattr(args, "optim_offload", "none") != "none":
        header += f", polyrl optim.name={args.optim} optim.offload={args.optim_offload}"
    print(header, flush=True)
    results = []
    for name in names:
        r = measure(name, cfg, tokens, args, dev)
        done = f"{r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s is not None else r.status
        print(f"  {name}: {done}", flush=True)
        results.append(r)
    print_table(results, header)
    if args.json:
        payload = {"header": header, "args": vars(args), "results": [asdict(r) for r in results]}
        payload["ratios"] = ratios(results)
        payload["ratios_by_config"] = {
            r.name: ratios(results, r.name) for r in results if r.name.startswith("polyrl") and r.status == "ok"
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)
    return 0
