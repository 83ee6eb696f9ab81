"""``polyrl eval``: evaluate a model folder (HF checkpoint or PEFT adapter) through the rollout engine, in-process.

- lm-eval-harness tasks: ``polyrl eval --model DIR --tasks T1,T2 [--include-path DIR] [--limit N]`` (the lm-eval
  model ``polyrl``; needs the ``eval`` extra). The bundled tasks (``polyrl_arith_mc``, ``polyrl_arith_gen``,
  ``polyrl_text_ppl``) need no download.
- rewards: ``polyrl eval --model DIR --data SPEC --reward R --n K`` (mean reward, pass@1, unbiased pass@k, mean
  length) on any data the trainer reads.

Prints a table and writes the numbers as JSON (``--output``, default ``eval.json`` beside nothing: the current
folder). A thin wrapper: argument parsing, progress and printing; the work is in ``polyrl.eval``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from polyrl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint folder, or a PEFT adapter folder")
    parser.add_argument("--base", default=None, help="the base model folder of a PEFT adapter (if it moved)")
    what = parser.add_argument_group("lm-eval-harness tasks")
    what.add_argument("--tasks", default=None, help="comma-separated lm-eval task names")
    what.add_argument("--include-path", default=None, help="a folder of extra lm-eval task YAML files")
    what.add_argument("--num-fewshot", type=int, default=None)
    what.add_argument("--apply-chat-template", action="store_true", help="wrap prompts in the model's chat template")
    rew = parser.add_argument_group("reward evaluation")
    rew.add_argument("--data", default=None, help="a data spec the trainer reads (file, folder, builtin:NAME, ...)")
    rew.add_argument("--reward", default=None, help="reward: a builtin name, file.py:fn, or a weighted sum")
    rew.add_argument("--n", type=int, default=1, help="samples per prompt, pass@k up to n (default 1)")
    rew.add_argument("--temperature", type=float, default=None, help="default: greedy for n = 1, else 1.0")
    rew.add_argument("--max-tokens", type=int, default=256, help="maximum generated tokens per sample (default 256)")
    rew.add_argument(
        "--pass-threshold", type=float, default=1.0, help="a sample passes when reward >= this (default 1.0)"
    )
    rew.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=float, default=None, help="evaluate only the first N documents / prompts")
    parser.add_argument("--output", default="eval.json", help="where the JSON results go (default eval.json)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--device", default=None, help="torch device (default: the accelerator, else cpu)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per engine step (default 256)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per forward (scoring batches, prefill steps); default 32768 on an accelerator, 8192 on the CPU",
    )


def run(args: argparse.Namespace) -> int:
    if (args.tasks is None) == (args.data is None):
        raise UserError("give either --tasks T1,T2 (lm-eval tasks) or --data SPEC --reward R (reward evaluation)")
    if args.data is not None and not args.reward:
        raise UserError("--data needs --reward (e.g. --reward exact_match, or file.py:fn)")
    _check_numbers(args)
    _check_output(args.output)
    # lazy: torch and the engine load only when a subcommand runs (polyrl env stays light)
    from polyrl.cli.model_arg import require_tokenizer
    from polyrl.eval.loading import eval_engine, load_eval_model
    from polyrl.eval.rewards import check_reward_eval
    from polyrl.platform.device import parse_device

    if args.device is not None:  # an unknown or absent device before anything loads
        parse_device(args.device)
    require_tokenizer(args.model)

    start = time.perf_counter()
    prompts, checked = None, None
    if args.tasks is not None:  # unknown task names before the model loads
        checked = _check_tasks(args)
    if args.data is not None:  # data, reward and sampling errors before the model loads
        limit = int(args.limit) if args.limit is not None else None
        prompts = check_reward_eval(args.data, args.reward, args.n, args.temperature, limit)
    model, tokenizer = load_eval_model(args.model, args.dtype, args.device, args.base)
    llm = eval_engine(
        model,
        tokenizer,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    loaded = time.perf_counter() - start
    if args.tasks is not None:
        report = _tasks(args, llm, checked)
    else:
        report = _rewards(args, llm, prompts)
    report.update(model=args.model, load_s=round(loaded, 3), total_s=round(time.perf_counter() - start, 3))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=_plain) + "\n")
    print(f"# results written to {out}", file=sys.stderr)
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric options, before anything loads: each either meant something else or was taken silently."""
    limit = args.limit
    if limit is not None:
        if not math.isfinite(limit) or limit <= 0:
            raise UserError(f"--limit must be > 0, got {limit}")
        if args.data is not None and limit != int(limit):
            raise UserError(f"--limit with --data is a number of prompts (a whole number >= 1), got {limit}")
        if limit > 1 and limit != int(limit):
            raise UserError(
                f"--limit must be a whole number of documents, or a fraction below 1 of each task, got {limit}"
            )
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.data is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1 (tokens generated per sample), got {args.max_tokens}")
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise UserError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")


def _check_output(output: str) -> None:
    """``--output`` must be a file that can be written: it is written last, so a folder given there, a file on its
    path or a folder this user cannot write ended the evaluation with a traceback and its results unsaved."""
    # lazy: the run config module (torch, the algorithms) loads only when a subcommand runs
    from polyrl.run.config import nearest_existing

    path = Path(output).absolute()
    existing, blocked = nearest_existing(path)
    if blocked is not None:
        raise UserError(f"--output {output} cannot be reached: {existing} may not be entered; give another path")
    if existing == path and path.is_dir():
        raise UserError(f"--output {output} is a folder; give the JSON file to write, e.g. {Path(output, 'eval.json')}")
    if existing != path and not existing.is_dir():
        raise UserError(f"--output {output} cannot be written: {existing} is a file, not a folder; give another path")
    if not os.access(existing, os.W_OK):
        raise UserError(f"--output {output} cannot be written: no write permission on {existing}; give another path")


def _check_tasks(args: argparse.Namespace) -> tuple[list[str], Any]:
    """The task names and lm-eval's task manager, every name checked (before the model loads)."""
    try:
        # lazy: lm-eval is the optional `eval` extra
        from polyrl.eval.harness import check_tasks
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("lm_eval"):
            raise UserError("polyrl eval --tasks needs lm-eval-harness: pip install -e '.[eval]'") from None
        raise
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty; give task names separated by commas")
    return tasks, check_tasks(tasks, args.include_path)


def _tasks(args: argparse.Namespace, llm: Any, checked: tuple[list[str], Any]) -> dict[str, Any]:
    # lazy: lm-eval is the optional `eval` extra (present: _check_tasks imported it)
    from polyrl.eval.harness import result_rows, run_tasks

    tasks, manager = checked
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    t0 = time.perf_counter()
    results = run_tasks(
        llm, tasks, args.include_path, limit, args.num_fewshot, args.apply_chat_template, task_manager=manager
    )
    rows = result_rows(results)
    _table(
        ["task", "metric", "value", "stderr"],
        [(t, m, f"{v:.4f}", "" if e is None else f"{e:.4f}") for t, m, v, e in rows],
    )
    return {
        "mode": "lm-eval",
        "tasks": tasks,
        "limit": limit,
        "results": {t: {m: v for tt, m, v, _ in rows if tt == t} for t in results["results"]},  # groups' subtasks too
        "stderr": {t: {m: e for tt, m, _, e in rows if tt == t and e is not None} for t in results["results"]},
        "n_samples": results.get("n-samples", {}),
        "eval_s": round(time.perf_counter() - t0, 3),
    }


def _rewards(args: argparse.Namespace, llm: Any, prompts: list[Any] | None) -> dict[str, Any]:
    # lazy: the data and reward stack load only for reward evaluation
    from rich.progress import Progress

    from polyrl.eval.rewards import reward_eval

    t0 = time.perf_counter()
    with Progress(transient=True) as bar:
        job = bar.add_task("generating", total=None)
        res = reward_eval(
            llm,
            args.data,
            args.reward,
            n=args.n,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            threshold=args.pass_threshold,
            limit=int(args.limit) if args.limit is not None else None,
            seed=args.seed,
            progress=lambda done, total: bar.update(job, completed=done, total=total),
            prompts=prompts,
        )
    _table(["metric", "value"], res.rows())
    return {"mode": "reward", **res.as_dict(), "eval_s": round(time.perf_counter() - t0, 3)}


def _table(header: list[str], rows: list[tuple]) -> None:
    # lazy: rich is only needed for printing
    from rich.console import Console
    from rich.table import Table

    table = Table(*header)
    for row in rows:
        table.add_row(*[str(x) for x in row])
    Console().print(table)


def _plain(x: Any) -> Any:
    """JSON for numpy scalars and anything else lm-eval puts in its results."""
    if hasattr(x, "item"):
        return x.item()
    return str(x)
