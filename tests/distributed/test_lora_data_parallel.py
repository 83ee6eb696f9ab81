"""LoRA / QLoRA data parallelism on the CPU with gloo and 2 real processes (replicas, not FSDP2):

1. two ranks' steps equal one process's over the same global batch (adapters within fp32 tolerance after 2 steps,
   and bitwise equal across ranks, even when the ranks started from different adapters);
2. a 2-rank runner run (adapter dropout on, so each rank's RNG matters) checkpoints and resumes at 2 ranks onto the
   uninterrupted run's adapters and losses bitwise, and its replicated checkpoint resumes in one plain process;
3. ``polyrl train --algo grpo --lora --nproc-per-node 2`` (torchrun) completes, draws the one-process run's rewards,
   follows its losses, and writes a PEFT ``final`` folder that loads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from dist_helpers import global_batches, held_ports, read_json, spawn
from dist_lora_worker import KINDS, STEPS, lora_model, lora_step_worker, new_engine, resume_worker
from safetensors.torch import load_file

from polyrl.models.lora import adapter_parameters

TOL = 1e-6


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_lora_steps_equal_one_process(tmp_path):
    spawn(lora_step_worker, 2, str(tmp_path))
    for kind in KINDS:
        model = lora_model(kind)
        engine = new_engine(model)
        stats = [engine.step(global_batches(step)) for step in range(STEPS)]
        for rank in range(2):  # the global loss, the norm of the global gradient (clip 0.2 active), global tokens
            got = read_json(tmp_path / f"{kind}-rank{rank}.json")
            assert got["loss"] == pytest.approx([s.loss for s in stats], abs=1e-5)
            assert got["grad_norm"] == pytest.approx([s.grad_norm for s in stats], abs=1e-5)
            assert got["tokens"] == [s.tokens for s in stats]
        assert min(s.grad_norm for s in stats) > 0.2, kind
        want = {k: v.detach() for k, v in adapter_parameters(model).items()}
        r0 = load_file(str(tmp_path / f"{kind}-rank0.safetensors"))
        r1 = load_file(str(tmp_path / f"{kind}-rank1.safetensors"))
        assert sorted(r0) == sorted(want) and len(want) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
        moved = max((want[k] - p).abs().max().item() for k, p in adapter_parameters(lora_model(kind)).items())
        assert moved > 1e-3, kind  # the steps really moved the adapters
        for name, w in want.items():
            assert torch.equal(r0[name], r1[name]), (kind, name)  # the replicas stay identical
            torch.testing.assert_close(r0[name], w, atol=TOL, rtol=1e-5, msg=f"{kind} {name}")


def _sft_raw(model_dir, out, **extra) -> dict:
    raw = {
        "algo": "sft",
        "model": str(model_dir),
        "out": str(out),
        "seed": 1,
        "data": {"path": "builtin:arithmetic?n=48", "max_seq_len": 64},
        "engine": {"micro_batch_tokens": 256, "step_tokens": 512, "deterministic": True},
        "optim": {"lr": 1e-2},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": 3, "log_every": 1},
        "checkpoint": {"every_n_steps": 2, "keep_last_k": 0},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1},
    }
    raw.update(extra)
    return raw


def test_two_rank_lora_run_checkpoints_and_resumes_exactly(tiny_model_dir, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    again = _sft_raw(tiny_model_dir, resumed, resume=str(resumed / "checkpoints" / "step-00000002"))
    with held_ports(1) as (port,):  # the resumed run's process group, on a port held here
        spawn(resume_worker, 2, _sft_raw(tiny_model_dir, whole), again, port)
    ckpt = whole / "checkpoints" / "step-00000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["replicated"] is True
    assert (ckpt / "model" / "adapter_config.json").is_file() and not (ckpt / "sharded").exists()
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]
    optim = load_file(str(ckpt / "optimizer.safetensors"))
    assert optim and all(".lora_A." in k or ".lora_B." in k for k in optim)  # adapter state only

    want, got = _metrics(whole), _metrics(resumed)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bitwise
    a = load_file(str(whole / "final" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "final" / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(t.abs().max()) > 0 for k, t in a.items() if "lora_B" in k)

    # The replicated checkpoint is the one-process layout: it resumes in one plain process too (step 3 of 3).
    from polyrl import run as runner
    from polyrl.run import config as rc

    single = tmp_path / "single"
    shutil.copytree(resumed, single)
    shutil.rmtree(single / "checkpoints" / "step-00000003")
    runner.run(rc.build(_sft_raw(tiny_model_dir, single, resume=str(single / "checkpoints" / "step-00000002"))))
    assert _metrics(single)[-1]["step"] == 3 and (single / "final" / "adapter_model.safetensors").is_file()


REWARD = """
def digits(completion, example):
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
"""


def test_two_rank_lora_grpo_through_the_cli(tiny_model_dir, tmp_path):
    from polyrl.cli.main import main

    reward = tmp_path / "toy.py"
    reward.write_text(REWARD)
    args = ["--algo", "grpo", "--data", "builtin:arithmetic?max=9&n=32", "--micro-batch-tokens", "48"]
    args += ["--reward", f"{reward}:digits", "--reward-workers", "0", "--n", "4", "--prompts-per-step", "3"]
    args += ["--max-new-tokens", "4", "--mini-batches", "2", "--kl-coef", "0.05", "--old-logprobs", "recompute"]
    args += ["--lr", "5e-2", "--lr-decay", "constant", "--log-every", "1", "--seed", "0", "--max-steps", "2"]
    args += ["--lora", "r=4,alpha=8"]
    two, one = tmp_path / "two", tmp_path / "one"
    cmd = [sys.executable, "-m", "polyrl.cli.main", "train", "--nproc-per-node", "2", "--model", str(tiny_model_dir)]
    proc = subprocess.run([*cmd, "--out", str(two), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "finished"

    assert main(["train", "--model", str(tiny_model_dir), "--out", str(one), *args]) == 0
    ref, got = _metrics(one), _metrics(two)
    assert len(got) == 2
    for a, b in zip(ref, got):
        assert b["reward"] == a["reward"] and b["response_length"] == a["response_length"]
        assert b["optimizer_steps"] == a["optimizer_steps"] == 2 * b["step"]
        for key in ("loss", "grad_norm", "kl_before", "mismatch_max", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), key

    import transformers

    peft = pytest.importorskip("peft")
    from polyrl.models.attention_metadata import AttnMetadata
    from polyrl.models.lora import load_lora_model, read_adapter_config

    final = two / "final"
    cfg, base = read_adapter_config(final)
    assert cfg.r == 4 and base == str(tiny_model_dir.resolve()) and not (final / "model.safetensors").exists()
    tensors = load_file(str(final / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k)  # the adapter moved
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, str(final)).eval()
    ours = load_lora_model(final, None, torch.float32)
    ids = torch.tensor([5, 17, 3, 99, 42, 8])
    with torch.no_grad():
        want = pm(input_ids=ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(6), AttnMetadata.from_seqlens([6], "cpu")))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_lora_models_are_replicated_not_sharded():
    """What is not supported says what to do: FSDP2 over a LoRA model, an engine on a plain model under a world."""
    from polyrl.errors import ConfigError, UserError
    from polyrl.train.parallel import World, is_replicated, shard_model

    world = World(rank=0, world_size=2, backend="gloo")  # a world as the run sees it (no collective is reached)
    model = lora_model("lora")
    with pytest.raises(ConfigError, match="not supported yet; replicate it instead"):
        shard_model(model, world)
    assert not is_replicated(model)
    with pytest.raises(UserError, match=r"shard_model\(.*\) \(full training\) or replicate_model\(model, world\)"):
        new_engine(model, world)
