"""``train.keep_best`` under torchrun (2 gloo ranks, FSDP2) on the tiny preset, in ONE spawn of two processes running
four runs in turn (``dist_best_worker``): an offline run (SFT, held-out loss) and an online one (GRPO, greedy and
sampled evaluation through the data-parallel rollout engine), each resumed once.

- The evaluation is the global one: the logged eval loss of the 2-rank SFT run is the one-process loss of the same
  model over the whole eval set; the GRPO evaluations are those of a one-process run's evaluation of the same model.
- Every rank's ``BestKeeper`` ends with the same best (value, step): the ranks took the same decisions around the
  collective export (a divergence would have hung or failed the run).
- ``<out>/best`` is one loadable HF folder with ``best.json`` (no temp folder left), whose weights are the model of
  the best step (the initial model, or the step-1 policy: the run's final model).
- A resume carries the best: SFT with ``max:eval_loss`` on a falling loss keeps the initial model when the resumed
  evaluations are all lower; GRPO's resumed evaluations score below any of the first run (the reward's offset
  drops from 2 to 0), and its best stays. A resumed run that lost the best value would replace it at its first
  evaluation (``test_keep_best_without_resumed_state_would_differ``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_best_worker import keep_best_worker
from dist_helpers import held_ports, spawn

REWARD = """
from pathlib import Path

def shifted(completion, example):
    # the offset (2, or 0 in the resumed run) plus a number in [0, 1) that any change of the text changes
    offset = float(Path({offset!r}).read_text())
    return offset + sum(ord(ch) * (i + 1) for i, ch in enumerate(completion)) % 101 / 101
"""


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _base(model_dir: Path, out: Path, algo: str, steps: int, lr: float) -> dict:
    return {
        "algo": algo,
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": lr},
        "train": {
            "max_steps": steps,
            "log_every": 100,
            "eval_every": 1,
            "report_to": "none",
            "eval_before_train": True,
        },  # fmt: skip
        "checkpoint": {"every_n_steps": 1, "keep_last_k": 1, "save_final": True},
    }


def _sft(model_dir: Path, out: Path, steps: int) -> dict:
    raw = _base(model_dir, out, "sft", steps, 3e-3)
    raw["data"] = {"path": "builtin:arithmetic?n=48"}
    raw["train"]["keep_best"] = "max:eval_loss"
    return raw


def _grpo(model_dir: Path, out: Path, reward: Path, steps: int, lr: float = 5e-2) -> dict:
    raw = _base(model_dir, out, "grpo", steps, lr)
    raw["data"] = {"path": "builtin:arithmetic?n=64"}
    raw["train"].update(keep_best="eval_reward", eval_data="builtin:arithmetic?max=9&n=8")
    raw["grpo"] = {
        "reward": f"{reward}:shifted", "reward_workers": 0, "prompts_per_step": 2, "samples_per_prompt": 2,
        "max_new_tokens": 6, "eval_prompts": 6, "eval_n": 2,
    }  # fmt: skip
    return raw


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from polyrl.models.checkpoint import load_model

    return load_model(str(folder), dtype=torch.float32).state_dict()


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _eval_loss_of(model_dir: Path, raw: dict) -> float:
    from polyrl.models.checkpoint import load_model, load_tokenizer
    from polyrl.run import config
    from polyrl.run.offline import eval_source, evaluate_loss

    cfg = config.build(raw)
    data = eval_source(cfg, cfg.spec, load_tokenizer(str(model_dir)))
    cpu = torch.device("cpu")
    model = load_model(str(model_dir), dtype=torch.float32, device=cpu)
    return evaluate_loss(model, data, cfg.spec.make_loss(cfg.algo_config), cfg.spec, cfg.algo_config, cpu)


def _ranks(work: Path, name: str) -> list[dict]:
    return [json.loads((work / f"{name}.rank{r}.json").read_text()) for r in range(2)]


def _check_folder(out: Path, best: dict) -> None:
    assert json.loads((out / "best" / "best.json").read_text()) == best
    assert (out / "best" / "config.json").is_file() and (out / "best" / "tokenizer_config.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no half-written best left


def test_two_rank_keep_best_sft_and_grpo_with_resume(tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config

    reward = tmp_path / "shifted.py"
    reward.write_text(REWARD.format(offset=str(tmp_path / "offset.txt")))
    (tmp_path / "offset.txt").write_text("2")
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    runs = [
        {"name": "sft", "raw": _sft(tiny_model_dir, sft, 2), "copy_final": True},
        {"name": "sft_resume", "raw": {**_sft(tiny_model_dir, sft, 3), "resume": "latest"}},
        {"name": "grpo", "raw": _grpo(tiny_model_dir, grpo, reward, 1), "copy_final": True},
        {"name": "grpo_resume", "raw": {**_grpo(tiny_model_dir, grpo, reward, 2), "resume": "latest"}, "offset": 0},
    ]
    with held_ports(len(runs)) as ports:  # one process group per run, each on a port held here
        spawn(keep_best_worker, 2, str(tmp_path), runs, ports)

    # ---- SFT: the held-out loss of the whole eval set; max: keeps the initial model through the resume
    rows = _rows(sft)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0 evaluated once, not again on resume
    losses = [r["eval_loss"] for r in rows]
    assert losses == sorted(losses, reverse=True) and losses[0] > losses[-1]  # falling: every later eval is worse
    raw = runs[0]["raw"]
    assert losses[0] == pytest.approx(_eval_loss_of(tiny_model_dir, raw), rel=1e-5)  # the one-process loss
    assert losses[2] == pytest.approx(_eval_loss_of(tmp_path / "sft-final", raw), rel=1e-5)
    best = {"metric": "eval_loss", "mode": "max", "value": losses[0], "step": 0}
    _check_folder(sft, best)
    assert _same_weights(sft / "best", tiny_model_dir)
    for name in ("sft", "sft_resume"):
        assert _ranks(tmp_path, name) == [best, best], name  # both ranks hold the same best

    # ---- GRPO: evaluations through the data-parallel engine; the resumed (worse) evaluation keeps the best
    rows = _rows(grpo)
    assert [r["step"] for r in rows] == [0, 1, 2]
    reward_of = {r["step"]: r["eval_reward"] for r in rows}
    assert min(reward_of[0], reward_of[1]) >= 2 > reward_of[2]  # the offset: the resumed evaluation is worse
    step = 1 if reward_of[1] > reward_of[0] else 0  # ties keep the earlier step
    assert step == 1  # with this seed the update improves the greedy evaluation: best/ is a trained, gathered policy
    best = {"metric": "eval_reward", "mode": "max", "value": reward_of[step], "step": step}
    _check_folder(grpo, best)
    assert _ranks(tmp_path, "grpo") == [best, best] and _ranks(tmp_path, "grpo_resume") == [best, best]
    assert _same_weights(grpo / "best", tiny_model_dir if step == 0 else tmp_path / "grpo-final")

    # the global evaluation: a one-process run evaluating the kept model before training logs the same numbers
    (tmp_path / "offset.txt").write_text("2")
    ref = tmp_path / "ref"
    raw = _grpo(grpo / "best", ref, reward, 1, lr=1e-30)
    raw["train"]["save_final_model"] = False
    raw["checkpoint"] = {"every_n_steps": 0, "keep_last_k": 0, "save_final": False}
    runner.run(config.build(raw))
    ref0 = _rows(ref)[0]
    evals = {k: v for k, v in ref0.items() if k.startswith("eval_")}
    assert {"eval_reward", "eval_sampled_reward", "eval_pass@2", "eval_length"} <= set(evals)
    assert {k: rows[step][k] for k in evals} == evals
