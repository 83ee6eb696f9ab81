"""On-policy distillation on the CPU: a run through the same RunConfig + runner as ``polyrl train --algo distill``
(a tiny student, a peaked tiny teacher of the same tokenizer) logs the per-token reverse KL; the loss it trains has the
gradient of the exact reverse KL (the sign and scale of the per-token advantages); the teacher's scores equal a plain
forward of the teacher; bad configs say what to fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyrl.errors import ConfigError


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from polyrl.models.checkpoint import load_model, load_tokenizer, save_model
    from polyrl.models.presets import create_model_from_preset

    # A peaked teacher: another random tiny model whose final norm is scaled up, so its next-token distributions
    # are far from the near-uniform student's (a reverse KL of a few nats per token to start from).
    src = create_model_from_preset("tiny", tmp_path_factory.mktemp("teacher") / "random", seed=7)
    model = load_model(src, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(12.0)
    return save_model(model, src.parent / "peaked", tokenizer=load_tokenizer(src))


def _raw(student, teacher, out, steps=8, **kw):
    table = {
        "teacher": str(teacher),
        "reward": "exact_match",
        "reward_workers": 0,
        "prompts_per_step": 4,
        "samples_per_prompt": 4,
        "max_new_tokens": 6,
        **kw,
    }
    return {
        "algo": "distill",
        "model": str(student),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 2e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "distill": table,
    }


def _copy_with_another_tokenizer(src, dst):
    """``src``'s model folder copied to ``dst`` with one vocabulary entry renamed: same weights, another tokenizer."""
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (dst / "tokenizer.json").write_text(json.dumps(tok))


def test_distill_run_logs_reverse_kl(tiny_model_dir, teacher_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config

    torch.set_num_threads(1)
    out = tmp_path / "distill"
    runner.run(config.build(_raw(tiny_model_dir, teacher_dir, out, steps=2)))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # the peaked teacher is far from the near-uniform student: a few nats per token
        assert 1.0 < r["reverse_kl"] < 20.0 and r["teacher_logprob"] < -r["reverse_kl"] / 2
        assert r["optimizer_steps"] >= 1


@pytest.fixture(scope="module")
def sharp_teacher_dir(tiny_model_dir, tmp_path_factory):
    """The student itself with its logits scaled by 3 (a teacher close enough for a low-variance estimate)."""
    from polyrl.models.checkpoint import load_model, load_tokenizer, save_model

    model = load_model(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    return save_model(model, tmp_path_factory.mktemp("sharp") / "t", tokenizer=load_tokenizer(tiny_model_dir))


def test_distill_gradient_is_the_reverse_kl_gradient(tiny_model_dir, sharp_teacher_dir):
    """The loss the run trains with (GRPO's clipped loss on distill's per-token advantages, one step: ratio 1), on
    many one-token samples, has the gradient of the exact reverse KL(student || teacher) at those prefixes."""
    from polyrl.algorithms.distill import Distill, DistillConfig
    from polyrl.algorithms.grpo import make_policy_loss
    from polyrl.algorithms.rl_batch import Sample, pack_samples
    from polyrl.infer import LLM, RolloutConfig, SamplingParams
    from polyrl.models.attention_metadata import AttnMetadata
    from polyrl.models.checkpoint import load_model

    torch.set_num_threads(1)
    student = load_model(tiny_model_dir, dtype=torch.float32)
    teacher_dir = sharp_teacher_dir
    teacher = load_model(teacher_dir, dtype=torch.float32)
    prompts = [[5, 9, 11, 40], [7, 33, 2], [100, 200, 300, 400, 500]]
    cfg = DistillConfig(teacher=str(teacher_dir), samples_per_prompt=8, max_new_tokens=1)
    hooks = Distill(cfg)
    outs = LLM(student, None, RolloutConfig(num_blocks=64)).generate(
        prompts, SamplingParams(n=512, max_tokens=1, seed=3)
    )
    samples = [
        Sample(p, c.token_ids, c.logprobs, c.finish_reason, "", group=g)
        for g, (p, o) in enumerate(zip(prompts, outs))
        for c in o.outputs
    ]
    adv, keep, metrics = hooks.sample_advantages(samples, [0.0] * len(samples), [s.group for s in samples])
    assert keep == list(range(len(samples))) and len(adv[0]) == 1
    logp = [list(s.logprobs) for s in samples]
    (batch,) = pack_samples(samples, {"adv": adv, "old_logp": logp, "rollout_logp": logp}, 1 << 20)
    loss_fn = make_policy_loss(cfg, batch.num_target_tokens, batch.num_target_tokens)

    def grad(loss: torch.Tensor) -> torch.Tensor:
        student.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten().clone() for p in student.parameters() if p.grad is not None])

    surrogate = grad(loss_fn(student, batch)[0] / batch.num_target_tokens)
    exact = 0.0
    for p in prompts:
        ids, meta = torch.tensor(p), AttnMetadata.from_seqlens([len(p)])
        ls = torch.log_softmax(student.compute_logits(student(ids, torch.arange(len(p)), meta))[-1], -1)
        with torch.no_grad():
            lt = torch.log_softmax(teacher.compute_logits(teacher(ids, torch.arange(len(p)), meta))[-1], -1)
        exact = exact + (ls.exp() * (ls - lt)).sum() / len(prompts)
    want = grad(exact)
    assert metrics["reverse_kl"] == pytest.approx(exact.item(), rel=0.2)  # the sampled estimate of the same KL
    # 1536 samples of a 2048-token vocabulary: a noisy but clearly aligned estimate (a flipped advantage sign gives
    # the negative of this cosine; 6144 samples give 0.96 on a trained-for-a-few-steps student)
    cos = torch.nn.functional.cosine_similarity(surrogate, want, dim=0).item()
    assert cos > 0.35, cos


def test_teacher_scores_equal_a_plain_forward(teacher_dir):
    from polyrl.algorithms.rl_batch import Sample
    from polyrl.algorithms.teacher import TeacherScorer
    from polyrl.models.attention_metadata import AttnMetadata

    torch.set_num_threads(1)
    scorer = TeacherScorer(str(teacher_dir), "float32")
    samples = [
        Sample([5, 9, 11, 40], [7, 8, 3], [0.0] * 3, "length", ""),
        Sample([5, 9, 11, 40], [2, 100, 64, 1], [0.0] * 2, "stop", "", mask=[1, 0, 1, 0]),
    ]
    got = scorer.score(samples)
    model = scorer.llm.model
    for s, lps in zip(samples, got):
        ids = s.prompt_ids + s.completion_ids
        with torch.no_grad():
            h = model(torch.tensor(ids), torch.arange(len(ids)), AttnMetadata.from_seqlens([len(ids)]))
            full = torch.log_softmax(model.compute_logits(h), -1)
        want = [full[len(s.prompt_ids) + j - 1, t].item() for j, t in enumerate(s.completion_ids)]
        if s.mask is not None:
            want = [w for w, m in zip(want, s.mask) if m]
        assert lps == pytest.approx(want, abs=1e-4)


def test_bad_configs_say_what_to_fix(tiny_model_dir, teacher_dir, tmp_path):
    from polyrl.algorithms.distill import DistillConfig
    from polyrl.algorithms.teacher import TeacherScorer

    with pytest.raises(ConfigError, match="distill.teacher is empty"):
        DistillConfig()
    with pytest.raises(ConfigError, match="no config.json"):
        DistillConfig(teacher=str(tmp_path))
    with pytest.raises(ConfigError, match="temperature must be 1.0"):
        DistillConfig(teacher=str(teacher_dir), temperature=0.7)
    other = tmp_path / "other"
    _copy_with_another_tokenizer(teacher_dir, other)
    from polyrl.models.checkpoint import load_tokenizer

    with pytest.raises(ConfigError, match="tokenizer differs"):
        TeacherScorer(str(teacher_dir), "float32").check_tokenizer(load_tokenizer(str(other)))


def test_teacher_of_another_tokenizer_stops_the_run_before_weights_load(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Checked with the teacher's tokenizer alone, before the student's (or teacher's) weights load (it was found on
    the first step, after the student loaded)."""
    import sys

    import polyrl.models.checkpoint as ckpt
    import polyrl.run  # noqa: F401 - the loops bind load_model at import; patched where bound
    from polyrl.cli.main import main

    other = tmp_path / "other"
    _copy_with_another_tokenizer(tiny_model_dir, other)

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    for module in [m for name, m in sys.modules.items() if name.startswith("polyrl")]:
        if getattr(module, "load_model", None) is ckpt.load_model:
            monkeypatch.setattr(module, "load_model", boom)
    out = tmp_path / "run"
    argv = ["train", "--algo", "distill", "--model", str(tiny_model_dir), "--teacher", str(other)]
    assert main([*argv, "--data", "builtin:arithmetic?n=8", "--out", str(out)]) == 2
    assert "the teacher's tokenizer differs from the student's" in capsys.readouterr().err and not out.exists()


def test_teacher_flag_sets_the_distill_table():
    import argparse

    from polyrl.cli import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--algo", "distill", "--model", "m", "--data", "d", "--out", "o", "--teacher", "t"])
    assert ("distill.teacher", "t") in train.overrides_from_args(args)


def _distill_cli_run(student, teacher, out, steps: int) -> tuple[int, list[dict]]:
    """``polyrl train --algo distill`` through the CLI entry point: exit code and the metrics records."""
    from polyrl.cli.main import main

    argv = ["train", "--algo", "distill", "--model", str(student), "--teacher", str(teacher), "--out", str(out)]
    argv += ["--data", "builtin:arithmetic?max=9&n=64", "--reward", "exact_match", "--reward-workers", "0"]
    argv += ["--n", "4", "--prompts-per-step", "4", "--max-new-tokens", "8", "--max-steps", str(steps)]
    argv += ["--lr", "2e-2", "--micro-batch-tokens", "256", "--seed", "0", "--set", "checkpoint.save_final=false"]
    rc = main(argv)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rc, recs


@pytest.mark.gpu
def test_distill_cli_run_on_the_accelerator(tiny_model_dir, teacher_dir, tmp_path):
    """On the GPU (bf16 student and teacher, each in its own rollout engine on the device): ``--algo distill`` runs
    4 steps to the end, every step's loss and per-token reverse KL finite (the peaked teacher: a few nats per token,
    as on the CPU), and the student trained on the device (its peak memory is counted)."""
    import math

    from polyrl.platform import device

    if not device.is_accelerator():
        pytest.skip("needs an accelerator (run with -m gpu on the device)")
    rc, recs = _distill_cli_run(tiny_model_dir, teacher_dir, tmp_path / "distill", steps=4)
    assert rc == 0
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["distill/reverse_kl"] == r["reverse_kl"] and 1.0 < r["reverse_kl"] < 20.0
        assert math.isfinite(r["teacher_logprob"]) and r["teacher_logprob"] < 0 and r["distill/teacher_s"] > 0
        assert r["peak_memory_bytes"] > 0
    assert recs[-1]["optimizer_steps"] == 4
    assert json.loads((tmp_path / "distill" / "run_config.json").read_text())["algo"] == "distill"
