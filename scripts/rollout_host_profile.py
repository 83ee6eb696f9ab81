"""Where a rollout's wall time goes on the GPU machine: one ``LLM.generate`` at a large batch under cProfile, with
the time the host spends waiting for the device (``InflightStep.read``) reported apart. Waiting a lot means the
device is the bound; waiting little means the host is, and the profile says where.

    python3 scripts/rollout_host_profile.py [--batch 512] [--gen-len 256] [--decode-steps 4]

Random qwen3-0.6b-shaped weights. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams, overlap
from polyrl.models.decoder import build_model
from polyrl.models.presets import preset_config
from polyrl.platform import device


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=4)
    args = ap.parse_args()
    dev = device.torch_device()
    model = build_model(preset_config("qwen3-0.6b-shape"), dtype=torch.bfloat16, device=dev, seed=0).eval()
    cfg = RolloutConfig(max_num_seqs=args.batch, max_model_len=args.prompt_len + args.gen_len + 8,
                       max_num_blocks=args.batch * 64, decode_steps=args.decode_steps)  # fmt: skip
    llm = LLM(model, None, cfg)
    llm.capture_graphs(args.batch)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 150000, (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.gen_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    waited = [0.0]
    read = overlap.InflightStep.read

    def timed_read(self):
        t = time.perf_counter()
        out = read(self)
        waited[0] += time.perf_counter() - t
        return out

    overlap.InflightStep.read = timed_read
    llm.reset_prefix_cache()
    prof = cProfile.Profile()
    device.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params)
    prof.disable()
    device.synchronize()
    wall = time.perf_counter() - t0
    print(f"batch {args.batch}, {args.gen_len} tokens, {args.decode_steps} step(s)/launch: wall {wall:.2f}s = "
          f"{1e3 * wall / args.gen_len:.2f} ms per decode step; host waited for the device {waited[0]:.2f}s "
          f"({waited[0] / wall:.0%}) inside InflightStep.read")  # fmt: skip
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
