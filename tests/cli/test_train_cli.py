"""`polyrl train` end to end on the tiny preset model: outputs, TOML + overrides, exact --resume, config
and data errors (exit 2, before any model load). Runs the CLI in-process (``polyrl.cli.main.main``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import pytest

from polyrl.cli.main import main
from polyrl.platform import device

DATA = "builtin:arithmetic?n=48"
COMMON = ["--micro-batch-tokens", "256", "--max-seq-len", "64", "--lr", "1e-3", "--log-every", "1"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A 4-step run from a TOML file plus flags: checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("train_cli")
    out = root / "run"
    toml = root / "run.toml"
    toml.write_text(
        f'algo = "sft"\nmodel = "{tiny_model_dir}"\nseed = 3\n'
        f'[data]\npath = "{DATA}"\n[optim]\nlr = 0.5\nweight_decay = 0.01\n'
        "[train]\nmax_steps = 9\n[engine]\ndeterministic = true\n"
    )
    argv = ["train", "--config", str(toml), "--out", str(out), "--max-steps", "4", "--save-every", "2", *COMMON]
    argv += ["--set", "optim.betas=[0.9, 0.99]", "--set", "checkpoint.keep_last_k=3"]
    assert main(argv) == 0
    return out


def test_outputs_of_a_run(finished_run):
    out = finished_run
    recs = _metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", "tokens", "tokens_per_s", "time_s", "peak_memory_bytes", "skipped", "epoch"):
        assert key in recs[0], key
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert all(r["skipped"] is False for r in recs)
    # Resolved config: file < flags < --set, seed spread to data and engine, one token budget.
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["optim"]["lr"] == 1e-3 and cfg["optim"]["weight_decay"] == 0.01
    assert cfg["optim"]["betas"] == [0.9, 0.99]
    assert cfg["train"]["max_steps"] == 4 and cfg["checkpoint"]["every_n_steps"] == 2
    assert cfg["data"]["seed"] == 3 and cfg["engine"]["seed"] == 3
    assert cfg["engine"]["micro_batch_tokens"] == 256 and "tokens_per_batch" not in cfg["data"]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-00000002", "step-00000004"]
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["data"]["iterator"]["position"] >= 2 and state["data"]["stats"]["bad_rows"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["status"] == "finished" and summary["data_bad_rows"] == 0
    assert (out / "metrics.png").stat().st_size > 1000


def test_final_folder_loads_in_transformers(finished_run):
    import torch
    import transformers

    from polyrl.models.attention_metadata import AttnMetadata
    from polyrl.models.checkpoint import load_model

    final = finished_run / "final"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(final))
    ids = torch.tensor(tok("What is 3 + 4?")["input_ids"])
    ours = load_model(final)
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(len(ids)), AttnMetadata.from_seqlens([len(ids)], "cpu")))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_resume_from_checkpoint_repeats_the_same_losses(finished_run, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(finished_run, out)
    ckpt = out / "checkpoints" / "step-00000002"
    argv = ["train", "--config", str(finished_run / "run_config.json"), "--out", str(out), "--resume", str(ckpt)]
    assert main(argv) == 0
    before, after = _metrics(finished_run), _metrics(out)
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    assert [r["loss"] for r in after] == [r["loss"] for r in before]  # bitwise on the CPU
    assert [r["grad_norm"] for r in after] == [r["grad_norm"] for r in before]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2


def test_existing_run_needs_resume(finished_run, capsys):
    argv = ["train", "--config", str(finished_run / "run_config.json")]
    assert main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_run_directory_as_model_names_its_model_folder(finished_run, tmp_path, monkeypatch, capsys):
    """``--model RUN`` (the run directory, not RUN/final) names RUN/final; it never suggests init-model, whose
    --out replaces a folder (it would have deleted the run). generate / serve / eval read the same hint."""
    from polyrl.models.config import ModelConfig

    _no_model_load(monkeypatch)
    argv = ["train", "--algo", "grpo", "--model", str(finished_run), "--data", DATA, "--out", str(tmp_path / "g")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is not a model folder (no config.json): it is a polyrl run directory; give its model folder " in err
    assert str(finished_run / "final") in err and "init-model" not in err and not (tmp_path / "g").exists()
    with pytest.raises(Exception, match="give its model folder " + str(finished_run / "final")):
        ModelConfig.from_pretrained(finished_run)


def test_resume_from_a_run_directory_names_its_newest_checkpoint(finished_run, tmp_path, monkeypatch, capsys):
    _no_model_load(monkeypatch)
    argv = ["train", "--model", str(finished_run / "final"), "--data", DATA, "--out", str(tmp_path / "o")]
    assert main([*argv, "--resume", str(finished_run)]) == 2
    err = capsys.readouterr().err
    assert "is not a complete checkpoint folder" in err
    assert err.rstrip().endswith(f"its newest is --resume {finished_run / 'checkpoints' / 'step-00000004'}"), err


def test_resume_as_another_algorithm_stops_before_any_work(finished_run, monkeypatch, capsys):
    """An SFT run resumed as DPO: refused at once (it failed on the data position after DPO's reference pass, which
    wrote reference_logps.json into the SFT run)."""
    _no_model_load(monkeypatch)
    before = sorted(p.name for p in finished_run.iterdir())
    argv = ["train", "--algo", "dpo", "--model", str(finished_run / "final"), "--data", "builtin:arithmetic-pref?n=8"]
    assert main([*argv, "--out", str(finished_run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step-00000004 was written by an --algo sft run, and this run is dpo; resume it with --algo sft" in err
    assert sorted(p.name for p in finished_run.iterdir()) == before


def _no_model_load(monkeypatch):
    import sys

    import polyrl.models.checkpoint as ckpt
    import polyrl.run  # noqa: F401 - the loops, imported before patching (they bind the real functions)
    from polyrl import algorithms

    for name in algorithms.names():  # every algorithm module too, so none binds the stand-in for later tests
        algorithms.get(name)

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    for fn in ("load_model", "load_tokenizer"):  # wherever polyrl bound them (the defining module and its importers)
        real = getattr(ckpt, fn)
        for module in [m for name, m in sys.modules.items() if name.startswith("polyrl")]:
            if getattr(module, fn, None) is real:
                monkeypatch.setattr(module, fn, boom)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr", "-1"], "optim.lr must be a positive number"),
        (["--set", "optim.bogus=1"], "unknown optim setting(s) ['bogus']"),
        (["--algo", "nope"], "unknown algorithm 'nope'; choose one of: "),
        (["--tokens-per-step", "10"], "engine.step_tokens (10) must be an integer >= engine.micro_batch_tokens"),
        (["--set", "data.tokens_per_batch=512"], "data.tokens_per_batch is now engine.micro_batch_tokens"),
        (["--set", "sft.normalize=words"], "sft.normalize must be one of"),
        (["--dtype", "fp16", "--set", "precision.compute_dtype=int8"], "precision.compute_dtype must be one of"),
        (["--algo", "dpo", "--set", "data.fixed_shapes=true"], "data.fixed_shapes pads training batches to one shape"),
        (["--checkpoint-layers", "4"], "set engine.activation_checkpointing = true"),
        (["--set", "precision.linear=int8"], "precision.linear must be one of default, fp8"),
        # unknown keys name the one meant: a typo, another table's key, another trainer's name
        (["--set", "optim.learning_rate=1e-4"], "optim setting(s) ['learning_rate'] (did you mean lr?); known: "),
        (["--set", "optim.max_steps=3"], "['max_steps'] (did you mean train.max_steps?)"),
        (["--set", "trian.max_steps=3"], "unknown setting(s) ['trian'] (did you mean train?); top-level keys"),
        (["--algo", "grpo", "--set", "grpo.max_stalness=1"], "['max_stalness'] (did you mean max_staleness?); known"),
        (["--algo", "grpo", "--set", "grpo.num_generations=4"], "(did you mean samples_per_prompt?)"),
        (["--set", "data.max_length=64"], "unknown data setting(s) ['max_length'] (did you mean max_seq_len?)"),
        (["--lora", "r=8,lora_alpha=16"], "unknown --lora key 'lora_alpha' (did you mean alpha?); known: alpha"),
        # a table of the algorithm's settings under a name of its own: the key where it belongs
        (["--algo", "grpo", "--set", "placement.rollout_devices=cpu"], "(did you mean grpo.rollout_devices?)"),
        (["--algo", "gspo", "--set", "async.max_staleness=1"], "['async'] (did you mean gspo.max_staleness?)"),
        # an online RL flag with an algorithm that has none: which algorithms take it
        (["--max-staleness", "1"], "sft setting(s) ['max_staleness'] (online RL settings: --algo distill, grpo, gspo"),
        (["--rollout-devices", "cpu"], "(online RL settings: --algo distill, grpo, gspo or ppo)"),
    ],
)
def test_config_errors_exit_2_before_loading(tmp_path, monkeypatch, capsys, extra, message):
    _no_model_load(monkeypatch)
    out = tmp_path / "out"
    argv = ["train", "--model", str(tmp_path / "missing-model"), "--data", DATA, "--out", str(out), *COMMON, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert "sft" in err or "--algo" not in extra or "did you mean" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--algo", "dpo"], f"--data '{DATA}' holds plain rows; use its pair set 'builtin:arithmetic-pref?n=48'"),
        (
            ["--algo", "rm", "--data", "builtin:copy-pref", "--eval-data", "builtin:copy@test", "--eval-every", "1"],
            "--eval-data 'builtin:copy@test' holds plain rows; use its pair set 'builtin:copy-pref@test'",
        ),
    ],
)
def test_preference_algorithm_on_plain_builtin_rows_names_the_pair_set(
    tiny_model_dir, tmp_path, monkeypatch, capsys, extra, message
):
    """DPO / RM on ``builtin:arithmetic`` (no chosen / rejected) is refused before loading, naming
    ``builtin:arithmetic-pref``, instead of failing on row 1 with a --skip-bad-rows hint that would skip every row."""
    _no_model_load(monkeypatch)
    out = tmp_path / "out"
    argv = ["train", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out), *COMMON, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --algo ") and message in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-stalness", "1"], "unrecognized arguments: --max-stalness 1 (did you mean --max-staleness?); see"),
        (["--max_steps", "3"], "(did you mean --max-steps?)"),
        (["--num-generations", "4"], "(did you mean --samples-per-prompt?)"),
        (["--learning-rate", "1e-4", "--output_dir", "x"], "(did you mean --lr?) (did you mean --out?)"),
        (["--save-steps", "5"], "(did you mean --save-every?)"),
        (["--async-producer", "threads"], "invalid choice: 'threads' (choose from 'inline', 'thread', 'process') (did"),
        (["actor_rollout_ref.rollout.n=4", "optim.lr=3"], "(settings go through --set section.key=value, --set optim"),
        (["--max-staleness", "two"], "argument --max-staleness: invalid int value: 'two'; see `polyrl train --help`"),
    ],
)
def test_flag_errors_are_one_line_naming_the_flag_meant(capsys, extra, message):
    """argparse's error without its 50-line usage, with the flag or choice a user (of TRL, verl) most likely meant."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "m", "--data", DATA, "--out", "o", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("polyrl train: error: ") and message in err, err
    assert err.rstrip().endswith("see `polyrl train --help`")


def test_python_dash_m_polyrl_is_the_cli():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "polyrl", "trian"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "invalid choice: 'trian'" in res.stderr and "(did you mean train?)" in res.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--reward", "exact_mach"], "unknown reward 'exact_mach' (did you mean exact_match?); use a builtin"),
        (["--rollout-precision", "fp8"], "FP8 rollout weights need a device with FP8 matrix multiply"),
    ],
)
def test_rl_errors_come_before_loading(tiny_model_dir, tmp_path, monkeypatch, capsys, extra, message):
    """A misspelt builtin reward (was: after the data loaded) and FP8 rollout weights on a machine without FP8 GEMMs
    (was: after the data and the model loaded, leaving a run_config.json behind) stop the run before it starts."""
    from polyrl.platform import device

    if "fp8" in extra and device.supports_fp8_gemm():  # only the FP8 case depends on the machine
        pytest.skip("this machine runs FP8 GEMMs")
    monkeypatch.delenv("POLYRL_KERNELS", raising=False)
    _no_model_load(monkeypatch)
    out = tmp_path / "out"
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and not out.exists(), err


def test_rl_settings_this_run_ignores_are_warned(tiny_model_dir, tmp_path):
    """--async-producer / --rollout-workers without --max-staleness, --teacher-coef without a teacher: the run is
    synchronous (teacherless) as before, and says which flag turns the setting on."""
    from polyrl.cli.train import add_arguments, overrides_from_args, unused_settings
    from polyrl.run.config import resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def unused(*extra):
        base = ["--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(tmp_path / "o")]
        return unused_settings(resolve(None, overrides_from_args(parser.parse_args([*base, *extra]))))

    got = unused("--async-producer", "process", "--rollout-workers", "2", "--teacher-coef", "0.5")
    assert got[0].startswith('grpo.async_producer = "process" takes effect only in asynchronous RL') and len(got) == 3
    assert "rollout_workers = 2 is used only by the process producer" in got[1]
    assert got[2] == "grpo.teacher_coef = 0.5 has no teacher to weigh: add --teacher DIR (or --teacher-url)"
    assert unused("--max-staleness", "1", "--async-producer", "process", "--rollout-workers", "2") == []
    assert unused("--max-staleness", "1", "--async-producer", "thread") == [] and unused() == []


def test_process_producer_settings_without_it_are_warned(tiny_model_dir, tmp_path):
    """The rollout worker settings (restarts, reply deadline, balance, weight sync wire) and partial_swap_step do
    nothing without the process producer (partial rollouts): each is named with the flags that turn it on."""
    from polyrl.cli.train import add_arguments, overrides_from_args, unused_settings
    from polyrl.run.config import resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def unused(*extra, sets=()):
        base = ["--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(tmp_path / "o")]
        args = parser.parse_args([*base, *extra, *(x for kv in sets for x in ("--set", kv))])
        return unused_settings(resolve(None, overrides_from_args(args)))

    worker_flags = ["--rollout-worker-timeout", "5", "--rollout-worker-restarts", "0", "--rollout-balance", "count"]
    worker_flags += ["--weight-sync-dtype", "bf16", "--weight-sync-bucket-mb", "64"]
    for producer in ("inline", "thread"):
        got = unused("--max-staleness", "1", "--async-producer", producer, *worker_flags)
        assert len(got) == 5 and all("used only by the process producer" in g for g in got), got
        fix = "is used only by the process producer (rollout worker processes): add --max-staleness 1 --async-producer"
        assert got[0].startswith(f"grpo.rollout_worker_timeout_s = 5 {fix} process, or drop it")
        assert [g.split(" = ")[0] for g in got] == [
            "grpo.rollout_worker_timeout_s", "grpo.rollout_worker_restarts", "grpo.rollout_balance",
            "grpo.weight_sync_dtype", "grpo.weight_sync_bucket_mb",
        ]  # fmt: skip
    assert unused("--max-staleness", "1", "--async-producer", "process", *worker_flags) == []
    got = unused("--max-staleness", "1", "--async-producer", "thread", sets=["grpo.partial_swap_step=2"])
    assert got == ["grpo.partial_swap_step = 2 places the weight swap of partial rollouts: add --partial-rollouts"]
    assert unused("--max-staleness", "1", "--async-producer", "thread", "--partial-rollouts",
                  sets=["grpo.partial_swap_step=2"]) == []  # fmt: skip


def test_worker_settings_at_the_dataclass_defaults_are_not_warned(tiny_model_dir, tmp_path):
    """The rollout-worker settings given exactly at OnlineConfig's defaults warn nothing, a changed one warns; and the
    defaults are read from the config's own dataclass: an algorithm config whose default differs warns nothing at
    that default (was: defaults copied by hand, so a changed default read as a setting the user made)."""
    from polyrl.algorithms.grpo import GRPOConfig
    from polyrl.algorithms.online_config import OnlineConfig
    from polyrl.cli.train import _worker_settings, add_arguments, overrides_from_args, unused_settings
    from polyrl.run.config import resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    keys = ("rollout_worker_timeout_s", "rollout_worker_restarts", "rollout_balance")
    keys += ("weight_sync_dtype", "weight_sync_bucket_mb")
    defaults = {f.name: f.default for f in dataclasses.fields(OnlineConfig) if f.name in keys}

    def unused(*sets):
        base = ["--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(tmp_path / "o")]
        args = parser.parse_args([*base, "--max-staleness", "1", "--async-producer", "thread"])
        args.set = [f"grpo.{key}={json.dumps(value)}" for key, value in sets]
        return unused_settings(resolve(None, overrides_from_args(args)))

    given = [(key, value) for key, value in defaults.items() if value is not None]  # None: no TOML literal
    assert len(given) == 4 and unused(*given) == []
    restarts = defaults["rollout_worker_restarts"] + 1
    got = unused(*given, ("rollout_worker_restarts", restarts))
    assert len(got) == 1 and got[0].startswith(f"grpo.rollout_worker_restarts = {restarts} is used only by"), got

    @dataclasses.dataclass
    class TunedConfig(GRPOConfig):  # an algorithm whose defaults differ from OnlineConfig's
        rollout_balance: str = "count"
        weight_sync_bucket_mb: float = 64.0

    assert _worker_settings(TunedConfig()) == []
    assert _worker_settings(TunedConfig(rollout_balance="work")) == [("rollout_balance", '"work"')]


def test_out_that_is_a_file_is_a_config_error(tmp_path, monkeypatch, capsys):
    _no_model_load(monkeypatch)
    (tmp_path / "f").write_text("x")
    argv = ["train", "--model", str(tmp_path / "m"), "--data", DATA, "--out", str(tmp_path / "f")]
    assert main(argv) == 2
    assert "is a file; the run directory must be a folder" in capsys.readouterr().err


def test_missing_model_and_data_are_config_errors(tmp_path, monkeypatch, capsys):
    _no_model_load(monkeypatch)
    base = ["train", "--out", str(tmp_path / "o")]
    assert main([*base, "--model", str(tmp_path / "none"), "--data", DATA]) == 2
    err = capsys.readouterr().err
    assert "'" + str(tmp_path / "none") + "' does not exist; give a Hugging Face model folder" in err
    assert main([*base, "--model", str(tmp_path), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_data_row_is_named_or_skipped(tiny_model_dir, tmp_path, capsys):
    rows = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(12)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(4, '{"prompt": "broken", "completion": ')
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    base = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--max-steps", "1", *COMMON]
    assert main([*base, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "data.jsonl: line 5" in err and "--skip-bad-rows" in err
    assert main([*base, "--out", str(tmp_path / "b"), "--skip-bad-rows"]) == 0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["data_bad_rows"] == 1 and summary["data_sequences"] == 12
    assert "line 5" in summary["data_bad_examples"][0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--train-devices", "cpu"], "train_devices is for one-process runs; under torchrun (--nproc-per-node 2)"),
        (["--rollout-devices", "cuda:0"], "rollout_devices: cuda:0 does not exist on this machine"),
        (["--rollout-devices", "cpu,cpux"], "rollout_devices: cpux does not exist on this machine"),
    ],
)
def test_placement_errors_under_nproc_come_before_the_launch(tiny_model_dir, tmp_path, monkeypatch, capsys, extra,
                                                             message):  # fmt: skip
    """A placement torchrun cannot take is refused once, by the launching process (exit 2, no rank started), not
    by every rank after the launch (torchrun's traceback, exit 1)."""
    import polyrl.cli.train as cli_train

    if device.device_type() != "cpu":
        pytest.skip("the messages of a CPU-only machine")
    _no_model_load(monkeypatch)
    monkeypatch.setattr(cli_train, "relaunch", lambda *a, **k: pytest.fail("torchrun was launched"))
    out = tmp_path / "out"
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out)]
    argv += ["--nproc-per-node", "2", "--max-staleness", "1", "--async-producer", "process", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("error:") == 1, err


def test_nproc_relaunch_keeps_every_flag():
    """``--nproc-per-node`` re-runs the command under torchrun: the RL flags must survive the trip."""
    import argparse

    from polyrl.cli import train

    argv = ["--algo", "grpo", "--model", "m", "--data", "builtin:arithmetic", "--out", "o", "--lr", "0.01"]
    argv += ["--n", "4", "--max-new-tokens", "16", "--reward", "f.py:fn", "--kl-coef", "0.05", "--filter-groups"]
    argv += ["--nproc-per-node", "2", "--set", "grpo.clip_high=0.28", "--lora", "r=4,targets=q,v", "--qlora"]
    argv += ["--activation-checkpointing", "--checkpoint-layers", "3"]
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(argv)
    again = parser.parse_args(train.relaunch_argv(args))
    assert again.nproc_per_node is None
    assert train.overrides_from_args(again) == train.overrides_from_args(args)
    keys = dict(train.overrides_from_args(again))
    assert keys["grpo.samples_per_prompt"] == 4 and keys["grpo.max_new_tokens"] == 16
    assert keys["grpo.filter_groups"] is True and keys["grpo.clip_high"] == 0.28
    assert keys["lora"] == {"r": 4, "targets": ["q", "v"]} and keys["lora.quantize_base"] == "nf4"
    assert keys["engine.activation_checkpointing"] is True and keys["engine.checkpoint_layers"] == 3
    bare = parser.parse_args(train.relaunch_argv(parser.parse_args(["--model", "m", "--lora"])))
    assert bare.lora == ""  # the bare --lora (all defaults) survives too
