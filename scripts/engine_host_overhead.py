"""Host time of one rollout-engine decode step at batch 512, without the model: the scheduler, the step inputs,
the sampler call (its CPU reference on a 64-token vocabulary) and the stop checks, i.e. the per-step work the
device waits for. The model's forward is replaced by zero logits (``runner.execute``), so only host code runs.

    .venv/bin/python scripts/engine_host_overhead.py          # prints ms per decode step (4 per launch)
    .venv/bin/python scripts/engine_host_overhead.py --decode-steps=1 --profile

Measures; asserts nothing. Numbers in docs/performance.md (Rollout).
"""

from __future__ import annotations

import sys
import time

import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.infer.batch import host_arrays
from polyrl.infer.model_runner import DecodeBuffers
from polyrl.models import ModelConfig, build_model


def main() -> None:
    torch.set_num_threads(1)
    steps = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--decode-steps=")), "4"))
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=1024)  # fmt: skip
    ecfg = RolloutConfig(num_blocks=512 * 40, max_num_seqs=512, max_model_len=640, max_num_batched_tokens=65536,
                        overlap_decode=True, decode_steps=steps)  # fmt: skip
    llm = LLM(build_model(cfg, seed=0), None, ecfg)

    def execute(sched, feed=None):  # host part of building the inputs, then zero logits
        host_arrays(sched.items, llm.runner.cfg.block_size)
        n = sum(1 for it in sched.items if it.sample)
        z = torch.zeros(n, dtype=torch.int64)
        llm.runner.last_decode = DecodeBuffers(  # the device-side advance between queued steps, on zeros
            z.clone(), z.clone(), z.clone(), z.int(), torch.zeros(n, 48, dtype=torch.int32),
            lambda: torch.zeros(n, cfg.vocab_size),
        )  # fmt: skip
        return torch.zeros(n, cfg.vocab_size)

    llm.runner.execute = execute
    params = [SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True, seed=i, n=8) for i in range(64)]
    prompts = [[2 + i % 50] * 64 for i in range(64)]
    profile = "--profile" in sys.argv
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    print(f"host ms per decode step at batch 512, {steps} decode step(s) per launch: {dt / 257 * 1e3:.2f}")
    if profile:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
