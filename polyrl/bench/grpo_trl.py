"""The TRL row of ``polyrl bench grpo``: TRL's ``GRPOTrainer`` (transformers ``generate``, no vLLM) on the same model
folder, prompts and lengths as our step, in named settings (``TRL_CONFIGS``), each timed per optimizer step.

Written for TRL 1.16.0 (``TRL_PINNED``; another version runs with a printed note, and fields it lacks are dropped
with a note). In every setting one optimizer step consumes exactly one generation batch of ``--prompts`` x ``--n``
completions (``generation_batch_size`` = the batch, ``gradient_accumulation_steps`` = batch / completions per
forward-backward, so ``steps_per_generation`` = the accumulation and TRL skips its old-log-prob pass), as ours does:

- ``fast``: 64 completions per forward/backward, no forced minimum length (the setting a new user of TRL 1.16 would
  pick for this shape; TRL's other defaults, gradient checkpointing on);
- ``fast-nogc``: the same without gradient checkpointing (faster when it fits; an out-of-memory is reported);
- ``old``: the earlier row (16 completions per forward/backward, ``min_new_tokens`` = ``--gen-len``), kept to show
  what the old claim rested on.

Each row prints TRL's mean completion length (its own ``completions/mean_length`` log): without a forced minimum a
completion may end at EOS, so a shorter mean means less work per step. Not here: our step, ratios (``bench/grpo.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from polyrl.platform import device

TRL_PINNED = "1.16.0"
# name -> (what it is, completions per forward/backward, force min_new_tokens = gen-len, gradient_checkpointing or
# None for TRL's default)
TRL_CONFIGS: dict[str, tuple[str, int, bool, bool | None]] = {
    "fast": ("no forced minimum length", 64, False, None),
    "fast-nogc": ("no forced minimum length", 64, False, False),
    "old": ("the earlier row: min_new_tokens = gen-len", 16, True, None),
}


def prompt_texts(count: int, prompt_len: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    return [" ".join(words[(i + j) % len(words)] for j in range(prompt_len // 2)) + f" {i}" for i in range(count)]


def dummy_reward(token_ids: list[int]) -> float:
    """Deterministic pseudo-random reward in [0, 1) of a completion (non-zero group advantages, no work)."""
    return (sum((i + 1) * t for i, t in enumerate(token_ids[:32])) % 1000) / 1000.0


def trl_run(model_dir: Path, args: argparse.Namespace, dev: torch.device, name: str) -> dict[str, Any]:
    """Per-step wall times and mean completion lengths of TRL's GRPOTrainer in setting ``name``."""
    # lazy: TRL and what it runs on (datasets, transformers) are the optional baseline, imported only when it runs
    import datasets
    import transformers
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    _, micro_batch, force_len, ckpt = TRL_CONFIGS[name]
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            device.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            device.synchronize()
            times.append(time.perf_counter() - self.t)

    def reward(completions: list[Any], **kw: Any) -> list[float]:
        return [dummy_reward([ord(c) for c in str(x)]) for x in completions]

    bf16 = dev.type != "cpu"
    total = args.prompts * args.n
    micro = max(args.n, min(micro_batch, total))
    while total % micro or micro % args.n:
        micro -= 1  # a divisor of the batch that holds whole groups
    wanted: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="polyrl-bench-trl-"),
        per_device_train_batch_size=micro,
        num_generations=args.n,
        gradient_accumulation_steps=total // micro,
        generation_batch_size=total,  # one generate call per optimizer step
        max_completion_length=args.gen_len,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-6,
        bf16=bf16,
        use_vllm=False,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        logging_steps=1,  # completions/mean_length every step (logged after on_step_end: outside the timed step)
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=dev.type == "cpu",
    )
    if force_len:
        wanted["generation_kwargs"] = {"min_new_tokens": args.gen_len}
    if ckpt is not None:
        wanted["gradient_checkpointing"] = ckpt
    known = {f.name for f in dataclasses.fields(TRLConfig)}
    dropped = sorted(set(wanted) - known)
    if dropped:
        print(f"# this TRL version has no {dropped}; left at its defaults")
    cfg = TRLConfig(**{k: v for k, v in wanted.items() if k in known})
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16 if bf16 else torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    data = datasets.Dataset.from_dict({"prompt": prompt_texts(args.prompts, args.prompt_len) * (cfg.max_steps + 1)})
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok, callbacks=[Timer()]
    )
    try:
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    finally:
        del trainer, model
        device.empty_cache()
    return {"times": times, "lengths": lengths, "micro": micro, "grad_ckpt": bool(cfg.gradient_checkpointing)}


def trl_rows(model_dir: Path, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """Time each ``--trl-configs`` setting; the result keys ``trl_<name>_*`` and, of the fastest, ``trl_step_s``."""
    try:
        # lazy: whether the optional TRL baseline can run here is this import
        import trl
    except ImportError:
        print(f"# trl is not importable: TRL baseline skipped (pip install trl=={TRL_PINNED})")
        return {}
    note = "" if trl.__version__ == TRL_PINNED else f" (the row was written for TRL {TRL_PINNED})"
    print(f"# TRL {trl.__version__}{note}")
    res: dict[str, Any] = {"trl_version": trl.__version__}
    names = [x.strip() for x in str(args.trl_configs).split(",") if x.strip()]
    unknown = [x for x in names if x not in TRL_CONFIGS]
    if unknown:
        print(f"# unknown --trl-configs {unknown}: skipped (known: {', '.join(TRL_CONFIGS)})")
    for name in [x for x in names if x in TRL_CONFIGS]:
        try:
            r = trl_run(model_dir, args, dev, name)
        except torch.OutOfMemoryError:
            print(f"# TRL {name} ({TRL_CONFIGS[name][0]}) ran out of memory")
            device.empty_cache()
            continue
        times = r["times"]
        steady = statistics.median(times[args.warmup :] or times)
        length = statistics.mean(r["lengths"][args.warmup :] or r["lengths"]) if r["lengths"] else None
        res.update({f"trl_{name}_first_step_s": times[0], f"trl_{name}_step_s": steady})
        res[f"trl_{name}_completion_len"] = length
        shown = f"{length:.0f}" if length is not None else "?"
        print(
            f"# TRL {name} ({TRL_CONFIGS[name][0]}; {r['micro']} per fwd/bwd, gradient checkpointing "
            f"{'on' if r['grad_ckpt'] else 'off'}): first step {times[0]:.2f}s, steady {steady:.2f}s, "
            f"mean completion {shown} tokens"
        )
        if res.get("trl_step_s") is None or steady < res["trl_step_s"]:
            res.update(trl_step_s=steady, trl_first_step_s=times[0], trl_config=name, trl_completion_len=length)
    return res
