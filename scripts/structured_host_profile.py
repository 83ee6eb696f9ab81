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


def engine_profile(
    batch: int, gen: int, steps: int, lanes: int | None, par: bool | None, split: bool = True
) -> dict[str, float]:
    """The engine's own guided decode on the CPU (``tiny`` preset: a 2,048-token vocabulary, so the forward and the
    draw are small), ``steps`` decode steps per guided launch: ms per guided step of each ``HostTimes`` part, and of
    the host work *between* launches (from one launch's ``execute_steps`` returning to the next one's call: reading
    and reporting outputs, the schedule, the inputs; on an accelerator the device idles through it, as a guided
    launch's last draw waits for its masks), with the launches' count."""
    from polyrl.bench.rollout import BENCH_SCHEMA
    from polyrl.infer import LLM, RolloutConfig, SamplingParams, StructuredOutputs, overlap
    from polyrl.models.decoder import build_model
    from polyrl.models.presets import get_preset, preset_config
    from polyrl.models.tokenizer import build_tokenizer

    cfg = preset_config("tiny")
    tok = build_tokenizer(cfg.vocab_size, trained_vocab=get_preset("tiny").trained_vocab, seed=0)
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), seed=0).eval()
    ecfg = RolloutConfig(max_num_seqs=batch, max_model_len=16 + gen + 1, overlap_decode=True, grammar_lanes=lanes)
    llm = LLM(model, tok, ecfg)
    cache = llm.grammar_cache()
    if par is not None:
        cache.par_consume = par
    between, marks = [], []
    real = llm.runner.execute_steps

    def spy(sched, feed, k, draw, rows=None):
        if marks:
            between.append(time.perf_counter() - marks[-1])
        out = real(sched, feed, k, draw, rows)
        marks.append(time.perf_counter())
        return out

    llm.runner.execute_steps = spy
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg.vocab_size, (batch, 16), generator=g).tolist()
    so = StructuredOutputs.json_schema(BENCH_SCHEMA)
    params = SamplingParams(temperature=1.0, max_tokens=gen, ignore_eos=True, structured=so, seed=1)
    was = overlap.GUIDED_LAUNCH_STEPS, overlap.SPLIT_READ
    overlap.GUIDED_LAUNCH_STEPS, overlap.SPLIT_READ = steps, split
    try:
        llm.generate(prompts[:8], params.clone(max_tokens=8))  # warm-up: the compilation, first calls
        cache.times.reset()
        between.clear(), marks.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        overlap.GUIDED_LAUNCH_STEPS, overlap.SPLIT_READ = was
    times = cache.times
    n = max(times.steps, 1)
    out = {k: v for k, v in times.ms_per_step().items()}
    out["between"] = 1e3 * sum(between) / n
    out["wall"] = 1e3 * wall / n
    out["launches"] = times.launches
    out["steps_per_launch"] = times.steps / max(times.launches, 1)
    out["par"] = cache.par_consume
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--lanes", default="1,2", help="grammar lanes values (comma-separated; 'auto' = the engine's rule)")
    ap.add_argument("--threads", type=int, default=None, help="executor threads (default: the process's CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine",
        default=None,
        help="also the engine's guided decode on the CPU (tiny preset), one run per 'steps:lanes:consume:read' "
        "value (comma-separated; consume = par|row, read = split|step0), e.g. 4:2:row:step0,8:2:par:split",
    )
    ap.add_argument("--engine-gen", type=int, default=48)
    args = ap.parse_args()
    if args.engine:
        print(f"# engine on the CPU (tiny preset), B{args.batch}, {args.engine_gen} tokens: ms per guided step")
        for spec in args.engine.split(","):
            k, lanes, consume, read = spec.split(":")
            r = engine_profile(args.batch, args.engine_gen, int(k), int(lanes), consume == "par", read == "split")
            parts = " ".join(f"{p} {r[p]:.3f}" for p in ("wait", "consume", "mask", "draw", "read", "launch"))
            print(f"  {spec:<10} wall {r['wall']:.3f}  between launches {r['between']:.3f}  {parts}  "
                  f"({r['launches']} launches, {r['steps_per_launch']:.2f} steps each)")  # fmt: skip
        if args.lanes == "none":
            return

    from polyrl.bench.rollout import BENCH_SCHEMA
    from polyrl.infer.sampling_params import StructuredOutputs
    from polyrl.infer.structured import GrammarCache

    tok, vocab = _tokenizer()
    so = StructuredOutputs.json_schema(BENCH_SCHEMA)
    eos = [tok.eos_token_id]
    for lanes in args.lanes.split(","):
        n = None if lanes.strip() == "auto" else int(lanes)
        cache = GrammarCache(tok, vocab, eos, num_threads=args.threads, lanes=n)
        variants = ["loop", "par"] if hasattr(cache, "consume") and cache.lanes > 1 else ["loop"]
        cache.par_consume = cache.lanes > 1  # the par variant also below GrammarCache's thread threshold
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
