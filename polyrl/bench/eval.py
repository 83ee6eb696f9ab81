"""``polyrl bench eval``: lm-eval-harness log-likelihood scoring through polyrl against lm-eval's ``hf`` backend, in
one run, on the same requests.

A random checkpoint of a preset shape (``--shape qwen3-0.6b``, written with its tokenizer to a temporary folder) and
a synthetic four-way multiple-choice task of ``--docs`` documents whose contexts are about ``--context-words`` words
(written as lm-eval task YAML + jsonl, no hub). For each backend it times the whole ``simple_evaluate`` and its
log-likelihood phase (the backend's ``loglikelihood`` call), and reports the harness's own time (start-up, task
building, tokenisation) as total - model load - log-likelihood phase:

- ``hf`` at each ``--hf-batch-sizes`` (lm-eval pads a batch and takes a full-vocabulary log-softmax per position);
- ``polyrl``: the in-process engine (``polyrl.eval.harness`` over ``infer/scoring.py``: every request in one
  batched scoring call, a document's choices sharing their context, only continuation rows through the LM head),
  after an untimed warm-up (``_warm_up``: two scoring shapes, the decode graphs, a short generation: the Triton
  kernels compile on first use). The phase runs twice (``repeat_s``: what is left of first-use cost shows as the
  difference) and its host breakdown is printed (tokenise, plan, index arrays, launch = host time queueing the
  forwards, wait = the device behind the host at the end, gather) with the tokens fed against one sequence per
  request. ``--profile DIR`` then runs it under cProfile and the torch profiler (files in DIR);
- ``serve`` (with ``--serve``): lm-eval's ``local-completions`` (``--serve-batch-size`` prompts per HTTP request,
  ``--serve-concurrent`` requests in flight, both printed) against ``polyrl serve``, by default in a process of its
  own (``--serve-mode process``, as a user runs it; ``thread``: in this process over the same engine);
- generation (``--gen-docs``, default 256): a generate-until task of the same contexts, greedy, ``--gen-tokens`` new
  tokens (a stop string that never occurs), through ``hf`` (at the last ``--hf-batch-sizes``) and the in-process
  engine (continuous batching): the generation phase is timed the same way, texts compared with hf's. Both
  generation rows get the same untimed warm-up (``_gen_warm_up``: as many documents of other contexts, 8 new tokens:
  the phase's shapes compile there) and run their phase twice under the same rule (``repeat_s``,
  ``repeat_speedup``: the steady state, first-use costs of either backend show as the difference). Each prints where
  its phase went: hf its ``model.generate`` calls (requests, decode steps, tokens computed, seconds inside
  ``model.generate`` against lm-eval's own host work); polyrl its engine calls, prompt and generated tokens, the
  engine's synchronous (prompt) steps and decode launches with their seconds, the first and slowest step (a
  compilation or a capture inside the phase shows there), the host time of the per-token stop checks, and any
  decode-graph capture inside the phase; both the tokens of their texts (equal when the texts are). ``--profile``
  profiles a repeat of the generation phase too.

``--fuse-projections`` builds the in-process engine (and a ``--serve-mode thread`` server, which shares it; a server
process builds its own, unfused) with q/k/v and gate/up fused into one GEMM each (``RolloutConfig.fuse_projections``);
the A/B is this bench with and without it (``scripts/gpu_stage.sh bench-fused-proj``).

Every row (hf included) runs its phase twice; the ratios are taken against hf's fastest run (the faster of first run
and repeat, over batch sizes): ``speedup_vs_best_hf`` for a row's first run, ``repeat_speedup`` for its repeat, and
``claimed_speedup``, the lower of the two, is the figure docs and issue notes quote. The harness's own time of the
first hf run is printed as a row of its own. Each row is printed as soon as it is
measured; a row that fails (e.g. ``--serve`` without lm-eval's API dependencies) is printed with its error and the
bench goes on.

It also times a prefill of the same prompts with and without prompt log-probs (the engine's extra cost of scoring:
every position, or only the continuation's), prefix caching off so that every run computes every token. Scoring
every position runs the LM head on every token: at the qwen3-0.6b shape the head is 2 x 1024 x 151936 = 0.31 GFLOP
a token against ~0.88 GFLOP for the body (``head_flop_share``: 35%), so that overhead is at least ~35% whatever the
implementation (the 15% target holds for lm-eval's requests, which score only the continuation); the printed line
carries that floor.
Per-document log-likelihoods of every backend are compared with the first ``hf`` run (max abs difference; in bf16
that run takes its log-softmax and sum in bf16, ~0.3 off an fp32 run where polyrl is ~0.007 off:
``docs/performance.md``). This
module measures; it asserts nothing. Needs the ``eval`` extra.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from polyrl.bench.common import print_table
from polyrl.bench.serve_process import scoring_metrics, start_server_for_bench
from polyrl.errors import UserError
from polyrl.platform import device

WORDS = "the a river mill cat house light stone green small quick blue old new north city road field tree sun".split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-0.6b", help="model preset (with or without the -shape suffix)")
    parser.add_argument("--docs", type=int, default=2000, help="multiple-choice documents (4 requests each)")
    parser.add_argument("--context-words", type=int, default=60, help="words per context (~90 tokens at 60)")
    parser.add_argument(
        "--hf-batch-sizes", default="64,256", help="comma-separated batch sizes of the hf backend ('' for no hf rows)"
    )
    parser.add_argument("--gen-docs", type=int, default=256, help="generation-task documents (0: no generation rows)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="new tokens per generation (greedy)")
    parser.add_argument("--serve", action="store_true", help="also time local-completions against polyrl serve")
    parser.add_argument("--serve-batch-size", type=int, default=64, help="local-completions: prompts per request")
    parser.add_argument("--serve-concurrent", type=int, default=8, help="local-completions: requests in flight")
    parser.add_argument(
        "--serve-mode",
        choices=["process", "thread"],
        default="process",
        help="polyrl serve as its own process (as users run it) or a thread of this one over the in-process engine",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    parser.add_argument(
        "--fuse-projections",
        action="store_true",
        help="the polyrl engine with q/k/v and gate/up fused into one GEMM each (RolloutConfig.fuse_projections); "
        "compare with a run without it",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="times every backend's phase is run again after its first run; the fastest repeat is the row's repeat_s "
        "(each backend's steady state where the host's speed varies between runs; all in repeat_all_s)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also profile a repeat of the in-process log-likelihood and generation phases: cProfile and torch "
        "profiler files in DIR",
    )


def write_task(root: Path, docs: int, words: int, seed: int = 0) -> str:
    """A synthetic 4-way multiple-choice task in ``root``; returns its name."""
    rng = random.Random(seed)
    rows = []
    for _ in range(docs):
        context = " ".join(rng.choice(WORDS) for _ in range(words))
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(4)]
        rows.append({"context": context, "choices": choices, "label": rng.randrange(4)})
    (root / "bench_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "bench_mc.yaml").write_text(
        "task: polyrl_bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f'    test: "{root / "bench_mc.jsonl"}"\ntest_split: test\noutput_type: multiple_choice\n'
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n"
    )
    return "polyrl_bench_mc"


def write_gen_task(root: Path, docs: int, words: int, new_tokens: int, seed: int = 1) -> str:
    """A synthetic generation task in ``root`` (greedy, ``new_tokens`` new tokens, a stop string that never occurs);
    returns its name."""
    rng = random.Random(seed)
    rows = [{"context": " ".join(rng.choice(WORDS) for _ in range(words)), "target": "x"} for _ in range(docs)]
    (root / "bench_gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "bench_gen.yaml").write_text(
        "task: polyrl_bench_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f'    test: "{root / "bench_gen.jsonl"}"\ntest_split: test\noutput_type: generate_until\n'
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        f'generation_kwargs:\n  until: ["<never-stop>"]\n  do_sample: false\n  max_gen_toks: {new_tokens}\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return "polyrl_bench_gen"


def _timed(
    lm: Any,
    box: dict[str, Any],
    method: str = "loglikelihood",
    repeat: bool = False,
    counts: dict | None = None,
    repeats: int = 1,
) -> None:
    """Make ``lm.<method>`` (``loglikelihood`` or ``generate_until``) add its wall time to ``box["phase_s"]``. With
    ``repeat`` the same requests run ``repeats`` more times, the fastest timed as ``box["repeat_s"]`` and every one
    kept in ``box["repeat_all_s"]`` (what is left of first-use costs shows as the difference; the fastest of several
    is each backend's steady state on a host whose speed varies between runs; a polyrl engine's prefix cache is reset
    before each, so a repeat recomputes what the first call computed), and the requests are kept in
    ``box["requests"]`` (``--profile``). A polyrl model's
    breakdown of the first call (``last_score_stats`` / ``last_generate_stats``) lands in ``box["breakdown"]``, with
    ``counts["read"]()`` (counters reset by ``counts["reset"]()`` before the call: ``_count_hf_generate``,
    ``_count_stop_checks``) merged in. A generation phase's texts are counted in tokens (``box["text_tokens"]``: the
    same count for both backends when their texts agree)."""
    inner = getattr(lm, method)

    def timed(requests, *a, **k):
        if counts is not None:
            counts["reset"]()
        _sync()
        t0 = time.perf_counter()
        out = inner(requests, *a, **k)
        _sync()
        box["phase_s"] = box.get("phase_s", 0.0) + time.perf_counter() - t0
        stats = getattr(lm, "last_score_stats" if method == "loglikelihood" else "last_generate_stats", None)
        if stats or counts is not None:
            box["breakdown"] = {**(stats or {}), **(counts["read"]() if counts is not None else {})}
        if method == "generate_until":
            box["text_tokens"] = sum(len(t) for t in lm.tokenizer(list(out), add_special_tokens=False)["input_ids"])
        if repeat:
            box["requests"] = requests
            engine = getattr(lm, "llm", None)
            times, same = [], True
            for _ in range(max(1, repeats)):
                if engine is not None:  # the first call's prompts must not come from the prefix cache (hf has none)
                    engine.reset_prefix_cache()
                _sync()
                t0 = time.perf_counter()
                again = inner(requests, *a, **k)
                _sync()
                times.append(time.perf_counter() - t0)
                same = same and again == out
            box["repeat_s"], box["repeat_all_s"], box["same_on_repeat"] = min(times), times, same
        return out

    setattr(lm, method, timed)


def _count_hf_generate(lm: Any) -> dict:
    """Counters around lm-eval ``HFLM._model_generate`` (one ``model.generate`` per batch of requests that share
    their ``gen_kwargs``): ``generate_calls``, ``generate_s`` (inside ``model.generate``, its stop-sequence criteria
    included; the rest of the phase is lm-eval's host work: tokenising, padding, decoding and cutting the texts),
    ``requests`` (rows), ``decode_steps`` (new positions, summed over calls) and ``computed_tokens`` (rows x new
    positions: what hf computed, finished rows included, as it pads them to the batch's longest)."""
    c: dict[str, float] = {}
    inner = lm._model_generate

    def reset() -> None:
        c.update(generate_calls=0, generate_s=0.0, requests=0, decode_steps=0, computed_tokens=0)

    def counted(context, *a, **k):
        _sync()
        t0 = time.perf_counter()
        out = inner(context, *a, **k)
        _sync()
        new = out.shape[1] - context.shape[1]
        c["generate_calls"] += 1
        c["generate_s"] += time.perf_counter() - t0
        c["requests"] += context.shape[0]
        c["decode_steps"] += new
        c["computed_tokens"] += context.shape[0] * new
        return out

    reset()
    lm._model_generate = counted
    return {"reset": reset, "read": lambda: dict(c)}


def _count_stop_checks() -> dict:
    """Host time in the engine's per-token stop checks (``infer.stopping.check_stop``: EOS, stop ids, the stop
    strings on the incrementally detokenised text), summed over a phase: ``stop_check_s``, ``stop_checks``. The
    engine calls it once per accepted token; the wrapper adds two clock reads per call (~0.1 us). ``restore`` puts
    the engine's own function back."""
    # lazy: the engine module whose global the wrapper replaces for this row
    import polyrl.infer.llm as engine_mod

    c: dict[str, float] = {}
    inner = engine_mod.check_stop
    clock = time.perf_counter

    def reset() -> None:
        c.update(stop_check_s=0.0, stop_checks=0)

    def counted(*a):
        t0 = clock()
        out = inner(*a)
        c["stop_check_s"] += clock() - t0
        c["stop_checks"] += 1
        return out

    def restore() -> None:
        engine_mod.check_stop = inner

    reset()
    engine_mod.check_stop = counted
    return {"reset": reset, "read": lambda: dict(c), "restore": restore}


def _sync() -> None:
    if device.torch_device().type != "cpu":
        device.synchronize()


def _evaluate(lm: Any, task: str, root: Path) -> tuple[float, list[float]]:
    """(seconds of simple_evaluate, per request in document (and choice) order: the log-likelihood, or the generated
    text of a generation task)."""
    # lazy: lm-eval is the optional `eval` extra
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    tm = TaskManager(include_path=str(root), include_defaults=False)
    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, log_samples=True)
    total = time.perf_counter() - t0
    docs = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    outs = [r[0] if isinstance(r[0], str) else r[0][0] for s in docs for r in s["resps"]]
    return total, outs


def run(args: argparse.Namespace) -> int:
    try:
        # lazy: lm-eval is the optional `eval` extra
        import lm_eval.models.huggingface as hf_mod
    except ModuleNotFoundError as exc:
        raise UserError("polyrl bench eval needs lm-eval-harness: pip install -e '.[eval]'") from exc
    # lazy: polyrl.eval.harness imports lm-eval; the engine and presets load only when this bench runs
    from polyrl.eval.harness import PolyrlLM
    from polyrl.eval.loading import eval_engine, load_eval_model
    from polyrl.infer import SamplingParams
    from polyrl.models.presets import PRESETS, create_model_from_preset

    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1 (runs of each phase after its first), got {args.repeats}")
    dev = device.torch_device()
    dtype = args.dtype or ("bfloat16" if dev.type != "cpu" and device.supports_bf16() else "float32")
    name = args.shape if args.shape in PRESETS else f"{args.shape}-shape"
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {
        "shape": name, "docs": args.docs, "dtype": dtype, "device": str(dev), "fuse_projections": args.fuse_projections,
    }  # fmt: skip
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    ref: dict[str, list[Any] | None] = {"ll": None, "gen": None}

    def measure(backend: str, fn: Any) -> dict[str, Any] | None:
        """Run one row; print it as soon as it is measured; a failing row is printed with its error and skipped."""
        try:
            row = fn()
        except Exception as exc:  # a row that cannot run (a missing extra, a server error) must not lose the rest
            row = {"backend": backend, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(_row_line(row), flush=True)
        return row if "error" not in row else None

    def hf_row(bs: int, kind: str, task: str, root: Path) -> dict[str, Any]:
        box: dict[str, float] = {}
        t0 = time.perf_counter()
        lm = hf_mod.HFLM(pretrained=str(model_dir), dtype=dtype, batch_size=bs, device=str(dev))
        load = time.perf_counter() - t0
        # every row runs its phase 1 + --repeats times (``repeat_s``: the fastest repeat), as the polyrl rows do: the
        # same rule for both, so first-use costs of either backend show as the difference, and the ratios are taken
        # against hf's fastest run
        counts = None
        if kind == "gen":
            box["gen_warmup_s"] = _gen_warm_up(lm, args)
            counts = _count_hf_generate(lm)
        _timed(
            lm, box, "generate_until" if kind == "gen" else "loglikelihood", repeat=True, counts=counts,
            repeats=args.repeats,
        )  # fmt: skip
        total, outs = _evaluate(lm, task, root)
        ref[kind] = ref[kind] or outs
        row = _row(f"hf bs={bs}" + (" generate" if kind == "gen" else ""), load, total, box, outs, ref[kind], kind)
        for key in ("repeat_s", "repeat_all_s", "same_on_repeat", "gen_warmup_s", "breakdown", "text_tokens"):
            if key in box:
                row[key] = box[key]
        return row

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # made on the device: a seeded random init of an 8b shape on the host's CPU took minutes (the 8b row's first
        # two calls ran out of their time limit before the first line)
        model_dir = create_model_from_preset(name, root / "model", seed=0, device=dev, dtype=getattr(torch, dtype))
        task = write_task(root, args.docs, args.context_words)
        gen_task = write_gen_task(root, args.gen_docs, args.context_words, args.gen_tokens) if args.gen_docs else None
        for bs in batch_sizes:
            measure(f"hf bs={bs}", lambda bs=bs: hf_row(bs, "ll", task, root))
        if gen_task is not None and batch_sizes:
            # before the in-process engine exists: its KV cache takes most of the device (on an 80 GB card the hf
            # generation of 256 x 256 tokens ran out of memory beside it)
            measure(f"hf bs={batch_sizes[-1]} generate", lambda: hf_row(batch_sizes[-1], "gen", gen_task, root))
            hf_gen = [r for r in rows if r["backend"] == f"hf bs={batch_sizes[-1]} generate"]
            if hf_gen and "breakdown" in hf_gen[0]:
                print(_hf_gen_line(hf_gen[0]), flush=True)
        harness = [r for r in rows if "harness_s" in r]
        if harness:  # lm-eval's own share of the first hf run (start-up, task building, tokenisation)
            h = harness[0]
            rows.append({"backend": f"lm-eval harness itself ({h['backend']} run)", "harness_s": h["harness_s"]})
            print(_row_line(rows[-1]), flush=True)
        t0 = time.perf_counter()
        model, tok = load_eval_model(str(model_dir), dtype, str(dev))
        llm = eval_engine(model, tok, fuse_projections=args.fuse_projections)
        lm = PolyrlLM(llm=llm, show_progress=False)
        load = time.perf_counter() - t0
        warm = _warm_up(llm, lm, root)
        print(
            f"polyrl warm-up (untimed): {warm['warmup_s']:.2f} s, of which decode graph capture "
            f"{warm['graph_capture_s']:.2f} s",
            flush=True,
        )
        if llm.runner.fused is not None:
            fused = llm.runner.fused
            res["fused_weight_bytes"] = fused.nbytes
            print(f"polyrl engine: fused projections ({len(fused.entries)} groups, {fused.nbytes / 2**30:.2f} GiB)")
        boxes: dict[str, dict[str, Any]] = {}

        def polyrl_row(kind: str, task: str) -> dict[str, Any]:
            box = boxes[kind] = {}
            counts = None
            if kind == "gen":
                box["gen_warmup_s"] = _gen_warm_up(lm, args)
                counts = _count_stop_checks()
            try:
                _timed(
                    lm, box, "generate_until" if kind == "gen" else "loglikelihood", repeat=True, counts=counts,
                    repeats=args.repeats,
                )  # fmt: skip
                total, outs = _evaluate(lm, task, root)
            finally:
                if counts is not None:
                    counts["restore"]()
            label = "polyrl (in-process)" + (" generate" if kind == "gen" else "")
            row = _row(label, load, total, box, outs, ref[kind], kind)
            row.update(warm)
            for key in ("repeat_s", "repeat_all_s", "same_on_repeat", "breakdown", "gen_warmup_s", "text_tokens"):
                if key in box:
                    row[key] = box[key]
            return row

        if measure("polyrl (in-process)", lambda: polyrl_row("ll", task)) is not None:
            print(_breakdown_line(rows[-1]), flush=True)
            if args.profile:
                res["profile"] = _profile(lm, boxes["ll"]["requests"], Path(args.profile))
            res["prompt_logprobs_overhead"] = _prefill_overhead(llm, lm, task, root, SamplingParams)
        if args.serve:
            measure("serve (local-completions)", lambda: _serve_row(llm, model_dir, task, root, ref["ll"], args, dtype))
            print(
                f"  client: lm-eval local-completions batch_size={args.serve_batch_size} (prompts per HTTP request), "
                f"num_concurrent={args.serve_concurrent}; server: {args.serve_mode}",
                flush=True,
            )
        if gen_task is not None:
            if measure("polyrl (in-process) generate", lambda: polyrl_row("gen", gen_task)) is not None:
                print(_breakdown_line(rows[-1]), flush=True)
                if args.profile:
                    res["profile_gen"] = _profile(lm, boxes["gen"]["requests"], Path(args.profile), "gen")
    _speedups(rows)
    res["rows"] = rows
    cols = ["backend", "load_s", "harness_s", "phase_s", "requests_per_s", "speedup_vs_best_hf"]
    print()
    print_table(
        rows, cols + ["repeat_s", "repeat_speedup", "claimed_speedup", "max_abs_diff_vs_hf", "same_as_hf", "error"]
    )
    over = res.get("prompt_logprobs_overhead")
    if over is not None:
        print(_overhead_line(over))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def _speedups(rows: list[dict[str, Any]]) -> None:
    """Per phase (log-likelihood, generate), against hf's fastest run (the faster of each hf row's first run and its
    repeat, over batch sizes): ``speedup_vs_best_hf`` of each row's first run, ``repeat_speedup`` of its repeat, and
    ``claimed_speedup``, the lower of the two (the figure a claim may use)."""
    for kind in ("ll", "gen"):
        mine = [r for r in rows if r.get("phase") == kind and r.get("phase_s")]
        hf = [t for r in mine if r["backend"].startswith("hf") for t in (r["phase_s"], r.get("repeat_s")) if t]
        if not hf:
            continue
        best = min(hf)
        for r in mine:
            r["speedup_vs_best_hf"] = best / r["phase_s"]
            if r.get("repeat_s"):
                r["repeat_speedup"] = best / r["repeat_s"]
            r["claimed_speedup"] = min(r["speedup_vs_best_hf"], r.get("repeat_speedup") or float("inf"))


def _row_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['backend']}: FAILED ({r['error']}); continuing with the other rows"
    if "phase_s" not in r:
        return f"{r['backend']}: {r['harness_s']:.2f} s"
    phase = "generation" if r["phase"] == "gen" else "log-likelihood"
    diff = r.get("max_abs_diff_vs_hf")
    same = r.get("same_as_hf")
    extra = f", max |diff| vs hf {diff:.2e}" if diff is not None else ""
    extra += f", {100 * same:.0f}% of texts as hf's" if same is not None else ""
    extra += f", repeat {r['repeat_s']:.3f} s" if r.get("repeat_s") is not None else ""
    return (
        f"{r['backend']}: load {r['load_s']:.2f} s, harness {r['harness_s']:.2f} s, {phase} {r['phase_s']:.3f} s "
        f"({r['requests_per_s']:.1f} requests/s){extra}"
    )


def _row(
    backend: str,
    load: float,
    total: float,
    box: dict[str, float],
    outs: list[Any],
    ref: list[Any] | None,
    kind: str = "ll",
) -> dict[str, Any]:
    """One backend's row: ``phase_s`` is the log-likelihood (``kind="ll"``) or generation (``"gen"``) phase;
    against the reference run, the max abs log-likelihood difference or the fraction of identical texts."""
    phase = box.get("phase_s", 0.0)
    n = len(outs)
    row = {
        "backend": backend,
        "phase": kind,
        "load_s": load,
        "total_s": total,
        "phase_s": phase,
        "harness_s": total - phase - box.get("repeat_s", 0.0),  # the repeat runs inside simple_evaluate too
        "requests_per_s": n / phase if phase else None,
    }
    if kind == "ll":
        row["loglikelihood_s"] = phase
        same = ref is not None and len(ref) == len(outs)
        row["max_abs_diff_vs_hf"] = max(abs(a - b) for a, b in zip(outs, ref)) if same else None
    else:
        row["generate_s"] = phase
        same = ref is not None and len(ref) == len(outs)
        row["same_as_hf"] = sum(a == b for a, b in zip(outs, ref)) / max(n, 1) if same else None
    return row


def _warm_up(llm: Any, lm: Any, root: Path) -> dict[str, float]:
    """Untimed first use of everything the timed phases run: scoring the first 13 and then 64 documents' requests (two
    batch shapes, so shape-specialised Triton kernels compile here) and forwards of 1, 63 and 64 tokens, the decode
    CUDA graphs (``capture_graphs``), a short greedy generation with a stop string and steps mixing decodes with
    prefills (16 prompts added while 16 others decode). The engine's Triton kernels
    compile on first use (seconds on a fresh machine; hf's PyTorch kernels come compiled): a one-off cost, not the
    phases' speed. Returns ``warmup_s`` (all of it) and ``graph_capture_s``."""
    # lazy: the engine loads only when this bench runs
    from polyrl.infer import SamplingParams
    from polyrl.infer.scoring import score_continuations

    rows = [json.loads(line) for line in (root / "bench_mc.jsonl").read_text().splitlines()[:64]]
    reqs = [SimpleNamespace(args=(r["context"], " " + c)) for r in rows for c in r["choices"]]
    _sync()
    t0 = time.perf_counter()
    lm.loglikelihood(reqs[: 13 * 4])
    lm.loglikelihood(reqs)
    for n in (1, 63, 64):  # forwards of 1, 63 and 64 tokens: Triton specialises integer arguments on == 1 and % 16
        score_continuations(llm, [[5] * n], [[7]], [0])
    capture = llm.capture_graphs()
    prompts = [lm.tok_encode(r["context"]) for r in rows[:8]]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, stop=["<never-stop>"]))
    # continuous batching's mixed steps (16 sequences decoding while 16 prompts prefill), as a generation phase runs
    # them once its prompts exceed one step's token budget
    params = SamplingParams(temperature=0.0, max_tokens=4, stop=["<never-stop>"])
    prompts = [lm.tok_encode(r["context"]) for r in rows[:32]]
    for p in prompts[:16]:
        llm.add_request(p, params)
    llm.step()
    for p in prompts[16:]:
        llm.add_request(p, params)
    while llm.has_unfinished_requests():
        llm.step()
    _sync()
    llm.reset_prefix_cache()
    return {"warmup_s": time.perf_counter() - t0, "graph_capture_s": capture}


def _gen_warm_up(lm: Any, args: argparse.Namespace, tokens: int = 8, seed: int = 2) -> float:
    """The same untimed warm-up before either backend's generation phase (the same rule for hf and polyrl):
    ``--gen-docs`` documents of other contexts of the same length (another seed, so no prompt of the timed phase is
    in polyrl's prefix cache) through the backend's own ``generate_until``, ``min(tokens, --gen-tokens)`` new tokens
    each. The whole batch, not a few documents: the timed phase's shapes (prompt chunks of the full token budget,
    prefill steps mixed with decodes of many rows, decode launches at the phase's batch sizes) are first seen here,
    so the Triton kernels they specialise compile here, not inside the phase. Returns its seconds."""
    rng = random.Random(seed)
    kw = {"until": ["<never-stop>"], "do_sample": False, "max_gen_toks": max(1, min(tokens, args.gen_tokens))}
    contexts = [" ".join(rng.choice(WORDS) for _ in range(args.context_words)) for _ in range(args.gen_docs)]
    reqs = [SimpleNamespace(args=(c, dict(kw))) for c in contexts]
    _sync()
    t0 = time.perf_counter()
    lm.generate_until(reqs)
    _sync()
    engine = getattr(lm, "llm", None)
    if engine is not None:
        engine.reset_prefix_cache()
    return time.perf_counter() - t0


def _hf_gen_line(r: dict[str, Any]) -> str:
    """Where the hf generation phase went (``_count_hf_generate``)."""
    b = r["breakdown"]
    gen = b.get("generate_s", 0.0)
    return (
        f"  hf generate breakdown: {int(b.get('requests', 0))} requests in {int(b.get('generate_calls', 0))} "
        f"model.generate calls, {int(b.get('decode_steps', 0))} decode steps, {int(b.get('computed_tokens', 0))} "
        f"tokens computed, {int(r.get('text_tokens', 0))} in the texts; model.generate {gen:.3f} s, lm-eval's own "
        f"{r['phase_s'] - gen:.3f} s"
    )


def _breakdown_line(r: dict[str, Any]) -> str:
    """Where a polyrl row's phase went (``PolyrlLM.last_score_stats`` / ``last_generate_stats``)."""
    b = r.get("breakdown") or {}
    if r.get("phase") == "gen":
        prep, gen = b.get("prepare_s", 0.0), b.get("generate_s", 0.0)
        rep = f"; repeat {r['repeat_s']:.3f} s (same texts: {r.get('same_on_repeat')})" if "repeat_s" in r else ""
        return (
            f"  generate breakdown: {int(b.get('requests', 0))} requests in {int(b.get('engine_calls', 0))} engine "
            f"call(s), {int(b.get('prompt_tokens', 0))} prompt tokens, {int(b.get('generated_tokens', 0))} tokens "
            f"generated ({int(r.get('text_tokens', 0))} in the texts); tokenise + params {prep:.3f} s, engine "
            f"{gen:.3f} s = {int(b.get('sync_steps', 0))} synchronous steps {b.get('sync_s', 0.0):.3f} s + "
            f"{int(b.get('launches', 0))} launches ahead (prompts, decodes) {b.get('launch_s', 0.0):.3f} s + last step "
            f"{b.get('final_s', 0.0):.3f} s (first step {b.get('first_step_s', 0.0):.3f} s, slowest "
            f"{b.get('slowest_step_s', 0.0):.3f} s); host stop checks {b.get('stop_check_s', 0.0):.3f} s over "
            f"{int(b.get('stop_checks', 0))} tokens; decode graphs captured inside {b.get('graph_capture_s', 0.0):.3f} "
            f"s{rep}"
        )
    parts = ["tokenize", "plan", "arrays", "launch", "wait", "gather"]
    known = sum(b.get(f"{p}_s", 0.0) for p in parts)
    text = ", ".join(f"{p} {b.get(f'{p}_s', 0.0):.3f}" for p in parts)
    rep = f"; repeat {r['repeat_s']:.3f} s (same results: {r.get('same_on_repeat')})" if "repeat_s" in r else ""
    return (
        f"  log-likelihood breakdown (s): {text}, other {r['phase_s'] - known:.3f}; {int(b.get('batches', 0))} "
        f"batches, {int(b.get('fed_tokens', 0))} tokens fed (one sequence per request: "
        f"{int(b.get('unshared_tokens', 0))}), {int(b.get('scored_tokens', 0))} scored{rep}"
    )


def _profile(lm: Any, requests: list, out: Path, kind: str = "ll") -> dict[str, str]:
    """One more in-process call of the phase (``kind``: ``ll`` = ``loglikelihood``, ``gen`` = ``generate_until``)
    over ``requests`` under cProfile, then one under the torch profiler (CPU + the accelerator's activity), the
    prefix cache emptied before each: ``eval_<kind>.pstats``, ``eval_<kind>_cprofile.txt`` (top functions by own and
    by cumulative time), ``eval_<kind>_torch.txt`` (ops by device and host time) and ``eval_<kind>_trace.json``
    (Chrome trace) in ``out``. The model's own method runs (not the bench's timed wrapper, which would repeat it)."""
    out.mkdir(parents=True, exist_ok=True)
    method = getattr(type(lm), "loglikelihood" if kind == "ll" else "generate_until")

    def call() -> None:
        lm.llm.reset_prefix_cache()
        _sync()
        method(lm, requests)
        _sync()

    prof = cProfile.Profile()
    prof.enable()
    call()
    prof.disable()
    prof.dump_stats(str(out / f"eval_{kind}.pstats"))
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    calls = sum(v[1] for v in stats.stats.values())
    text.write(f"{calls} Python calls for {len(requests)} requests ({calls / max(1, len(requests)):.1f} per request)\n")
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    (out / f"eval_{kind}_cprofile.txt").write_text(text.getvalue())
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.torch_device().type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as tp:
        call()
    sort = "cuda_time_total" if len(acts) > 1 else "cpu_time_total"
    (out / f"eval_{kind}_torch.txt").write_text(tp.key_averages().table(sort_by=sort, row_limit=40))
    tp.export_chrome_trace(str(out / f"eval_{kind}_trace.json"))
    phase = "log-likelihood" if kind == "ll" else "generation"
    print(
        f"profile of the in-process {phase} phase: {out} ({calls / max(1, len(requests)):.1f} Python calls "
        "per request)",
        flush=True,
    )
    return {"dir": str(out), "python_calls_per_request": calls / max(1, len(requests))}


def head_flop_share(cfg: Any, context: int = 0) -> float:
    """The LM head's FLOPs over the body's for one prompt token of a dense (or MoE: active experts) decoder at an
    average attention context of ``context`` tokens: the floor on what scoring every prompt position adds to a
    prefill when the head's GEMM runs as efficiently as the body's (the log-softmax over the vocabulary comes on top).
    qwen3-0.6b: head 2 * 1024 * 151936 = 0.31 GFLOP, body 28 x (q, k, v, o: 6.3M + MLP 9.4M) x 2 = 0.88 GFLOP: 35%."""
    h, layers = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = 3 * h * cfg.intermediate_size
    if getattr(cfg, "num_experts", 0):
        mlp = 3 * h * (cfg.moe_intermediate_size or cfg.intermediate_size) * cfg.num_experts_per_tok
    body = 2 * layers * (h * q + 2 * h * kv + q * h + mlp) + 4 * layers * q * context  # + scores and values
    return 2 * h * cfg.vocab_size / body


def _prefill_overhead(llm: Any, lm: Any, task: str, root: Path, SamplingParams: Any) -> dict[str, float]:
    """Extra prefill time of prompt log-probs, as a fraction of a plain prefill of the same 256 context + choice
    prompts: scoring every position (``prompt_logprobs=1``: the token's log-prob, the top-1 alternative and its
    rank), and only the choice's tokens (what the ``polyrl`` lm-eval model asks for; the rest of the prompt never
    reaches the LM head). Prefix caching is off while it runs, so every run computes every token of every prompt (a
    plain prefill would otherwise compute a document's context once for its four choices, and a run scoring every
    position never takes a cached block: it compared ~1/3 of the tokens with all of them). ``floor``: the LM head's
    FLOPs over the body's (``head_flop_share``), the least that scoring every position can add."""
    rows = [json.loads(line) for line in (root / "bench_mc.jsonl").read_text().splitlines()[:64]]
    prompts, starts = [], []
    for r in rows:
        ctx = len(lm.tok_encode(r["context"]))
        for c in r["choices"]:
            prompts.append(lm.tok_encode(r["context"] + " " + c))
            starts.append(max(1, ctx))
    runs = {
        "plain": [SamplingParams(temperature=0.0, max_tokens=1)] * len(prompts),
        "all_positions": [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)] * len(prompts),
        "continuation": [
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, prompt_logprobs_from=st) for st in starts
        ],
    }
    times = {}
    bm = llm.block_manager
    caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
    try:
        for key, params in runs.items():
            best = float("inf")
            for _ in range(3):
                llm.reset_prefix_cache()
                _sync()
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                _sync()
                best = min(best, time.perf_counter() - t0)
            times[key] = best
    finally:
        bm.enable_prefix_caching = caching
    tokens = sum(len(p) for p in prompts)
    out = {k: times[k] / times["plain"] - 1.0 for k in ("all_positions", "continuation")}
    out.update({f"{k}_s": v for k, v in times.items()})
    out.update(tokens=tokens, floor=head_flop_share(llm.model.config, tokens // (2 * len(prompts))))
    return out


def _overhead_line(over: dict[str, float]) -> str:
    floor = over["floor"]
    verdict = "so 15% is out of reach there" if floor > 0.15 else "below 15% at this shape"
    return (
        f"prompt log-probs add {100 * over['all_positions']:.1f}% to a prefill of the same prompts when every "
        f"position is scored (floor: the LM head is {100 * floor:.0f}% of the body's FLOPs, {verdict}), "
        f"{100 * over['continuation']:.1f}% when only the choices' tokens are (as lm-eval asks); prefill "
        f"{over['plain_s']:.3f} s for {over['tokens']} tokens, prefix cache off"
    )


def _serve_row(
    llm: Any, model_dir: Path, task: str, root: Path, ref: list[float] | None, args: argparse.Namespace, dtype: str
) -> dict[str, Any]:
    """lm-eval ``local-completions`` (token-id prompts, ``--serve-batch-size`` prompts per HTTP request,
    ``--serve-concurrent`` requests in flight) against ``polyrl serve``: by default a server process of its own
    (``--serve-mode process``, as a user runs it: the client's JSON parsing and the server's share no GIL; the
    in-process engine's KV cache is released meanwhile), warmed up with one scoring request before the timed phase;
    ``thread`` runs it in this process (``start_server``) over the in-process engine."""
    # lazy: lm-eval (the `eval` extra) and the server (the `serve` extra) only with --serve
    from lm_eval.api.registry import get_model

    stop, base_url, boot = start_server_for_bench(llm, model_dir, args.serve_mode, dtype)
    try:
        client = (
            f"base_url={base_url}/completions,model=bench,tokenizer={model_dir},tokenized_requests=True,"
            f"num_concurrent={args.serve_concurrent},max_retries=1"
        )
        box: dict[str, float] = {}
        t0 = time.perf_counter()
        lm = get_model("local-completions").create_from_arg_string(client, {"batch_size": args.serve_batch_size})
        load = time.perf_counter() - t0
        _timed(lm, box)
        before = scoring_metrics(base_url)
        total, lls = _evaluate(lm, task, root)
        server = {k: v - before.get(k, 0.0) for k, v in scoring_metrics(base_url).items()}
    finally:
        stop()
    row = _row("serve (local-completions)", load + boot, total, box, lls, ref)
    row["client"] = {"batch_size": args.serve_batch_size, "num_concurrent": args.serve_concurrent}
    row["serve_mode"] = args.serve_mode
    row["server"] = server
    if server:
        print(
            f"  server (its /metrics, this phase): {server.get('prompts', 0):.0f} prompts scored in "
            f"{server.get('calls', 0):.0f} engine calls taking {server.get('engine', 0):.2f} s on the engine thread, "
            f"responses written in {server.get('format', 0):.2f} s; client-side tokenising and the HTTP/JSON round "
            "trips are the rest of the phase",
            flush=True,
        )
    return row
