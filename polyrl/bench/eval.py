"""``polyrl bench eval``: lm-eval-harness log-likelihood scoring through polyrl against lm-eval's ``hf`` backend, in
one run, on the same requests.

A random checkpoint of a preset shape (``--shape qwen3-0.6b``, written with its tokenizer to a temporary folder) and
a synthetic four-way multiple-choice task of ``--docs`` documents whose contexts are about ``--context-words`` words
(written as lm-eval task YAML + jsonl, no hub). For each backend it times the whole ``simple_evaluate`` and its
log-likelihood phase (the backend's ``loglikelihood`` call), and reports the harness's own time (start-up, task
building, tokenisation) as total - model load - log-likelihood phase:

- ``hf`` at each ``--hf-batch-sizes`` (lm-eval pads a batch and takes a full-vocabulary log-softmax per position);
- ``polyrl``: the in-process engine (``polyrl.eval.harness``: prefill-only scoring, a document's choices sharing
  their context through the prefix cache);
- ``serve`` (with ``--serve``): lm-eval's ``local-completions`` against ``polyrl serve`` in this process.

It also times a prefill of the same prompts with and without prompt log-probs (the engine's extra cost of scoring:
every position, or only the continuation's). Scoring every position runs the LM head on every token: at the
qwen3-0.6b shape that head is ~40% of a token's forward FLOPs, so that overhead cannot be small; lm-eval's requests
score only the continuation.
Per-document log-likelihoods of every backend are compared with the first ``hf`` run (max abs difference). This
module measures; it asserts nothing. Needs the ``eval`` extra.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from polyrl.bench.common import print_table
from polyrl.errors import UserError
from polyrl.platform import device

WORDS = "the a river mill cat house light stone green small quick blue old new north city road field tree sun".split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-0.6b", help="model preset (with or without the -shape suffix)")
    parser.add_argument("--docs", type=int, default=2000, help="multiple-choice documents (4 requests each)")
    parser.add_argument("--context-words", type=int, default=60, help="words per context (~90 tokens at 60)")
    parser.add_argument("--hf-batch-sizes", default="64,256", help="comma-separated batch sizes of the hf backend")
    parser.add_argument("--serve", action="store_true", help="also time local-completions against polyrl serve")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


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


def _timed_loglikelihood(lm: Any, box: dict[str, float]) -> None:
    """Make ``lm.loglikelihood`` record its wall time in ``box["ll_s"]``."""
    inner = lm.loglikelihood

    def timed(requests, *a, **k):
        _sync()
        t0 = time.perf_counter()
        out = inner(requests, *a, **k)
        _sync()
        box["ll_s"] = box.get("ll_s", 0.0) + time.perf_counter() - t0
        return out

    lm.loglikelihood = timed


def _sync() -> None:
    if device.torch_device().type != "cpu":
        device.synchronize()


def _evaluate(lm: Any, task: str, root: Path) -> tuple[float, list[float]]:
    """(seconds of simple_evaluate, per-request log-likelihoods in document and choice order)."""
    # lazy: lm-eval is the optional `eval` extra
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    tm = TaskManager(include_path=str(root), include_defaults=False)
    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, log_samples=True)
    total = time.perf_counter() - t0
    lls = [r[0][0] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"]) for r in s["resps"]]
    return total, lls


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

    dev = device.torch_device()
    dtype = args.dtype or ("bfloat16" if dev.type != "cpu" and device.supports_bf16() else "float32")
    name = args.shape if args.shape in PRESETS else f"{args.shape}-shape"
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {"shape": name, "docs": args.docs, "dtype": dtype, "device": str(dev)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = create_model_from_preset(name, root / "model", seed=0, dtype=getattr(torch, dtype))
        task = write_task(root, args.docs, args.context_words)
        reference: list[float] | None = None
        for bs in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
            box: dict[str, float] = {}
            t0 = time.perf_counter()
            lm = hf_mod.HFLM(pretrained=str(model_dir), dtype=dtype, batch_size=bs, device=str(dev))
            load = time.perf_counter() - t0
            _timed_loglikelihood(lm, box)
            total, lls = _evaluate(lm, task, root)
            reference = reference or lls
            rows.append(_row(f"hf bs={bs}", load, total, box["ll_s"], len(lls), lls, reference))
            del lm
        box = {}
        t0 = time.perf_counter()
        model, tok = load_eval_model(str(model_dir), dtype, str(dev))
        llm = eval_engine(model, tok)
        lm = PolyrlLM(llm=llm, show_progress=False)
        load = time.perf_counter() - t0
        _timed_loglikelihood(lm, box)
        total, lls = _evaluate(lm, task, root)
        rows.append(_row("polyrl (in-process)", load, total, box["ll_s"], len(lls), lls, reference))
        res["prefix_cache_hit_rate"] = llm.stats()["prefix_cache_hit_rate"]
        res["prompt_logprobs_overhead"] = _prefill_overhead(llm, lm, task, root, SamplingParams)
        if args.serve:
            rows.append(_serve_row(llm, model_dir, task, root, reference))
    hf_best = min((r["loglikelihood_s"] for r in rows if r["backend"].startswith("hf")), default=None)
    for r in rows:
        r["speedup_vs_best_hf"] = hf_best / r["loglikelihood_s"] if hf_best and r["loglikelihood_s"] else None
    res["rows"] = rows
    cols = ["backend", "load_s", "harness_s", "loglikelihood_s", "requests_per_s", "speedup_vs_best_hf"]
    print_table(rows, cols + ["max_abs_diff_vs_hf"])
    over = res["prompt_logprobs_overhead"]
    print(
        f"prompt log-probs add {100 * over['all_positions']:.1f}% to a prefill of the same prompts when every position "
        f"is scored, {100 * over['continuation']:.1f}% when only the choices' tokens are (as lm-eval asks)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def _row(backend: str, load: float, total: float, ll: float, n: int, lls: list[float], ref: list[float] | None):
    diff = max(abs(a - b) for a, b in zip(lls, ref)) if ref is not None and len(ref) == len(lls) else None
    return {
        "backend": backend,
        "load_s": load,
        "total_s": total,
        "loglikelihood_s": ll,
        "harness_s": total - ll,
        "requests_per_s": n / ll if ll else None,
        "max_abs_diff_vs_hf": diff,
    }


def _prefill_overhead(llm: Any, lm: Any, task: str, root: Path, SamplingParams: Any) -> dict[str, float]:
    """Extra prefill time of prompt log-probs, as a fraction of a plain prefill of the same 256 context + choice
    prompts (prefix cache reset before each run): scoring every position, and only the choice's tokens (what the
    ``polyrl`` lm-eval model asks for; the rest of the prompt never reaches the LM head)."""
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
    for key, params in runs.items():
        best = float("inf")
        for _ in range(3):
            llm.reset_prefix_cache()  # every prompt computed in full each time
            _sync()
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            _sync()
            best = min(best, time.perf_counter() - t0)
        times[key] = best
    return {k: times[k] / times["plain"] - 1.0 for k in ("all_positions", "continuation")}


def _serve_row(llm: Any, model_dir: Path, task: str, root: Path, ref: list[float] | None) -> dict[str, Any]:
    # lazy: lm-eval (the `eval` extra) and the server (the `serve` extra) only with --serve
    from lm_eval.api.registry import get_model

    from polyrl.server import ServeConfig, start_server

    handle = start_server(llm, ServeConfig(port=0, served_model_name="bench", log_level="warning"))
    try:
        args = (
            f"base_url={handle.base_url}/completions,model=bench,tokenizer={model_dir},tokenized_requests=True,"
            "num_concurrent=8,max_retries=1"
        )
        box: dict[str, float] = {}
        t0 = time.perf_counter()
        lm = get_model("local-completions").create_from_arg_string(args, {"batch_size": 64})
        load = time.perf_counter() - t0
        _timed_loglikelihood(lm, box)
        total, lls = _evaluate(lm, task, root)
    finally:
        handle.stop()
    return _row("serve (local-completions)", load, total, box["ll_s"], len(lls), lls, ref)
