"""``polyrl export --adapter DIR [--base BASE] --merge --out DIR``: a LoRA adapter merged into its base, written
as a plain Hugging Face folder (safetensors, config, tokenizer) that transformers and ``polyrl serve`` load.

The base comes from ``--base`` (alias ``--model``) or the adapter's ``base_model_name_or_path`` (as given when it was
trained; a relative path is looked up from the current directory, then beside the adapter folder); it is loaded in
fp32, ``W + s * B @ A`` is formed there and the result saved in the base's dtype (or ``--dtype``). An adapter
trained on a 4-bit (QLoRA) base is merged into the full-precision base, as PEFT does.

``--out`` is replaced whole when it is a model folder (refused when it holds anything else, ``outdir.py``), and never
when it is, or holds, the adapter or the base being read: that would delete the input. A full model or a training
checkpoint given as ``--adapter`` is refused naming what it is (a LoRA checkpoint's adapter is its ``model/``).
Not here: training, un-merged adapter copies.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from polyrl.cli.outdir import check_replaceable
from polyrl.errors import ConfigError
from polyrl.models.checkpoint import dtype_from_name, load_config, load_model, save_model
from polyrl.models.config import run_dir_hint
from polyrl.models.lora import base_model_path, is_adapter_dir, load_adapter, unwrap_lora


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapter", metavar="DIR", help="PEFT adapter folder (adapter_config.json)")
    parser.add_argument(
        "--base",
        "--model",
        dest="model",
        metavar="DIR",
        help="base model folder (default: the base_model_name_or_path in the adapter's adapter_config.json)",
    )
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base (required)")
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output HF folder (a model folder there is replaced atomically; never the adapter or base folder)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="saved dtype (default: the base's)")


def run(args: argparse.Namespace) -> int:
    if not args.adapter or not args.merge:
        raise ConfigError("polyrl export writes a merged model: pass --adapter DIR --merge (and --out DIR)")
    if not is_adapter_dir(args.adapter):
        raise ConfigError(f"--adapter {args.adapter} has no adapter_config.json; {_not_adapter_hint(args.adapter)}")
    check_replaceable(args.out, "export")
    start = time.perf_counter()
    base = base_model_path(args.adapter, args.model)
    _check_out_keeps_inputs(args.out, {"adapter": args.adapter, "base": base})
    saved = dtype_from_name(args.dtype or load_config(base).torch_dtype)
    model = load_model(base, dtype=torch.float32)
    load_adapter(model, args.adapter)
    unwrap_lora(model, merge=True)
    tok_src = args.adapter if _has_tokenizer(args.adapter) else base
    out = save_model(model, args.out, tokenizer=tok_src, dtype=saved)
    print(f"merged {args.adapter} into {base} -> {out} ({str(saved).removeprefix('torch.')}) in "
          f"{time.perf_counter() - start:.1f}s")  # fmt: skip
    return 0


def _not_adapter_hint(folder: str) -> str:
    """What ``--adapter`` was given instead of an adapter folder, and what to give."""
    path = Path(folder)
    if (path / "model" / "adapter_config.json").is_file() and (path / "manifest.json").is_file():
        return f"it is a polyrl checkpoint of a LoRA run; its adapter is --adapter {path / 'model'}"
    if (path / "model" / "config.json").is_file() and (path / "manifest.json").is_file():
        return (
            f"it is a polyrl checkpoint of a full fine-tune, whose weights {path / 'model'} are a whole model already "
            "(nothing to merge): load that folder as it is"
        )
    if (path / "config.json").is_file():
        return (
            f"{folder} is a whole model (config.json, no adapter): a full fine-tune has nothing to merge; load or "
            f"serve it as it is (polyrl serve --model {folder})"
        )
    hint = run_dir_hint(folder)
    return f"give a PEFT adapter folder{': ' + hint if hint else ''}"


def _check_out_keeps_inputs(out: str, inputs: dict[str, str]) -> None:
    """``--out`` is replaced whole: refused when it is the adapter or base folder, or a folder holding one of them
    (``--out runs/lora/final`` replaced the adapter it merged, ``--out BASE`` the base other adapters need)."""
    target = Path(out).resolve()
    for what, folder in inputs.items():
        src = Path(folder).resolve()
        if src == target or src.is_relative_to(target):
            where = "is" if src == target else "holds"
            raise ConfigError(
                f"--out {out} {where} the {what} folder {folder}, which the export would replace (it replaces its "
                f"--out whole); give another --out, e.g. {Path(folder).parent / (Path(folder).name + '-merged')}"
            )


def _has_tokenizer(folder: str) -> bool:
    return (Path(folder) / "tokenizer_config.json").is_file() or (Path(folder) / "tokenizer.json").is_file()
