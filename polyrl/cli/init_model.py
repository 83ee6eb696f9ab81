"""``polyrl init-model --preset NAME --out DIR [--seed N]``: write a random-initialised HF checkpoint.

Thin wrapper over ``polyrl.models.presets.create_model_from_preset``; it only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import time

from polyrl.cli.outdir import check_replaceable
from polyrl.models.checkpoint import dtype_from_name
from polyrl.models.presets import PRESETS, create_model_from_preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(f"{n} ({p.description})" for n, p in PRESETS.items())
    # choices=PRESETS (not a list): its `in` also takes a -LN layer-prefix name (qwen3-30b-a3b-L8)
    parser.add_argument(
        "--preset", required=True, choices=PRESETS, metavar="NAME", help=f"one of: {names} (-LN: first N layers)"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output folder (a model folder there is replaced atomically; any other non-empty folder is refused)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="weight dtype (default: per preset)"
    )


def run(args: argparse.Namespace) -> int:
    check_replaceable(args.out, "init-model")
    start = time.perf_counter()
    dtype = dtype_from_name(args.dtype) if args.dtype else None
    out = create_model_from_preset(args.preset, args.out, seed=args.seed, dtype=dtype)
    print(f"wrote {args.preset} checkpoint to {out} in {time.perf_counter() - start:.1f}s")
    return 0
