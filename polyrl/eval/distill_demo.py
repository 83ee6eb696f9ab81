"""``polyrl demo --distill``: on-policy distillation of a ``small`` arithmetic teacher into a ``tiny`` student (CPU).

Stages (each through the same RunConfig + runner as ``polyrl train``):

1. teacher: a random ``small`` model SFT'd on clean demonstrations of the task (cached under ``<out>/teacher``: a
   second run with the same settings reuses it); its own held-out accuracy is measured first, since a student
   can only be pulled towards what the teacher knows.
2. student: a random ``tiny``-shaped model (hidden 64, 2 layers) with the TEACHER's tokenizer (so its vocabulary is
   the small preset's 4096: distillation compares log-probs of the same token ids), SFT'd on flawed demonstrations
   (``noise``: most answers off by one), so it samples the right answer sometimes and greedily often prefers a wrong
   one. 600 steps: at 300 one seed of three stayed on the loss plateau (3.5% held-out), where the student's samples
   hold no answer for the teacher to sharpen and distillation moved nothing.
3. distill: ``polyrl train --algo distill --teacher <teacher>``: the student samples, the teacher scores those exact
   tokens, per-token reverse KL as the negative advantage. Held-out exact match before and after, the reverse KL
   per step.

Not here: the algorithm (``polyrl.algorithms.distill``), the main SFT -> GRPO demo (``polyrl.cli.demo``).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl import run as runner
from polyrl.data.config import DataConfig
from polyrl.data.dataset import load_prompts
from polyrl.models import tokenizer as tk
from polyrl.models.checkpoint import load_model, load_tokenizer, save_model
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import build_model
from polyrl.models.presets import create_model_from_preset, get_preset
from polyrl.run import config as run_config
from polyrl.run.evaluate import exact_match

TASK = "builtin:arithmetic?max=99&max_b=2&ops=+&test=0.2"


@dataclass
class DistillDemo:
    """The demo's settings (the defaults are the measured recipe; its numbers, seeds 0-2, are in the README:
    held-out exact match 43.9/24.6/36.8% -> 82.5/71.9/89.5% after 40 distillation steps)."""

    out: str = "runs/demo-distill"
    seed: int = 0
    task: str = TASK
    noise: float = 0.6  # the student's flawed demonstrations
    teacher_preset: str = "small"
    teacher_steps: int = 300
    teacher_lr: float = 1e-3
    student_steps: int = 600
    student_lr: float = 3e-3
    distill_steps: int = 40
    distill_lr: float = 1e-3
    prompts_per_step: int = 16
    samples_per_prompt: int = 4
    max_new_tokens: int = 8
    eval_size: int = 100
    micro_batch_tokens: int = 1024


def _log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def accuracy(model_dir: Path, task: str, n: int) -> float:
    """Greedy held-out exact match of ``model_dir`` on the task's test split (first ``n`` problems)."""
    prompts, _ = load_prompts(DataConfig(path=task + "@test"))
    res = exact_match(load_model(model_dir), load_tokenizer(model_dir), prompts[:n], max_tokens=8, keep_samples=0)
    return res.accuracy


def tiny_student(teacher_base: Path, out: Path, seed: int) -> Path:
    """A random ``tiny``-shaped model with the teacher's tokenizer (and so its vocabulary size)."""
    tok = load_tokenizer(teacher_base)
    cfg = ModelConfig.from_hf_dict({**get_preset("tiny").hf, "vocab_size": len(tok), **_special_ids(tok)})
    model = build_model(cfg, dtype=get_preset("tiny").dtype, device="cpu", seed=seed)
    return save_model(model, out, tokenizer=tok, generation_config={"do_sample": True, "temperature": 1.0})


def _special_ids(tok: Any) -> dict[str, Any]:
    return {
        "bos_token_id": None,
        "eos_token_id": tok.convert_tokens_to_ids(tk.EOS_TOKEN),
        "pad_token_id": tok.convert_tokens_to_ids(tk.PAD_TOKEN),
    }


def _sft(model: Path, out: Path, task: str, steps: int, lr: float, d: DistillDemo) -> Path:
    raw = {
        "algo": "sft",
        "model": str(model),
        "out": str(out),
        "seed": d.seed,
        "data": {"path": task, "max_seq_len": 128},
        "engine": {"micro_batch_tokens": d.micro_batch_tokens},
        "optim": {"lr": lr, "weight_decay": 0.0},
        "schedule": {"warmup_steps": min(10, steps // 10), "decay": "constant"},
        "train": {"max_steps": steps, "log_every": max(1, steps // 4)},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 1},
    }
    runner.run(run_config.build(raw))
    return out / runner.FINAL_DIR


def _distill(student: Path, teacher: Path, out: Path, d: DistillDemo) -> Path:
    raw = {
        "algo": "distill",
        "model": str(student),
        "out": str(out),
        "seed": d.seed,
        "data": {"path": d.task},
        "engine": {"micro_batch_tokens": d.micro_batch_tokens},
        "optim": {"lr": d.distill_lr, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 0, "decay": "constant"},
        "train": {"max_steps": d.distill_steps, "log_every": max(1, d.distill_steps // 8)},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 1},
        "distill": {
            "teacher": str(teacher),
            "reward": "exact_match",
            "reward_workers": 0,
            "prompts_per_step": d.prompts_per_step,
            "samples_per_prompt": d.samples_per_prompt,
            "max_new_tokens": d.max_new_tokens,
        },
    }
    runner.run(run_config.build(raw))
    return out / runner.FINAL_DIR


def teacher_model(d: DistillDemo, t0: float) -> Path:
    """The SFT'd ``small`` teacher, trained once and cached under ``<out>/teacher`` (keyed by its settings)."""
    root = Path(d.out) / "teacher"
    key = {"preset": d.teacher_preset, "task": d.task, "steps": d.teacher_steps, "lr": d.teacher_lr, "seed": d.seed}
    final = root / "sft" / runner.FINAL_DIR
    stamp = root / "settings.json"
    if final.is_dir() and stamp.is_file() and json.loads(stamp.read_text()) == key:
        _log(t0, f"teacher: cached {final}")
        return final
    if root.exists():
        shutil.rmtree(root)
    base = create_model_from_preset(d.teacher_preset, root / "base", seed=d.seed)
    _log(
        t0, f"teacher: SFT of a random {d.teacher_preset} model, {d.teacher_steps} steps on {d.task}, lr {d.teacher_lr}"
    )
    final = _sft(base, root / "sft", d.task, d.teacher_steps, d.teacher_lr, d)
    stamp.write_text(json.dumps(key))
    return final


def run_distill_demo(d: DistillDemo) -> dict[str, float]:
    """The whole demo; returns the accuracies and the first/last reverse KL."""
    t0 = time.perf_counter()
    root = Path(d.out)
    teacher = teacher_model(d, t0)
    for sub in ("student", "distill"):
        if (root / sub).exists():
            shutil.rmtree(root / sub)
    res: dict[str, float] = {"teacher": accuracy(teacher, d.task, d.eval_size)}
    _log(t0, f"teacher: held-out exact match {100 * res['teacher']:.1f}%")
    base = tiny_student(root / "teacher" / "base", root / "student" / "base", d.seed)
    flawed = f"{d.task}&noise={d.noise}" if d.noise else d.task
    _log(t0, f"student: SFT of a random tiny model, {d.student_steps} steps on {flawed}, lr {d.student_lr}")
    student = _sft(base, root / "student" / "sft", flawed, d.student_steps, d.student_lr, d)
    res["before"] = accuracy(student, d.task, d.eval_size)
    _log(t0, f"student before distillation: held-out exact match {100 * res['before']:.1f}%")
    _log(
        t0,
        f"distill: {d.distill_steps} steps of {d.prompts_per_step} prompts x {d.samples_per_prompt} samples, "
        f"lr {d.distill_lr} (polyrl train --algo distill --teacher {teacher})",
    )
    final = _distill(student, teacher, root / "distill", d)
    recs = [json.loads(x) for x in (root / "distill" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["reverse_kl"] for r in recs if "reverse_kl" in r]
    k = max(1, min(5, len(kl) // 4))
    res["kl_first"], res["kl_last"] = sum(kl[:k]) / k, sum(kl[-k:]) / k
    res["after"] = accuracy(final, d.task, d.eval_size)
    _log(t0, f"distill: reverse KL {res['kl_first']:.3f} (first {k} steps) -> {res['kl_last']:.3f} (last {k})")
    _log(t0, f"student after distillation: held-out exact match {100 * res['after']:.1f}%")
    print(
        f"held-out accuracy: teacher {100 * res['teacher']:.1f}%, student before {100 * res['before']:.1f}% -> "
        f"after distillation {100 * res['after']:.1f}%"
    )
    return res


__all__ = ["DistillDemo", "run_distill_demo", "tiny_student"]
