"""Host time of a guided (structured-output) decode step, split by phase, on the CPU: no model, no device.

What a guided step costs the host at ``--batch`` rows, with the real llguidance matchers of ``BENCH_SCHEMA`` (the
``polyrl bench rollout --response-format json_schema`` schema) and the qwen3-0.6b preset's tokenizer (151,936
tokens, the vocabulary the bench masks), per step:

- ``read``: the step's tokens from a tensor to a host list (``tolist``, what ``GuidedDraws`` reads after its event);
- ``consume``: the matchers consuming them, as ``GuidedDraws`` feeds them from a launch's second step on:
  ``loop`` = one bound ``consume_token`` call per row from Python (holds the GIL; the path before this script's
  change, and the path with one grammar lane), ``par`` = ``GrammarCache.consume`` (one ``LLExecutor.consume_token_par``
  call over the rows in lane order: the GIL released, the lanes' lexers on the executor's threads);
- ``mask``: ``GrammarCache.fill_pairs`` into the persistent host buffer (one executor call);
- ``pick``: the "device" here (not host work on an accelerator): one allowed token per row drawn at random from its
  mask (numpy), so the matchers walk the states a random-weight model walks.

Also: the torch ops one guided draw dispatches (``Sampler.draw_planned`` with every row guided, counted by a dispatch
mode at a small batch: the count does not depend on it), each a kernel launch on CUDA, and the ops per step of
``GuidedDraws`` from a launch's second step on (the draw plus the token copy).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/structured_host_profile.py --batch 256 --steps 48 --lanes 1,2

Every lanes value runs the same token sequence (seeded), first-pass steps (new lexer states) and then a replay of the
same tokens after ``rollback`` (states built), each consume variant on its own copies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def _tokenizer():
    from polyrl.models.presets import get_preset, preset_config
    from polyrl.models.tokenizer import build_tokenizer

    cfg = preset_config("qwen3-0.6b-shape")
    spec = get_preset("qwen3-0.6b-shape")
    return build_tokenizer(cfg.vocab_size, trained_vocab=spec.trained_vocab, seed=0), cfg.vocab_size


def _pick(bitmask: np.ndarray, vocab: int, rng: np.random.Generator) -> list[int]:
    """One allowed token per row of an int32 bitmask (LSB first), uniformly at random."""
    out = []
    for row in bitmask:
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
        allowed = np.flatnonzero(bits)
        out.append(int(allowed[rng.integers(len(allowed))]))
    return out


def profile(cache, so, batch: int, steps: int, seed: int, variants: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per variant, per phase, the seconds of each step (first pass then replay)."""
    from polyrl.infer.structured import MaskBuffers

    guides = {v: [cache.guide(so) for _ in range(batch)] for v in variants}
    pairs = {v: cache.mask_pairs(g) for v, g in guides.items()}
    # the loop variant's feed list, as GuidedDraws builds it (row, guide, bound consume_token) in executor order
    feeds = {v: [(i, guides[v][i], m.consume_token) for m, i in pairs[v]] for v in variants}
    buf = MaskBuffers()
    cpu = torch.device("cpu")
    rng = np.random.default_rng(seed)
    out = {v: {k: [] for k in ("read", "consume", "mask")} for v in variants}
    tokens: list[list[int]] = []
    # the first pass draws the tokens (from the first variant's masks); every variant then consumes the same ones
    for t in range(2 * steps):
        replay = t >= steps
        if t == steps:
            for gs in guides.values():
                for g in gs:
                    g.matcher.rollback(steps)
                    g.consumed -= steps
        for v in variants:
            gs, ps = guides[v], pairs[v]
            if t % steps:  # feed the previous step's tokens (as GuidedDraws does from a launch's 2nd step on)
                dev_tokens = torch.tensor(tokens[(t % steps) - 1], dtype=torch.int64)
                t0 = time.perf_counter()
                toks = dev_tokens.tolist()
                t1 = time.perf_counter()
                if v == "loop" or (replay and v == "par"):  # replay: consumes after a rollback are not a step's
                    for b, g, consume in feeds[v]:
                        consume(toks[b])
                        g.consumed += 1
                else:
                    cache.consume(ps, toks)
                    for g in gs:
                        g.consumed += 1
                t2 = time.perf_counter()
                out[v]["read"].append(t1 - t0)
                out[v]["consume"].append(t2 - t1)
            host = buf.fill(cache, ps, cpu)
            out[v]["mask"].append(buf.last_s)
            if not replay and v == variants[0]:
                tokens.append(_pick(host.numpy(), cache.vocab_size, rng))
    return out


def count_draw_ops(cache, so, batch: int = 8) -> tuple[int, int]:
    """(torch ops of one fully guided ``Sampler.draw_planned``, ops of a ``GuidedDraws`` step >= 1 without its
    masks and consumes) on the CPU, at ``batch`` rows of the real vocabulary."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from polyrl.infer.sampler import Sampler
    from polyrl.infer.sampling_params import SamplingParams
    from polyrl.infer.sequence import Sequence

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured=so)
    seqs = []
    for i in range(batch):
        s = Sequence(i, f"r{i}", 0, [5, 6, 7], params, 0.0, False)
        s.guide = cache.guide(so)
        seqs.append(s)
    from polyrl import kernels

    sampler = Sampler()
    logits = torch.randn(batch, cache.vocab_size)
    plan = sampler.plan(seqs, logits.device)
    sampler.draw_planned(logits, plan, None, 0)  # first use: buffers, the plan's pairs
    with Count() as c:
        sampler.draw_planned(logits, plan, None, 1)
    # the same with the two kernels as one op each (on CUDA each is its Triton wrapper's launches, not torch ops)
    real = kernels.apply_token_bitmask, kernels.sample_tokens
    kernels.apply_token_bitmask = lambda x, m, r, t: (torch.empty_like(x), x.new_zeros(len(x)), x.new_zeros(len(x)))
    kernels.sample_tokens = lambda x, t, s, o, g: (torch.zeros(len(x), dtype=torch.int64), x.new_zeros(len(x)))
    try:
        with Count() as c2:
            sampler.draw_planned(logits, plan, None, 2)
    finally:
        kernels.apply_token_bitmask, kernels.sample_tokens = real
    return c.n, c2.n - 5  # minus the stubs' own 5 allocations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--lanes", default="1,2", help="grammar lanes values (comma-separated; 'auto' = the engine's rule)")
    ap.add_argument("--threads", type=int, default=None, help="executor threads (default: the process's CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from polyrl.bench.rollout import BENCH_SCHEMA
    from polyrl.infer.sampling_params import StructuredOutputs
    from polyrl.infer.structured import GrammarCache

    tok, vocab = _tokenizer()
    so = StructuredOutputs.json_schema(BENCH_SCHEMA)
    eos = [tok.eos_token_id]
    for lanes in args.lanes.split(","):
        n = None if lanes.strip() == "auto" else int(lanes)
        cache = GrammarCache(tok, vocab, eos, num_threads=args.threads, lanes=n)
        variants = ["loop", "par"] if hasattr(cache, "consume") else ["loop"]
        res = profile(cache, so, args.batch, args.steps, args.seed, variants)
        auto = " (auto)" if cache.auto else ""
        print(f"# B{args.batch}, vocab {vocab}, executor threads {cache.num_threads}, lanes {cache.lanes}{auto}; "
              "ms per step, median / mean (first pass; masks also: | replay)")  # fmt: skip
        for v in variants:
            for phase, xs in res[v].items():
                half = len(xs) // 2
                parts = []
                for seg in (xs[:half], xs[half:]) if phase == "mask" else (xs[:half],):
                    ms = [1e3 * x for x in seg]
                    parts.append(f"{statistics.median(ms):6.3f} / {statistics.mean(ms):6.3f}")
                print(f"  {v:<5} {phase:<8} " + "  |  ".join(parts))
    if hasattr(GrammarCache, "fill_pairs"):
        cache = GrammarCache(tok, vocab, eos, num_threads=args.threads, lanes=1)
        ops, outside = count_draw_ops(cache, so)
        print(f"# torch ops dispatched by one fully guided Sampler.draw_planned (step >= 1), CPU: {ops}; outside the "
              f"two kernels (each a launch on CUDA, besides the kernels' own): {outside}")  # fmt: skip


if __name__ == "__main__":
    main()
