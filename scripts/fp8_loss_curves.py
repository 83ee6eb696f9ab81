"""FP8 training numerics evidence (issue 28): the same N-step SFT run in bf16 and with ``--precision fp8``, same model,
data and seed, both loss curves in one PNG and the final-loss difference.

    python scripts/fp8_loss_curves.py --preset qwen3-0.6b-shape --steps 300 --out runs/fp8_curves   # on an FP8 GPU
    POLYRL_KERNELS=fp8_scaled_mm:reference python scripts/fp8_loss_curves.py --preset tiny --steps 20 --out /tmp/c

Each run is ``polyrl.fit("sft", ...)`` (the CLI's code path) into ``<out>/bf16`` and ``<out>/fp8``; the model is
``--model`` or, by default, a random-initialised ``--preset`` written once to ``<out>/init``. The final loss of a
run is the mean of its last ``--final-window`` step losses (one step's loss is one batch's: noisy). Writes
``<out>/fp8_loss_curves.png`` and ``<out>/fp8_loss_curves.json`` and prints one line per run plus the relative
difference; exit status 1 when it exceeds ``--max-rel-diff`` (the issue's bar: 1%).

``--variants`` adds diagnostic runs beside the pair (all against ``bf16``): ``fp8-rowwise`` (row-wise forward
scaling), ``fp8-grad-e4m3`` / ``fp8-grad-bf16`` (the gradient dY cast to e4m3 / not quantised:
``fp8_linear.GRAD_DTYPE``), ``bf16-seed1`` (bf16 with another data-order seed: how far two bf16 runs land apart).
``--reuse JSON`` takes the curves of runs already in an earlier ``fp8_loss_curves.json`` instead of training them
again (same model, data and steps assumed).

Not here: speed (``polyrl bench sft --precision both``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# name -> (FP8 linears, fp8_scaling override, fp8_linear.GRAD_DTYPE, seed offset)
VARIANTS = {
    "bf16": (False, None, "e5m2", 0),
    "fp8": (True, None, "e5m2", 0),
    "fp8-rowwise": (True, "rowwise", "e5m2", 0),
    "fp8-grad-e4m3": (True, None, "e4m3", 0),
    "fp8-grad-bf16": (True, None, "bf16", 0),
    "bf16-seed1": (False, None, "e5m2", 1),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (runs, PNG, JSON)")
    p.add_argument("--model", help="HF model folder to start from (default: a random --preset model)")
    p.add_argument("--preset", default="qwen3-0.6b-shape", help="polyrl init-model preset when --model is not given")
    p.add_argument("--data", default="builtin:arithmetic?n=50000", help="dataset spec (as polyrl train --data)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--fp8-scaling", choices=["tensorwise", "rowwise"], default="tensorwise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--final-window", type=int, default=10, help="steps averaged into the final loss")
    p.add_argument("--variants", default="bf16,fp8", help=f"comma list of runs, from {', '.join(VARIANTS)}")
    p.add_argument("--reuse", help="an earlier fp8_loss_curves.json whose runs are reused by name")
    p.add_argument("--max-rel-diff", type=float, default=0.01, help="exit 1 when |fp8 - bf16| / bf16 is larger")
    return p.parse_args(argv)


def train(args: argparse.Namespace, model: Path, out: Path, variant: str) -> list[float]:
    # lazy: the script's own imports stay light for --help
    from polyrl.models import fp8_linear
    from polyrl.trainer import fit

    fp8, scaling, grad_dtype, seed_offset = VARIANTS[variant]
    fp8_linear.GRAD_DTYPE = grad_dtype

    fit(
        "sft",
        model,
        # fixed shapes: one CUDA graph replays every step (packed shapes vary, and each repeat would capture anew)
        {"path": args.data, "max_seq_len": args.max_seq_len, "fixed_shapes": True},
        out,
        seed=args.seed + seed_offset,
        train={"max_steps": args.steps, "log_every": max(1, args.steps // 20)},
        optim={"lr": args.lr},
        schedule={"warmup_steps": min(args.warmup_steps, max(0, args.steps - 1)), "decay": "cosine"},
        engine={"micro_batch_tokens": args.micro_batch_tokens},
        precision={"linear": "fp8" if fp8 else "default", "fp8_scaling": scaling or args.fp8_scaling},
        checkpoint={"every_n_steps": 0},
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["loss"]) for r in rows if "loss" in r and "step" in r]


def final_loss(losses: list[float], window: int) -> float:
    tail = losses[-max(1, window) :]
    return sum(tail) / len(tail)


def plot(curves: dict[str, list[float]], summary: dict, path: Path) -> None:
    # lazy: matplotlib is the optional plot extra
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=f"{name} (final {summary[name]['final_loss']:.4f})", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(
        f"SFT {summary['model']}: bf16 vs FP8 ({summary['fp8_scaling']}), final-loss difference "
        f"{summary['rel_diff'] * 100:+.2f}%",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        # lazy: as train() above
        from polyrl.models.presets import create_model_from_preset

        model = out / "init"
        if not (model / "config.json").exists():
            create_model_from_preset(args.preset, model, seed=args.seed)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or "bf16" not in names:
        raise SystemExit(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)}); bf16 must be one of them")
    reused = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    curves = {}
    for name in names:
        if isinstance(reused.get(name), dict) and "losses" in reused[name]:
            curves[name] = reused[name]["losses"]
            print(f"{name}: reused from {args.reuse}")
        else:
            curves[name] = train(args, model, out / name, name)
    summary: dict = {"model": args.model or args.preset, "data": args.data, "steps": args.steps}
    summary["fp8_scaling"] = args.fp8_scaling
    base = final_loss(curves["bf16"], args.final_window)
    for name, losses in curves.items():
        fl = final_loss(losses, args.final_window)
        summary[name] = {"final_loss": fl, "last_loss": losses[-1], "rel_diff": (fl - base) / base, "losses": losses}
    primary = "fp8" if "fp8" in curves else names[-1]
    summary["rel_diff"] = summary[primary]["rel_diff"]
    summary["within_bar"] = abs(summary["rel_diff"]) <= args.max_rel_diff
    (out / "fp8_loss_curves.json").write_text(json.dumps(summary, indent=2))
    plot(curves, summary, out / "fp8_loss_curves.png")
    for name in curves:
        print(
            f"{name}: final loss {summary[name]['final_loss']:.4f} (mean of last {args.final_window} steps), "
            f"{summary[name]['rel_diff'] * 100:+.3f}% vs bf16"
        )
    print(
        f"{primary} vs bf16 final loss: {summary['rel_diff'] * 100:+.3f}% (bar {args.max_rel_diff * 100:.1f}%: "
        f"{'within' if summary['within_bar'] else 'OUTSIDE'}); plot {out / 'fp8_loss_curves.png'}"
    )
    return 0 if summary["within_bar"] else 1


if __name__ == "__main__":
    sys.exit(main())
