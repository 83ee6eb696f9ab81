"""LoRA through the training runs: ``polyrl train --lora`` (SFT) learns with only adapter weights trained and
writes PEFT adapter folders (checkpoints and ``final``) that peft loads; resume repeats the losses bitwise; a run
starts from an adapter folder; DPO with LoRA uses the base as reference; GRPO with LoRA trains adapters only, with
the KL reference being the base (no copy) and ``merge_for_rollout`` giving the same greedy rollouts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyrl.cli.main import main

DATA = "builtin:arithmetic?n=64"
COMMON = ["--micro-batch-tokens", "512", "--max-seq-len", "64", "--log-every", "10", "--deterministic"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    argv = ["train", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out), "--max-steps", "20"]
    argv += [
        "--lr",
        "1e-2",
        "--save-every",
        "10",
        "--keep-last",
        "0",
        "--lora",
        "r=8,alpha=16,targets=q,k,v,o,gate,up,down",
        *COMMON,
    ]
    assert main(argv) == 0
    return out


def test_lora_sft_learns_and_writes_adapter_folders(lora_run, tiny_model_dir):
    recs = _metrics(lora_run)
    first = sum(r["loss"] for r in recs[:3]) / 3
    last = sum(r["loss"] for r in recs[-3:]) / 3
    # measured on CPU: mean of the first 3 steps 7.35, of the last 3 (of 20) 6.77 (r=8, lr 1e-2)
    assert last < first - 0.45, (first, last)
    final = lora_run / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0 and len(cfg["target_modules"]) == 7
    assert cfg["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    assert (final / "adapter_model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    assert not (final / "model.safetensors").exists()  # the frozen base is never re-saved
    assert (lora_run / "checkpoints" / "step-00000010" / "model" / "adapter_config.json").is_file()
    run_cfg = json.loads((lora_run / "run_config.json").read_text())
    assert run_cfg["lora"]["r"] == 8 and run_cfg["lora"]["quantize_base"] is None


def test_peft_loads_the_final_adapter(lora_run, tiny_model_dir):
    peft = pytest.importorskip("peft")
    import transformers

    from polyrl.models.attention_metadata import AttnMetadata
    from polyrl.models.lora import load_lora_model

    final = lora_run / "final"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, str(final)).eval()
    ours = load_lora_model(final, None, torch.float32)
    ids = torch.tensor([5, 17, 3, 99, 42, 8])
    with torch.no_grad():
        want = pm(input_ids=ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(6), AttnMetadata.from_seqlens([6], "cpu")))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_lora_resume_repeats_the_same_losses(lora_run, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(lora_run, out)
    ckpt = out / "checkpoints" / "step-00000010"
    argv = ["train", "--config", str(lora_run / "run_config.json"), "--out", str(out), "--resume", str(ckpt)]
    assert main(argv) == 0
    before, after = _metrics(lora_run), _metrics(out)
    assert [r["loss"] for r in after] == [r["loss"] for r in before]  # bitwise on the CPU
    assert [r["grad_norm"] for r in after] == [r["grad_norm"] for r in before]


def test_export_merge_writes_an_hf_folder(lora_run, tiny_model_dir, tmp_path):
    import transformers

    from polyrl.models.attention_metadata import AttnMetadata
    from polyrl.models.lora import load_lora_model

    out = tmp_path / "merged"
    assert main(["export", "--adapter", str(lora_run / "final"), "--merge", "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert (out / "tokenizer.json").is_file()
    ours = load_lora_model(lora_run / "final", None, torch.float32)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        want = ours.compute_logits(ours(ids, torch.arange(8), AttnMetadata.from_seqlens([8], "cpu")))
        got = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # --model BASE given explicitly gives the same folder; a full model without --adapter is refused
    assert main(["export", "--model", str(tiny_model_dir), "--adapter", str(lora_run / "final"), "--merge",
                 "--out", str(tmp_path / "m2")]) == 0  # fmt: skip
    assert main(["export", "--model", str(tiny_model_dir), "--merge", "--out", str(tmp_path / "m3")]) == 2


def test_start_from_an_adapter_folder(lora_run, tmp_path):
    out = tmp_path / "cont"
    argv = ["train", "--model", str(lora_run / "final"), "--data", DATA, "--out", str(out), "--max-steps", "3"]
    assert main([*argv, "--lr", "1e-2", *COMMON]) == 0
    first = _metrics(out)[0]["loss"]
    assert first < _metrics(lora_run)[0]["loss"] - 0.5  # starts where the adapter left off
    assert json.loads((out / "run_config.json").read_text())["lora"]["r"] == 8


def test_dpo_with_lora_trains_the_adapter(tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.run import config as rc

    raw = {
        "algo": "dpo",
        "model": str(tiny_model_dir),
        "out": str(tmp_path / "dpo"),
        "data": {"path": "builtin:arithmetic-pref?max=9&n=32", "max_seq_len": 64},
        "engine": {"micro_batch_tokens": 512},
        "optim": {"lr": 2e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": 5, "log_every": 100},
        "dpo": {"beta": 0.5},
        "lora": {"r": 8, "alpha": 16},
    }
    runner.run(rc.build(raw))
    recs = _metrics(tmp_path / "dpo")
    assert recs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # B = 0: the policy starts at the reference (base)
    assert recs[-1]["rewards/margins"] > recs[0]["rewards/margins"] + 0.1
    assert (tmp_path / "dpo" / "final" / "adapter_config.json").is_file()


def _grpo_raw(model_dir, out, reward, **lora):
    return {
        "algo": "grpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=32"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 5e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": 2, "log_every": 100},
        "grpo": {"reward": reward, "reward_workers": 0, "prompts_per_step": 2, "samples_per_prompt": 4,
                 "max_new_tokens": 4, "kl_coef": 0.05},
        "lora": {"r": 4, "alpha": 8, **lora},
    }  # fmt: skip


def test_grpo_with_lora_runs_and_trains_adapters_only(tiny_model_dir, tmp_path):
    from polyrl import run as runner
    from polyrl.models.lora import read_adapter_config
    from polyrl.run import config as rc

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def chars(completion, example):\n    return float(len(set(completion)))\n")
    summary = runner.run(rc.build(_grpo_raw(tiny_model_dir, tmp_path / "grpo", f"{rewards}:chars")))
    assert summary["status"] == "finished" and summary["steps"] == 2
    final = tmp_path / "grpo" / "final"
    cfg, base = read_adapter_config(final)
    assert cfg.r == 4 and base == str(tiny_model_dir.resolve())
    from safetensors.torch import load_file

    tensors = load_file(str(final / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k)  # the adapter moved


def test_colocated_lora_reference_and_merge_for_rollout(tiny_model_dir):
    from polyrl.algorithms.rl_batch import pack_samples
    from polyrl.infer import SamplingParams
    from polyrl.models.checkpoint import load_model, load_tokenizer
    from polyrl.models.lora import AdapterDisabled, LoraConfig, adapter_parameters, apply_lora, lora_layers
    from polyrl.run.colocated import ColocatedPolicy
    from polyrl.train import OptimConfig

    tok = load_tokenizer(tiny_model_dir)
    outs = {}
    for merge in (False, True):
        model = apply_lora(load_model(tiny_model_dir), LoraConfig(r=4, alpha=8, merge_for_rollout=merge))
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            for p in adapter_parameters(model).values():
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        pol = ColocatedPolicy(model, tok, OptimConfig(lr=1e-2), reference=True)
        assert isinstance(pol.ref_model, AdapterDisabled) and pol.ref_model.inner is model
        samples = pol.rollout([[5, 6, 7, 8], [9, 10]], n=1, sampling=SamplingParams(temperature=0, max_tokens=6))
        outs[merge] = [s.completion_ids for s in samples]
        assert not any(layer.merged for _, layer in lora_layers(model))  # unmerged again after the rollout
        lp, _ = pol.logprobs(samples)
        ref_lp, _ = pol.logprobs(samples, model=pol.ref_model)
        assert max((a - b).abs().max().item() for a, b in zip(lp, ref_lp)) > 1e-4  # adapter on vs off

        def loss_fn(m, b):
            from polyrl.algorithms.rl_batch import completion_logprobs

            tl, _ = completion_logprobs(m, b, 1.0, False)
            return -(tl * b.mask).sum(), {}

        pol.step(pack_samples(samples, max_tokens=256), loss_fn, normalizer=1.0)
        for n, p in model.named_parameters():
            if n in frozen:  # the base stays bit-identical (merged rollouts restore it from exact backups)
                assert torch.equal(p, frozen[n]), n
    assert outs[True] == outs[False]  # merged weights give the same greedy tokens as base + adapter


def test_qlora_sft_run_learns_and_resumes_exactly(tiny_model_dir, tmp_path):
    out = tmp_path / "qlora"
    argv = ["train", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out), "--max-steps", "6"]
    argv += ["--lr", "1e-2", "--save-every", "3", "--keep-last", "0", "--qlora", *COMMON]
    assert main(argv) == 0
    recs = _metrics(out)
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.4, (recs[0]["loss"], recs[-1]["loss"])  # CPU: 7.58 -> 6.95
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["lora"]["quantize_base"] == "nf4" and cfg["lora"]["r"] == 16
    assert (out / "final" / "adapter_config.json").is_file()
    again = tmp_path / "again"
    shutil.copytree(out, again)
    ckpt = again / "checkpoints" / "step-00000003"
    assert main(["train", "--config", str(out / "run_config.json"), "--out", str(again), "--resume", str(ckpt)]) == 0
    assert [r["loss"] for r in _metrics(again)] == [r["loss"] for r in recs]


def test_ppo_from_an_adapter_folder(lora_run, tmp_path):
    """PPO with LoRA, started from a PEFT adapter: the policy continues the adapter, the critic starts from its base."""
    from polyrl import run as runner
    from polyrl.run import config as rc

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def chars(completion, example):\n    return float(len(set(completion)))\n")
    raw = _grpo_raw(lora_run / "final", tmp_path / "ppo", f"{rewards}:chars")
    raw["algo"], raw["ppo"] = "ppo", raw.pop("grpo")
    raw["train"]["max_steps"] = 1
    del raw["lora"]  # r, alpha and targets come from the adapter
    summary = runner.run(rc.build(raw))
    assert summary["status"] == "finished"
    assert json.loads((tmp_path / "ppo" / "final" / "adapter_config.json").read_text())["r"] == 8


def test_example_toml_and_bad_lora_tables(tiny_model_dir):
    from pathlib import Path

    from polyrl.errors import ConfigError
    from polyrl.run import config as rc

    raw = rc.load_file(Path(__file__).resolve().parents[2] / "examples" / "sft_lora_arithmetic.toml")
    cfg = rc.build({**raw, "model": str(tiny_model_dir)})
    assert cfg.lora.r == 16 and cfg.lora.scaling == 2.0 and len(cfg.lora.targets) == 7
    assert rc.build({**raw, "model": str(tiny_model_dir), "lora": None}).lora is None
    with pytest.raises(ConfigError, match="unknown lora setting"):
        rc.build({**raw, "model": str(tiny_model_dir), "lora": {"rank": 4}})
    with pytest.raises(ConfigError, match="lora.r must be a positive integer"):
        rc.build({**raw, "model": str(tiny_model_dir), "lora": {"r": 0}})
