"""The LoRA / QLoRA configs of ``polyrl bench sft --lora SPEC [--qlora]``: polyrl and HF + peft (+ Liger) in one run.

- ``polyrl-lora`` / ``polyrl-qlora``: ``TrainEngine`` over a ``DecoderLM`` whose base is frozen in the compute dtype
  (bf16 on accelerators; NF4 under ``--qlora``) with adapters from ``--lora`` (fp32 masters, bf16 compute).
- ``hf-peft`` / ``hf-peft-liger``: ``AutoModelForCausalLM`` in bf16 (sdpa; fp32 on the CPU, like polyrl there) +
  ``peft.get_peft_model`` with the same r / alpha / dropout / targets (peft keeps adapters in fp32), bf16 autocast,
  torch AdamW over the adapters: what a TRL ``SFTTrainer(peft_config=..., bf16=True)`` run does. Liger patches the
  model when importable.
- ``hf-qlora``: the same on a 4-bit NF4 base through bitsandbytes (``BitsAndBytesConfig``, bf16 compute; the
  random weights are saved to a temporary folder first, since transformers quantizes only in ``from_pretrained``);
  skipped with the reason when bitsandbytes is not importable.

``--activation-checkpointing`` applies to polyrl and, for these configs, to the HF models too (peft's usual
``gradient_checkpointing_enable``). Peak memory of these configs is measured from after construction (model resident
+ training steps); loading transients are excluded, e.g. the bf16 weights a 4-bit base is quantized from (16.4 GB
at the 8b shape; ``polyrl train --qlora`` holds them briefly while loading).
Not here: timing and reporting (``sft.py``, which imports this module; helpers both use are in ``common.py``).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

from polyrl.bench.common import decoder_options, enable_hf_checkpointing, free_memory
from polyrl.data import TokenizedSeq, pack_sequences
from polyrl.models.checkpoint import save_model
from polyrl.models.decoder import build_model
from polyrl.models.lora import apply_lora, make_lora_config
from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine
from polyrl.train.precision import resolve_compute_dtype

LORA_CONFIGS = ("hf-peft", "hf-peft-liger", "hf-qlora")


def lora_config(args: argparse.Namespace) -> Any:
    cfg = make_lora_config(args.lora or "")
    if args.qlora:
        cfg.quantize_base = "nf4"
    return cfg


def config_names(args: argparse.Namespace) -> list[str]:
    """polyrl's LoRA config and the matching baselines (``--baselines`` hf -> hf-peft, hf-liger -> hf-peft-liger)."""
    names = [] if args.no_ours else ["polyrl-qlora" if args.qlora else "polyrl-lora"]
    precision = getattr(args, "precision", "bf16")
    if names and not args.qlora and precision != "bf16":  # --precision fp8 / both: LoRA on FP8 base GEMMs
        names = ["polyrl-lora-fp8"] if precision == "fp8" else ["polyrl-lora", "polyrl-lora-fp8"]
    wanted = {b.strip() for b in args.baselines.split(",")}
    if args.qlora:
        return names + (["hf-qlora"] if "hf" in wanted else [])
    names += ["hf-peft"] if "hf" in wanted else []
    return names + (["hf-peft-liger"] if "hf-liger" in wanted else [])


def ours_step_fn(
    cfg: Any,
    tokens: torch.Tensor,
    args: argparse.Namespace,
    dev: torch.device,
    cuda_graphs: bool | None = None,
    fp8: bool = False,
) -> Any:
    dtype = resolve_compute_dtype(PrecisionConfig(), dev.type)
    base = build_model(cfg, dtype=dtype, device=dev, seed=args.seed, options=decoder_options(args.decoder_options))
    model = apply_lora(base, lora_config(args), seed=args.seed)
    ecfg = StepConfig(
        micro_batch_tokens=tokens.numel(),
        activation_checkpointing=args.activation_checkpointing,
        checkpoint_layers=args.checkpoint_layers,
        compile=args.compile,
        seed=args.seed,
        cuda_graphs=cuda_graphs,
    )
    scaling = getattr(args, "fp8_scaling", "tensorwise")
    precision = PrecisionConfig(linear="fp8" if fp8 else "default", fp8_scaling=scaling)
    engine = TrainEngine(model, OptimConfig(lr=args.lr), ScheduleConfig(decay="constant"), precision, engine=ecfg)
    seqs = [TokenizedSeq(row.tolist(), [1] * row.numel()) for row in tokens]
    batch = pack_sequences(seqs).to(dev)
    _settled()
    return lambda: engine.step([batch]).loss


def _settled() -> None:
    """Free construction temporaries (the bf16 copy a 4-bit base is made from, the weights HF copied from) and
    restart the peak counter, so every LoRA config reports its resident model + training step, not its loading."""
    free_memory()


def unavailable(name: str) -> str | None:
    """Why config ``name`` cannot run here (a missing package), or None."""
    needs = {"hf-peft": ["peft"], "hf-peft-liger": ["peft", "liger_kernel.transformers"], "hf-qlora": ["peft"]}
    needs["hf-qlora"].append("bitsandbytes")
    for mod in needs.get(name, []):
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
            return f"{mod} not importable ({type(exc).__name__})"
    return None


def _hf_model(cfg: Any, args: argparse.Namespace, dev: torch.device, qlora: bool) -> Any:
    # lazy: transformers is an optional baseline, imported only when an HF config runs
    import transformers

    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16  # as polyrl's base (fp32 compute on the CPU)
    ours = build_model(cfg, dtype=dtype, device=dev, seed=args.seed)  # the same initial weights
    if not qlora:
        hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
        with torch.device(dev):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
        model.load_state_dict(ours.state_dict(), strict=False)
        del ours
        if cfg.tie_word_embeddings:
            model.tie_weights()
        return model
    with tempfile.TemporaryDirectory(prefix="polyrl-bench-qlora-") as tmp:
        save_model(ours, tmp)
        del ours
        quant = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=quant, attn_implementation="sdpa", dtype=torch.bfloat16, device_map={"": dev}
        )


def hf_step_fn(cfg: Any, tokens: torch.Tensor, args: argparse.Namespace, dev: torch.device, name: str) -> Any:
    # lazy: peft is an optional baseline, imported only when its config runs (``unavailable`` says when it cannot)
    import peft

    lcfg = lora_config(args)
    model = _hf_model(cfg, args, dev, qlora=name == "hf-qlora")
    if "liger" in name:
        # lazy: Liger-Kernel is optional, imported only for the -liger config
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{cfg.model_type}")(model=model)
    if args.activation_checkpointing:
        enable_hf_checkpointing(model)
        model.enable_input_require_grads()
    pcfg = peft.LoraConfig(
        r=lcfg.r,
        lora_alpha=lcfg.alpha,
        lora_dropout=lcfg.dropout,
        target_modules=list(lcfg.targets),
        target_parameters=list(lcfg.target_parameters) or None,
        use_rslora=lcfg.rslora,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, pcfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=dev.type != "cpu")
    ids = tokens.to(dev)
    _settled()

    def step() -> float:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type != "cpu"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return lambda: float(step())
