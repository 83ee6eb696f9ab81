"""FP8 training numerics evidence (issue 28): the same N-step SFT run in bf16 and with ``--precision fp8``, over
several seeds, with a held-out loss; curves in one PNG, per-precision mean and std, and the paired FP8 - bf16
differences.

    python scripts/fp8_loss_curves.py --preset qwen3-0.6b-shape --steps 300 --seeds 0,1,2 --eval-every 25 \
        --micro-batch-tokens 8192 --data "builtin:markov?n=20000" --out runs/fp8_seeds        # on an FP8 GPU
    POLYRL_KERNELS=fp8_scaled_mm:reference python scripts/fp8_loss_curves.py --preset tiny --steps 20 --out /tmp/c

Why several seeds: one 300-step run's final loss is set by its trajectory (the H200 run of 2026-12-03: two bf16 runs
differing only in data order ended 10% apart), so one bf16 / FP8 pair can neither show nor refute a 1% difference.
Each seed ``s`` sets the initial weights (a random ``--preset`` model written once to ``<out>/init-s<s>``; with
``--model`` every seed starts from it) and the data order; the variants of one seed share both, so the per-seed
difference ``fp8 - bf16`` is a paired comparison, and its spread over seeds is the noise it is measured against.

What is measured per run (``polyrl.fit("sft", ...)``, the CLI's code path, into ``<out>/<variant>-s<seed>``):

- ``final_loss``: the mean of the last ``--final-window`` training-step losses (one step is one batch: noisy);
- ``final_eval``: with ``--eval-every N``, the loss of the final model on a fixed held-out split that no training
  step sees (also every N steps: ``eval_steps`` / ``eval_losses``). An FP8 model in eval mode runs its linears in
  bf16 (docs/fp8.md), so this compares the trained weights, not FP8 inference rounding. For a ``builtin:`` spec the
  held-out split is its ``@test`` part (``--eval-rows`` rows; disjoint from training by construction), for a file
  ``--eval-data``. Builtin rows are generated once into ``<out>/data`` (every run reads the same files; an existing
  folder is reused).
- for ``builtin:markov`` the loss floor: the generating chain's own loss on the held-out rows (nats per trained
  token), so the excess ``loss - floor`` is reported too.

The primary measure is ``final_eval`` when there is one, else ``final_loss``. Per variant: mean and std over seeds;
per variant other than bf16: the paired differences, their mean, std and a 95% interval of the mean (Student t),
relative to bf16's mean. Verdict on ``fp8`` (else the last variant): ``within`` the bar (``--max-rel-diff``, 1%)
when the whole interval is inside it, ``outside`` when it is wholly outside, ``undecided`` otherwise (one seed: the
point estimate decides, as before). Exit status 0 only for ``within``.

``<out>/fp8_loss_curves.json`` (rewritten after every run, so a run cut by a time limit keeps what finished) and
``<out>/fp8_loss_curves.png`` (training and held-out loss: each variant's mean over seeds, the band from the lowest
to the highest seed; each variant's held-out loss relative to the same seed's bf16 run, with the bar).
``--budget-s`` starts no seed whose runs would end past that many seconds (estimated from the slowest seed so far).

``--variants`` adds diagnostic runs beside the pair (all against ``bf16``): ``fp8-rowwise`` (row-wise forward
scaling), ``fp8-grad-e4m3`` / ``fp8-grad-bf16`` (the gradient dY cast to e4m3 / not quantised:
``fp8_linear.GRAD_DTYPE``), ``bf16-seed1`` (bf16 with the next data-order seed, same initial weights).
``--reuse JSON`` takes runs from an earlier ``fp8_loss_curves.json`` instead of training them again (same model,
data and steps assumed): its ``runs`` by ``<variant>-s<seed>``, or in the older one-seed format by variant name for
the first seed.

Not here: speed (``polyrl bench sft --precision both``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

# name -> (FP8 linears, fp8_scaling override, fp8_linear.GRAD_DTYPE, data-order seed offset)
VARIANTS = {
    "bf16": (False, None, "e5m2", 0),
    "fp8": (True, None, "e5m2", 0),
    "fp8-rowwise": (True, "rowwise", "e5m2", 0),
    "fp8-grad-e4m3": (True, None, "e4m3", 0),
    "fp8-grad-bf16": (True, None, "bf16", 0),
    "bf16-seed1": (False, None, "e5m2", 1),
}
# Student t, two-sided 95%, by degrees of freedom (larger df: the df=10 value, slightly wide)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (runs, PNG, JSON)")
    p.add_argument("--model", help="HF model folder to start from (default: a random --preset model per seed)")
    p.add_argument("--preset", default="qwen3-0.6b-shape", help="polyrl init-model preset when --model is not given")
    p.add_argument("--data", default="builtin:arithmetic?n=50000", help="dataset spec (as polyrl train --data)")
    p.add_argument("--eval-data", help="held-out data spec for a non-builtin --data (builtin: its @test split)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps and at the end (0: off)")
    p.add_argument("--eval-rows", type=int, default=1000, help="rows of a builtin's held-out split")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--fp8-scaling", choices=["tensorwise", "rowwise"], default="tensorwise")
    p.add_argument("--seeds", default="0", help="comma list: initial weights and data order, shared by the variants")
    p.add_argument("--final-window", type=int, default=10, help="steps averaged into the final training loss")
    p.add_argument("--variants", default="bf16,fp8", help=f"comma list of runs, from {', '.join(VARIANTS)}")
    p.add_argument("--reuse", help="an earlier fp8_loss_curves.json whose runs are reused")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no seed that would end past this (0: no limit)")
    p.add_argument("--keep-models", action="store_true", help="save each run's final model (default: not saved)")
    p.add_argument("--max-rel-diff", type=float, default=0.01, help="the bar on |fp8 - bf16| / bf16 (issue 28: 1%%)")
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: give non-negative integers, e.g. --seeds 0,1,2")
    if not args.seed_list or min(args.seed_list) < 0 or len(set(args.seed_list)) != len(args.seed_list):
        p.error(f"--seeds {args.seeds!r}: give distinct non-negative integers, e.g. --seeds 0,1,2")
    args.names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.names if v not in VARIANTS]
    if unknown or "bf16" not in args.names:
        p.error(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)}); bf16 must be one of them")
    return args


def run_key(variant: str, seed: int) -> str:
    return f"{variant}-s{seed}"


# ---- data --------------------------------------------------------------------------------------------------
def prepare_data(args: argparse.Namespace, out: Path) -> tuple[str, str | None]:
    """(train spec, held-out spec or None). A builtin spec is written once to ``<out>/data/{train,test}.jsonl``."""
    if not args.data.startswith("builtin:"):
        return args.data, args.eval_data
    # lazy: the script's own imports stay light for --help
    from polyrl.data import builtin

    folder = out / "data"
    train, test = folder / "train.jsonl", folder / "test.jsonl"
    if not train.exists():
        folder.mkdir(parents=True, exist_ok=True)
        _write_rows(test, builtin.generate(args.data, split="test", n=args.eval_rows))
        _write_rows(train, builtin.generate(args.data, split="train"))
    return str(train), str(test)


def _write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n" for r in rows))
    tmp.replace(path)


def loss_floor(args: argparse.Namespace, model: Path, test: str) -> dict | None:
    """For ``builtin:markov``: the chain's own loss on the held-out rows, in nats per trained token (the loss unit)."""
    from polyrl.data import builtin

    name, params, _ = builtin.parse_spec(args.data)
    if name != "markov":
        return None
    from polyrl.data import DataConfig, build_sft
    from polyrl.data.builtin import markov
    from polyrl.models.checkpoint import load_tokenizer

    rows = [json.loads(line) for line in Path(test).read_text().splitlines() if line.strip()]
    nats = sum(markov.completion_nll(r, params) for r in rows)
    data = build_sft(DataConfig(path=test, max_seq_len=args.max_seq_len), load_tokenizer(model), "train", 1 << 20)
    s = data.stats
    if s.truncated or s.bad_rows or s.sequences != len(rows) or not math.isfinite(nats):
        print(f"floor: not computed (truncated {s.truncated}, bad {s.bad_rows} of {len(rows)} rows)")
        return None
    return {
        "nats_per_token": nats / s.target_tokens,
        "nats_per_word": markov.word_entropy(params),
        "rows": len(rows),
        "target_tokens": s.target_tokens,
    }


# ---- runs --------------------------------------------------------------------------------------------------
def init_model(args: argparse.Namespace, out: Path, seed: int) -> Path:
    if args.model:
        return Path(args.model)
    from polyrl.models.presets import create_model_from_preset
    from polyrl.platform import device

    model = out / f"init-s{seed}"
    if not (model / "config.json").exists():
        create_model_from_preset(args.preset, model, seed=seed, device=device.torch_device())
    return model


def train(args: argparse.Namespace, model: Path, data: tuple[str, str | None], out: Path, variant: str, seed: int):
    """One run; its record (curves, final losses, times)."""
    from polyrl.models import fp8_linear
    from polyrl.trainer import fit

    fp8, scaling, grad_dtype, seed_offset = VARIANTS[variant]
    fp8_linear.GRAD_DTYPE = grad_dtype
    train_spec, eval_spec = data
    loop = {"max_steps": args.steps, "log_every": max(1, args.steps // 20), "save_final_model": args.keep_models}
    if args.eval_every > 0 and eval_spec:
        loop.update(eval_every=args.eval_every, eval_data=eval_spec)
    t0 = time.perf_counter()
    summary = fit(
        "sft",
        model,
        # fixed shapes: one CUDA graph replays every step (packed shapes vary, and each repeat would capture anew)
        {"path": train_spec, "max_seq_len": args.max_seq_len, "fixed_shapes": True},
        out,
        seed=seed + seed_offset,
        train=loop,
        optim={"lr": args.lr},
        schedule={"warmup_steps": min(args.warmup_steps, max(0, args.steps - 1)), "decay": "cosine"},
        engine={"micro_batch_tokens": args.micro_batch_tokens},
        precision={"linear": "fp8" if fp8 else "default", "fp8_scaling": scaling or args.fp8_scaling},
        checkpoint={"every_n_steps": 0, "save_final": False},
    )
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    evals = [(int(r["step"]), float(r["eval_loss"])) for r in steps if r.get("eval_loss") is not None]
    return make_record(
        variant,
        seed,
        [float(r["loss"]) for r in steps],
        evals,
        args.final_window,
        wall_s=wall,
        step_time_s=float(summary.get("time_s", 0.0)),
        epochs=float(steps[-1].get("epoch", 0.0)) if steps else 0.0,
    )


def make_record(variant: str, seed: int, losses: list[float], evals: list[tuple[int, float]], window: int, **extra):
    tail = losses[-max(1, window) :]
    return {
        "variant": variant,
        "seed": seed,
        "losses": losses,
        "final_loss": sum(tail) / len(tail),
        "last_loss": losses[-1],
        "eval_steps": [s for s, _ in evals],
        "eval_losses": [v for _, v in evals],
        "final_eval": evals[-1][1] if evals else None,
        **extra,
    }


def reused_record(reused: dict, variant: str, seed: int, first_seed: int, window: int) -> dict | None:
    rec = reused.get("runs", {}).get(run_key(variant, seed))
    if isinstance(rec, dict) and "losses" in rec:
        return rec
    old = reused.get(variant)  # the one-seed format: {variant: {"losses": [...]}}
    if seed == first_seed and isinstance(old, dict) and "losses" in old:
        return make_record(variant, seed, old["losses"], [], window)
    return None


# ---- statistics --------------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    """Mean, sample std (0 for one value) and the values."""
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else None,
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def paired(runs: dict, variant: str, metric: str, seeds: list[int]) -> dict | None:
    """``variant - bf16`` of ``metric`` per seed that has both; mean, std, 95% interval, relative to bf16's mean."""
    pairs = [
        (s, runs[run_key(variant, s)][metric], runs[run_key("bf16", s)][metric])
        for s in seeds
        if run_key(variant, s) in runs
        and run_key("bf16", s) in runs
        and runs[run_key(variant, s)][metric] is not None
        and runs[run_key("bf16", s)][metric] is not None
    ]
    if not pairs:
        return None
    diffs = [v - b for _, v, b in pairs]
    base = statistics.fmean(b for _, _, b in pairs)
    d = spread(diffs)
    n = len(diffs)
    half = T95.get(n - 1, T95[10]) * d["std"] / math.sqrt(n) if n > 1 else None
    return {
        "metric": metric,
        "seeds": [s for s, _, _ in pairs],
        "diffs": diffs,
        "rel_diffs": [(v - b) / b for _, v, b in pairs],
        "mean": d["mean"],
        "std": d["std"],
        "ci95": half,
        "bf16_mean": base,
        "rel_diff": d["mean"] / base,
        "rel_ci95": half / base if half is not None else None,
    }


def verdict(p: dict, bar: float) -> str:
    rel, half = p["rel_diff"], p["rel_ci95"]
    if half is None:  # one seed: the point estimate
        return "within" if abs(rel) <= bar else "outside"
    if abs(rel) + half <= bar:
        return "within"
    if abs(rel) - half > bar:
        return "outside"
    return "undecided"


def summarize(args: argparse.Namespace, runs: dict, floor: dict | None, seeds_done: list[int]) -> dict:
    has_eval = all(r.get("final_eval") is not None for r in runs.values()) and bool(runs)
    metric = "final_eval" if has_eval else "final_loss"
    summary: dict = {
        "model": args.model or args.preset,
        "data": args.data,
        "steps": args.steps,
        "micro_batch_tokens": args.micro_batch_tokens,
        "lr": args.lr,
        "fp8_scaling": args.fp8_scaling,
        "max_rel_diff": args.max_rel_diff,
        "seeds": seeds_done,
        "variants": args.names,
        "metric": metric,
        "floor": floor,
        "per_variant": {},
        "paired": {},
        "runs": runs,
    }
    for name in args.names:
        mine = [runs[run_key(name, s)] for s in seeds_done if run_key(name, s) in runs]
        entry = {"final_loss": spread([r["final_loss"] for r in mine])}
        if has_eval:
            entry["final_eval"] = spread([r["final_eval"] for r in mine])
            if floor is not None:
                entry["excess_eval"] = spread([r["final_eval"] - floor["nats_per_token"] for r in mine])
        summary["per_variant"][name] = entry
        if name != "bf16":
            metrics = ("final_loss", "final_eval") if has_eval else ("final_loss",)
            summary["paired"][name] = {m: paired(runs, name, m, seeds_done) for m in metrics}
    primary = "fp8" if "fp8" in args.names else args.names[-1]
    p = summary["paired"].get(primary, {}).get(metric)
    summary["primary"] = primary
    if p is not None:
        summary["rel_diff"], summary["rel_ci95"] = p["rel_diff"], p["rel_ci95"]
        summary["verdict"] = verdict(p, args.max_rel_diff)
        if floor is not None and metric == "final_eval":
            excess = p["bf16_mean"] - floor["nats_per_token"]
            summary["excess_rel_diff"] = p["mean"] / excess if excess > 0 else None
    else:
        summary["rel_diff"], summary["rel_ci95"], summary["verdict"] = None, None, "no pair"
    summary["within_bar"] = summary["verdict"] == "within"
    return summary


# ---- output ------------------------------------------------------------------------------------------------
def plot(summary: dict, path: Path) -> None:
    # lazy: matplotlib is the optional plot extra
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, has_eval = summary["runs"], summary["metric"] == "final_eval"
    panels = 3 if has_eval else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels if has_eval else 8, 4.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(summary["variants"]):
        mine = [r for r in runs.values() if r["variant"] == name]
        if not mine:
            continue
        c = colors[i % len(colors)]
        n = min(len(r["losses"]) for r in mine)
        cols = list(zip(*(r["losses"][:n] for r in mine)))
        stat = summary["per_variant"][name]["final_loss"]
        label = f"{name} ({len(mine)} seeds, final {stat['mean']:.4f} ± {stat['std']:.4f})"
        ax = axes[0][0]
        x = range(1, n + 1)
        ax.plot(x, [statistics.fmean(v) for v in cols], color=c, lw=1.0, label=label)
        if len(mine) > 1:
            ax.fill_between(x, [min(v) for v in cols], [max(v) for v in cols], color=c, alpha=0.2, lw=0)
        if has_eval:
            ax = axes[0][1]
            steps = mine[0]["eval_steps"]
            m = min(len(r["eval_losses"]) for r in mine)
            ecols = list(zip(*(r["eval_losses"][:m] for r in mine)))
            stat = summary["per_variant"][name]["final_eval"]
            ax.plot(steps[:m], [statistics.fmean(v) for v in ecols], color=c, marker="o", ms=3, lw=1.2,
                    label=f"{name} (final {stat['mean']:.4f} ± {stat['std']:.4f})")  # fmt: skip
            if len(mine) > 1:
                ax.fill_between(steps[:m], [min(v) for v in ecols], [max(v) for v in ecols], color=c, alpha=0.2, lw=0)
            if name != "bf16":
                rel = relative_eval_curves(runs, name)
                ax = axes[0][2]
                for xs, ys in rel.values():
                    ax.plot(xs, [y * 100 for y in ys], color=c, lw=0.6, alpha=0.5)
                if rel:
                    k = min(len(ys) for _, ys in rel.values())
                    xs = next(iter(rel.values()))[0][:k]
                    mean = [statistics.fmean(ys[j] for _, ys in rel.values()) * 100 for j in range(k)]
                    ax.plot(xs, mean, color=c, lw=1.8, marker="o", ms=3, label=f"{name} - bf16 (thin: each seed)")
    axes[0][0].set_yscale("log")
    axes[0][0].set_xlabel("step")
    axes[0][0].set_ylabel("training loss (mean over seeds; band: min-max)")
    if has_eval:
        axes[0][1].set_xlabel("step")
        axes[0][1].set_ylabel("held-out loss")
        if summary["floor"] is not None:
            axes[0][1].axhline(summary["floor"]["nats_per_token"], color="k", ls="--", lw=0.8, label="entropy floor")
        bar = summary["max_rel_diff"] * 100
        axes[0][2].axhspan(-bar, bar, color="g", alpha=0.08, label=f"±{bar:g}% bar")
        axes[0][2].axhline(0, color="k", lw=0.6)
        axes[0][2].set_xlabel("step")
        axes[0][2].set_ylabel("held-out loss vs same-seed bf16 (%)")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    rel, half = summary["rel_diff"], summary["rel_ci95"]
    what = "held-out" if has_eval else "final training"
    diff = "no pair" if rel is None else f"{rel * 100:+.2f}%" + (f" ± {half * 100:.2f}% (95%)" if half else "")
    fig.suptitle(
        f"SFT {summary['model']}, {summary['data']}, {summary['steps']} steps, seeds {summary['seeds']}: "
        f"{summary['primary']} - bf16 {what} loss {diff} ({summary['verdict']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def relative_eval_curves(runs: dict, variant: str) -> dict[int, tuple[list[int], list[float]]]:
    """Per seed: the eval steps and ``(variant - bf16) / bf16`` of the held-out loss at each (same-seed pairs)."""
    out = {}
    for r in runs.values():
        base = runs.get(run_key("bf16", r["seed"]))
        if r["variant"] != variant or base is None or not r["eval_losses"] or not base["eval_losses"]:
            continue
        k = min(len(r["eval_losses"]), len(base["eval_losses"]))
        ys = [(v - b) / b for v, b in zip(r["eval_losses"][:k], base["eval_losses"][:k])]
        out[r["seed"]] = (r["eval_steps"][:k], ys)
    return out


def _fmt(stat: dict | None) -> str:
    return "-" if not stat or stat["mean"] is None else f"{stat['mean']:.4f} ± {stat['std']:.4f}"


def report(summary: dict, bar: float) -> None:
    print(f"{'variant':<14} {'seeds':>5}  {'final train loss':>18}  {'held-out loss':>18}  {'excess over floor':>18}")
    for name, e in summary["per_variant"].items():
        n = e["final_loss"]["n"]
        print(f"{name:<14} {n:>5}  {_fmt(e['final_loss']):>18}  {_fmt(e.get('final_eval')):>18}  "
              f"{_fmt(e.get('excess_eval')):>18}")  # fmt: skip
    if summary["floor"] is not None:
        f = summary["floor"]
        print(f"floor: {f['nats_per_token']:.4f} nats per trained token ({f['nats_per_word']:.4f} per word, "
              f"{f['rows']} held-out rows)")  # fmt: skip
    for name, by_metric in summary["paired"].items():
        for metric, p in by_metric.items():
            if p is None:
                continue
            trio = zip(p["seeds"], p["diffs"], p["rel_diffs"])
            per_seed = ", ".join(f"s{s} {d:+.4f} ({r * 100:+.2f}%)" for s, d, r in trio)
            ci = f", 95% ±{p['rel_ci95'] * 100:.2f}%" if p["rel_ci95"] is not None else ""
            print(f"{name} - bf16, {metric}: {per_seed}; mean {p['mean']:+.4f} ± {p['std']:.4f} (std) = "
                  f"{p['rel_diff'] * 100:+.3f}% of bf16{ci}")  # fmt: skip
    if summary["rel_diff"] is not None:
        ci = f" ± {summary['rel_ci95'] * 100:.2f}% (95%)" if summary["rel_ci95"] is not None else " (one seed)"
        extra = ""
        if summary.get("excess_rel_diff") is not None:
            extra = f"; {summary['excess_rel_diff'] * 100:+.1f}% of bf16's excess over the floor"
        print(f"{summary['primary']} vs bf16, {summary['metric']}: {summary['rel_diff'] * 100:+.3f}%{ci}{extra} "
              f"-> {summary['verdict'].upper()} the {bar * 100:.1f}% bar")  # fmt: skip


def write(summary: dict, out: Path, with_plot: bool) -> None:
    tmp = out / "fp8_loss_curves.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "fp8_loss_curves.json")
    if with_plot:
        plot(summary, out / "fp8_loss_curves.png")


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args, out)
    if args.eval_every > 0 and data[1] is None:
        print("--eval-every: no held-out data (give --eval-data for a non-builtin --data); training losses only")
    reused = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    runs: dict[str, dict] = {}
    floor, done, slowest = None, [], 0.0
    for i, seed in enumerate(args.seed_list):
        elapsed = time.perf_counter() - t_start
        if args.budget_s > 0 and i > 0 and elapsed + slowest > args.budget_s:
            print(f"budget: seed {seed} not started ({elapsed:.0f} s used, the slowest seed took {slowest:.0f} s, "
                  f"--budget-s {args.budget_s:.0f}); stopping after seeds {done}")  # fmt: skip
            break
        t_seed = time.perf_counter()
        model = init_model(args, out, seed)
        if floor is None and i == 0 and data[1] is not None and args.data.startswith("builtin:"):
            floor = loss_floor(args, model, data[1])
        for name in args.names:
            key = run_key(name, seed)
            rec = reused_record(reused, name, seed, args.seed_list[0], args.final_window)
            if rec is not None:
                print(f"{key}: reused from {args.reuse}")
            else:
                rec = train(args, model, data, out / key, name, seed)
            runs[key] = rec
            ev = f", held-out {rec['final_eval']:.4f}" if rec.get("final_eval") is not None else ""
            print(f"{key}: final train loss {rec['final_loss']:.4f} (last {args.final_window} steps){ev}; "
                  f"{rec.get('wall_s', 0):.0f} s wall, {rec.get('step_time_s', 0):.0f} s of steps, "
                  f"{rec.get('epochs', 0):.2f} epochs of the data")  # fmt: skip
            write(summarize(args, runs, floor, done + [seed]), out, with_plot=False)
        done.append(seed)
        slowest = max(slowest, time.perf_counter() - t_seed)
        write(summarize(args, runs, floor, done), out, with_plot=True)
    summary = summarize(args, runs, floor, done)
    write(summary, out, with_plot=True)
    report(summary, args.max_rel_diff)
    print(f"json {out / 'fp8_loss_curves.json'}, plot {out / 'fp8_loss_curves.png'}; "
          f"{time.perf_counter() - t_start:.0f} s in all")  # fmt: skip
    return 0 if summary["within_bar"] else 1


if __name__ == "__main__":
    sys.exit(main())
