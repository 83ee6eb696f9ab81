"""RL rollouts with LoRA, both ways the colocated engine can run them, at a model shape (random weights):

- ``base``: adapters off (the cost floor);
- ``unmerged``: base + adapter in every linear (two rank-r matmuls more per layer and token; no weight change);
- ``merged``: ``merged(model)`` around the rollout (W += s * B @ A in place with a backup, restored bit for bit
  after; the merge + restore time is included and printed apart).

    .venv/bin/python scripts/lora_rollout_modes.py --shape qwen3-1.7b-shape --prompts 256 --max-tokens 256
    .venv/bin/python scripts/lora_rollout_modes.py --shape tiny --prompts 16 --max-tokens 32    # CPU smoke

Greedy decoding with ``ignore_eos``, so every mode generates the same number of tokens. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models import build_model, preset_config
from polyrl.models.lora import LoraConfig, adapter_parameters, adapters_disabled, apply_lora, merged
from polyrl.platform import device


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-1.7b-shape")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lora", default="r=16,alpha=32")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    dev = device.torch_device()
    dtype = torch.bfloat16 if dev.type != "cpu" else torch.float32
    cfg = preset_config(args.shape)
    from polyrl.models.lora import make_lora_config

    lcfg: LoraConfig = make_lora_config(args.lora)
    model = apply_lora(build_model(cfg, dtype=dtype, device=dev, seed=0), lcfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in adapter_parameters(model).values():
            t.copy_((0.02 * torch.randn(t.shape, generator=g)).to(t.device, t.dtype))
    for t in adapter_parameters(model).values():
        t.data = t.data.to(dtype)
    prompts = [torch.randint(10, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    rollout = RolloutConfig(max_num_seqs=args.prompts, max_model_len=args.prompt_len + args.max_tokens + 1)
    llm = LLM(model, None, rollout)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"{args.shape} {dtype} on {dev}: {args.prompts} prompts x {args.prompt_len} tokens -> {args.max_tokens} new, "
          f"LoRA r={lcfg.r} on {', '.join(lcfg.targets)}")  # fmt: skip
    modes = {
        "base": lambda: adapters_disabled(model),
        "unmerged": contextlib.nullcontext,
        "merged": lambda: merged(model),
    }
    for name, ctx in modes.items():
        best, merge_s = float("inf"), 0.0
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            device.synchronize()
            t0 = time.perf_counter()
            with ctx():
                device.synchronize()
                t1 = time.perf_counter()
                outs = llm.generate(prompts, params)
                device.synchronize()
                t2 = time.perf_counter()
            device.synchronize()
            t3 = time.perf_counter()
            if t3 - t0 < best:
                best, merge_s = t3 - t0, (t1 - t0) + (t3 - t2)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"  {name:9} {n / best:12,.0f} tokens/s  ({best:.2f}s, merge + restore {merge_s * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
