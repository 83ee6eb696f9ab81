"""Model parity and speed against transformers at a real shape: ``python -m polyrl.bench.model_parity``.

1. Logits parity in bf16: our ``DecoderLM`` and ``transformers`` (sdpa) with the same random weights, both
   compared with an fp32 transformers run of those weights; max abs error and relative L2 of logits and
   log-probs. Our bf16 error should be of the size of transformers' own bf16 error.
2. Forward + backward tokens/s (and MFU, peak memory) at ``--seq`` (default 4096): ours with the fused
   linear-cross-entropy kernel, ours with full logits + cross-entropy, and ``transformers`` (sdpa, its
   own loss). Pure bf16 weights, no optimizer step.

It prints the kernel implementation chosen per op so the numbers can be read. It does not write a
report or compare with other engines (``polyrl bench sft`` does that).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from polyrl import kernels
from polyrl.models import AttnMetadata, DecoderLM, build_model, preset_config
from polyrl.platform import device

_OPS = ("rmsnorm", "rope", "swiglu", "attention", "linear_cross_entropy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="qwen3-0.6b-shape", help="model shape (a polyrl init-model preset)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length for the speed test")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step for the speed test")
    parser.add_argument("--parity-seq", type=int, default=1024, help="sequence length for the parity test")
    parser.add_argument("--parity-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing in both models")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--seed", type=int, default=0)


def _hf_model(cfg, dtype: torch.dtype, dev: torch.device, attn: str = "sdpa"):
    # lazy: transformers is an optional dependency, imported only when the comparison runs
    import transformers

    hcfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    with dev:
        model = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation=attn, dtype=dtype)
    return model.to(dev)


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (got.float() - ref.float()).flatten()
    return diff.abs().max().item(), (diff.norm() / ref.float().flatten().norm()).item()


def parity(cfg, args, dev: torch.device) -> list[tuple[str, float, float, float, float]]:
    torch.manual_seed(args.seed)
    hf32 = _hf_model(cfg, torch.float32, dev, attn="eager").eval()
    # HF inits norms to 1 and biases to 0; perturb them so every tensor matters.
    with torch.no_grad():
        for name, p in hf32.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    state = {k: v.to(torch.bfloat16) for k, v in hf32.state_dict().items()}
    hf16 = _hf_model(cfg, torch.bfloat16, dev).eval()
    hf16.load_state_dict(state)
    ours = build_model(cfg, dtype=torch.bfloat16, device=dev, init=False).eval()
    ours.load_state_dict(state, strict=not cfg.tie_word_embeddings)

    b, s = args.parity_batch, args.parity_seq
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=dev)
    with torch.no_grad():
        ref = hf32(ids).logits.float().reshape(b * s, -1)
        hf_bf16 = hf16(ids).logits.float().reshape(b * s, -1)
        meta = AttnMetadata.from_seqlens([s] * b, dev)
        pos = torch.arange(s, device=dev).repeat(b)
        our_bf16 = ours.compute_logits(ours(ids.flatten(), pos, meta))
    rows = []
    ref_lp = torch.log_softmax(ref, -1)
    for name, got in (("transformers bf16 (sdpa)", hf_bf16), ("polyrl bf16", our_bf16)):
        rows.append((name, *_errors(got, ref), *_errors(torch.log_softmax(got, -1), ref_lp)))
    rows.append(
        (
            "polyrl vs transformers, both bf16",
            *_errors(our_bf16, hf_bf16),
            *_errors(torch.log_softmax(our_bf16, -1), torch.log_softmax(hf_bf16, -1)),
        )
    )
    del hf32, hf16, ours
    device.empty_cache()
    return rows


def _time(step: Callable[[], None], steps: int) -> tuple[float, int]:
    for _ in range(2):
        step()
    device.synchronize()
    device.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    device.synchronize()
    return (time.perf_counter() - start) / steps, device.max_memory_allocated()


def _inputs(cfg, args, dev: torch.device) -> dict[str, torch.Tensor]:
    b, s = args.batch, args.seq
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=dev)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100, device=dev)], dim=1)
    return {
        "ids": ids,
        "flat_ids": ids.flatten(),
        "labels": labels.flatten(),
        "pos": torch.arange(s, device=dev).repeat(b),
    }


def _speed_ours(cfg, args, dev: torch.device, x: dict[str, torch.Tensor]) -> list[tuple[str, float, int]]:
    ours: DecoderLM = build_model(cfg, dtype=torch.bfloat16, device=dev, seed=args.seed).train()
    ours.gradient_checkpointing = args.grad_ckpt
    meta = AttnMetadata.from_seqlens([args.seq] * args.batch, dev)

    def fused():
        hidden = ours(x["flat_ids"], x["pos"], meta)
        kernels.linear_cross_entropy(hidden, ours.lm_head_weight, x["labels"], reduction="mean").backward()
        ours.zero_grad(set_to_none=True)

    def full_logits():
        logits = ours.compute_logits(ours(x["flat_ids"], x["pos"], meta))
        F.cross_entropy(logits, x["labels"], ignore_index=-100).backward()
        ours.zero_grad(set_to_none=True)

    return [
        (name, *_time(fn, args.steps))
        for name, fn in (("polyrl, fused linear-CE", fused), ("polyrl, logits + CE", full_logits))
    ]


def _speed_hf(cfg, args, dev: torch.device, x: dict[str, torch.Tensor]) -> list[tuple[str, float, int]]:
    hf = _hf_model(cfg, torch.bfloat16, dev).train()
    if args.grad_ckpt:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step():
        hf(input_ids=x["ids"], labels=x["ids"]).loss.backward()  # HF shifts labels itself
        hf.zero_grad(set_to_none=True)

    return [(f"transformers {cfg.family.architecture} (sdpa)", *_time(step, args.steps))]


def speed(cfg, args, dev: torch.device) -> list[tuple[str, float, float | None, float]]:
    """(name, tokens/s, MFU or None, peak GiB) per contender."""
    x = _inputs(cfg, args, dev)
    with torch.device("meta"):
        flops = DecoderLM(cfg).flops_per_token(args.seq)
    peak = device.peak_bf16_flops()
    timed = _speed_ours(cfg, args, dev, x)
    device.empty_cache()
    timed += _speed_hf(cfg, args, dev, x)
    tokens = args.batch * args.seq
    return [
        (name, tokens / sec, tokens / sec * flops / peak if peak else None, mem / 2**30) for name, sec, mem in timed
    ]


def run(args: argparse.Namespace) -> int:
    dev = device.torch_device()
    cfg = preset_config(args.preset)
    print(
        f"device: {device.name() if device.is_accelerator() else 'cpu'}; torch {torch.__version__}; "
        f"preset {args.preset}: hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}"
    )
    dt = "bfloat16"
    chosen = ", ".join(f"{op}={kernels.registry.select(op, dev.type, dt)[0]}" for op in _OPS)
    print(f"kernels ({dev.type}/{dt}): {chosen}")

    print(f"\nlogits parity vs transformers fp32 (eager), {args.parity_batch} x {args.parity_seq} tokens")
    print(f"| {'model':38s} | logits max abs | logits rel L2 | logprobs max abs | logprobs rel L2 |")
    print(f"|{'-' * 40}|----------------|---------------|------------------|-----------------|")
    for name, la, lr, pa, pr in parity(cfg, args, dev):
        print(f"| {name:38s} | {la:14.4g} | {lr:13.4g} | {pa:16.4g} | {pr:15.4g} |")

    if not args.skip_speed:
        ckpt = ", activation checkpointing" if args.grad_ckpt else ""
        print(f"\nforward + backward, bf16 weights, {args.batch} x {args.seq} tokens{ckpt}")
        print(f"| {'model':38s} | tokens/s | MFU    | peak GiB |")
        print(f"|{'-' * 40}|----------|--------|----------|")
        rows = speed(cfg, args, dev)
        for name, tps, mfu, mem in rows:
            mfu_s = f"{100 * mfu:5.1f}%" if mfu is not None else "   n/a"
            print(f"| {name:38s} | {tps:8.0f} | {mfu_s} | {mem:8.1f} |")
        print(f"ratio polyrl fused / transformers: {rows[0][1] / rows[-1][1]:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polyrl.bench.model_parity", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
