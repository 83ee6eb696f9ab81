"""``polyrl eval``: lm-eval tasks in-process (accuracy equal to an independent scoring with the model's forward),
reward evaluation (mean reward, pass@k from per-prompt pass counts, mean length), PEFT adapter folders, errors."""

from __future__ import annotations

import json
from math import comb

import pytest
import torch

from polyrl.cli.main import main
from polyrl.eval.bundled import TASK_DIR
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.run.evaluate import pass_at_k


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cli(*argv: str) -> int:
    return main(["eval", "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", *argv])


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


@torch.no_grad()
def continuation_logprob(model, tok, context: str, continuation: str) -> float:
    """Sum of log p(continuation | context) by a plain forward, split as lm-eval's causal models split."""
    whole = tok.encode(context + continuation)
    ctx = len(tok.encode(context))
    hidden = model(torch.tensor(whole), torch.arange(len(whole)), AttnMetadata.from_seqlens([len(whole)]))
    logp = torch.log_softmax(model.compute_logits(hidden), -1)
    return sum(logp[i - 1, whole[i]].item() for i in range(ctx, len(whole)))


def test_tasks_accuracy_equals_an_independent_scoring(tiny_model_dir, tmp_path, capsys):
    from polyrl.models.checkpoint import load_model, load_tokenizer

    out = tmp_path / "eval.json"
    assert cli("--model", str(tiny_model_dir), "--tasks", "polyrl_arith_mc", "--limit", "10", "--output", str(out)) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "lm-eval" and report["n_samples"]["polyrl_arith_mc"]["effective"] == 10
    assert "acc" in capsys.readouterr().out  # the table
    model, tok = load_model(str(tiny_model_dir), dtype=torch.float32).eval(), load_tokenizer(str(tiny_model_dir))
    docs = [json.loads(line) for line in (TASK_DIR / "polyrl_arith_mc.jsonl").read_text().splitlines()[:10]]
    right = 0
    for d in docs:
        context = f"Question: {d['question']}\nAnswer:"
        scores = [continuation_logprob(model, tok, context, " " + c) for c in d["choices"]]
        right += int(max(range(4), key=scores.__getitem__) == d["label"])
    assert report["results"]["polyrl_arith_mc"]["acc"] == pytest.approx(right / 10)


def test_rewards_pass_at_k_and_length(tiny_model_dir, tmp_path):
    reward = tmp_path / "parity.py"
    reward.write_text("def parity(completion, example):\n    return float(len(completion) % 2 == 0)\n")
    out = tmp_path / "eval.json"
    argv = ["--model", str(tiny_model_dir), "--data", "builtin:arithmetic", "--reward", f"{reward}:parity"]
    assert cli(*argv, "--n", "4", "--limit", "6", "--max-tokens", "6", "--output", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "reward" and r["num_prompts"] == 6 and r["n"] == 4 and r["temperature"] == 1.0
    passed = r["passed"]
    assert len(passed) == 6 and 0 < sum(passed) < 24  # a mix of passing and failing samples
    assert r["mean_reward"] == pytest.approx(sum(passed) / 24)  # binary rewards: mean reward = pass@1
    for k in (1, 2, 4):
        want = sum(1 - comb(4 - c, k) / comb(4, k) for c in passed) / 6
        assert r["pass_at"][f"pass@{k}"] == pytest.approx(want)
    assert r["pass_at"]["pass@1"] <= r["pass_at"]["pass@2"] <= r["pass_at"]["pass@4"]
    assert 1 <= r["mean_length"] <= 6 and len(r["samples"]) == 5


def test_peft_adapter_folder_evaluates_base_plus_adapter(tiny_model_dir, tmp_path):
    from polyrl.eval.loading import load_eval_model
    from polyrl.models.checkpoint import load_model
    from polyrl.models.lora import LoraConfig, adapter_parameters, apply_lora, save_adapter

    model = apply_lora(load_model(tiny_model_dir), LoraConfig(r=4, alpha=8, targets=["q", "v", "down"]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    folder = save_adapter(model, tmp_path / "adapter", base_model=str(tiny_model_dir), tokenizer=tiny_model_dir)
    merged, tok = load_eval_model(folder, "float32", "cpu")
    base, _ = load_eval_model(tiny_model_dir, "float32", "cpu")
    ids = torch.tensor(tok.encode("What is 2 + 3?"))
    meta = AttnMetadata.from_seqlens([len(ids)])
    with torch.no_grad():
        want = model.eval().compute_logits(model(ids, torch.arange(len(ids)), meta))
        got = merged.compute_logits(merged(ids, torch.arange(len(ids)), meta))
        plain = base.compute_logits(base(ids, torch.arange(len(ids)), meta))
    assert torch.allclose(got, want, atol=1e-4)
    assert (got - plain).abs().max() > 1e-2  # the adapter is really applied


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "either --tasks"),
        (["--tasks", "a", "--data", "builtin:arithmetic"], "either --tasks"),
        (["--data", "builtin:arithmetic"], "--data needs --reward"),
        (["--tasks", "polyrl_arith_mc", "--include-path", "/no/such/dir"], "--include-path"),
    ],
)
def test_bad_arguments_say_what_to_fix(tiny_model_dir, tmp_path, capsys, argv, message):
    assert cli("--model", str(tiny_model_dir), "--output", str(tmp_path / "e.json"), *argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--reward", "exact_mach"], "unknown reward 'exact_mach' (did you mean exact_match?); use a builtin ("),
        (["--reward", "exact_match", "--n", "0"], "--n must be >= 1, got 0"),
        (["--reward", "exact_match", "--n", "4", "--temperature", "0"], "--n > 1 with greedy decoding"),
        (["--reward", "exact_match", "--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),
        (["--reward", "exact_match", "--data", "missing.jsonl"], "data file 'missing.jsonl' does not exist"),
        (["--reward", "exact_match+0.5*judge"], "the reward 'judge' needs a URL: --reward judge:http://HOST:PORT/v1"),
    ],
)
def test_reward_eval_errors_come_before_the_model_loads(tmp_path, capsys, argv, message):
    """The model folder does not exist, so each error here was raised before any model load (a misspelt --reward
    used to fail only after every sample was generated: over 2 minutes for builtin:arithmetic on the CPU)."""
    data = ["--data", "builtin:arithmetic?n=4"] if "--data" not in argv else []
    assert cli("--model", str(tmp_path / "no-model"), *data, *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "no-model" not in err, err


def test_task_errors_come_before_the_model_loads(tmp_path, capsys):
    """lm-eval task names and --include-path are checked before the model loads (an unknown task was found after
    it; with a did-you-mean now: polyrl_arith_m -> polyrl_arith_mc)."""
    argv = ["--model", str(tmp_path / "no-model"), "--tasks", "polyrl_arith_mc", "--include-path", str(tmp_path / "x")]
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert "--include-path" in err and "is not a folder of lm-eval task YAML files" in err and "no-model" not in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tasks", "polyrl_arith_mc", "--num-fewshot", "-1"], "--num-fewshot must be >= 0, got -1"),
        (["--tasks", "polyrl_arith_mc", "--limit", "2.5"], "--limit must be a whole number of documents"),
        (["--data", "builtin:arithmetic?n=4", "--reward", "numeric", "--limit", "0.5"], "--limit with --data"),
        (["--data", "builtin:arithmetic?n=4", "--reward", "numeric", "--max-tokens", "0"], "--max-tokens must be"),
        # not a number of documents at all (were an OverflowError / ValueError traceback, or NaN passed to lm-eval)
        (["--tasks", "polyrl_arith_mc", "--limit", "inf"], "--limit must be > 0, got inf"),
        (["--tasks", "polyrl_arith_mc", "--limit", "nan"], "--limit must be > 0, got nan"),
        (["--data", "builtin:arithmetic?n=4", "--reward", "numeric", "--limit", "nan"], "--limit must be > 0, got nan"),
    ],
)
def test_more_argument_errors_come_before_the_model_loads(tmp_path, capsys, argv, message):
    """Each was taken silently (--num-fewshot -1 ran zero-shot; --limit 2.5 ran 2 documents) or failed only after
    the model loaded with another option's name (--limit 0.5 with --data: 'data.limit=0')."""
    assert cli("--model", str(tmp_path / "no-model"), *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "no-model" not in err, err


def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, unenterable_dir, capsys):
    """--output is written last: a folder given there (--output results/) or a file on its path ended the whole
    evaluation in an IsADirectoryError / FileExistsError traceback, its results unsaved."""
    (tmp_path / "results").mkdir()
    (tmp_path / "a-file").write_text("x")
    data = ["--model", str(tmp_path / "no-model"), "--data", "builtin:arithmetic?n=4", "--reward", "numeric"]
    for output, message in (
        (tmp_path / "results", f"--output {tmp_path / 'results'} is a folder; give the JSON file to write, e.g. "
         f"{tmp_path / 'results' / 'eval.json'}"),
        (tmp_path / "a-file" / "r.json", f"cannot be written: {tmp_path / 'a-file'} is a file, not a folder"),
        (unenterable_dir / "sub" / "r.json", f"cannot be reached: {unenterable_dir} may not be entered"),
    ):  # fmt: skip
        assert cli(*data, "--output", str(output)) == 2
        err = capsys.readouterr().err
        assert message in err and "no-model" not in err, err


def test_task_yaml_errors_name_the_file_before_the_model_loads(tmp_path, capsys):
    """A task YAML lm-eval cannot parse was reported as an unknown task (lm-eval skips such files silently), and one
    whose data cannot be loaded ended in a datasets traceback after the model had loaded."""
    broken, nodata = tmp_path / "broken", tmp_path / "nodata"
    broken.mkdir(), nodata.mkdir()
    (broken / "t.yaml").write_text("task: mytask\ndataset_path: json\n  oops: [\n")
    (nodata / "t.yaml").write_text(
        "task: mytask2\ndataset_path: json\ndataset_kwargs:\n  data_files: /no/such/file.json\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\ndoc_to_choice: ['a', 'b']\n"
    )
    model = ["--model", str(tmp_path / "no-model")]
    assert cli(*model, "--tasks", "mytask", "--include-path", str(broken)) == 2
    err = capsys.readouterr().err
    assert "t.yaml" in err and "could not read" in err and "no-model" not in err, err
    assert cli(*model, "--tasks", "mytask2", "--include-path", str(nodata)) == 2
    err = capsys.readouterr().err
    assert "could not build task(s) mytask2" in err and "/no/such/file.json" in err and "no-model" not in err, err


def test_reward_eval_takes_the_train_reward_specs():
    """A judge term, as docs/evaluation.md says (--reward takes what polyrl train --reward takes): it was read as a file
    name ('reward file judge:http://127.0.0.1 does not exist')."""
    from polyrl.eval.rewards import check_reward_eval

    prompts = check_reward_eval("builtin:arithmetic?n=3", "exact_match+0.5*judge:http://127.0.0.1:9/v1", limit=2)
    assert len(prompts) == 2 and prompts[0].answer is not None


def test_eval_engine_batch_tokens_default_by_device():
    """An eval engine batches 32768 tokens per forward on an accelerator (eager forwards are launch-bound below
    that), the rollout default 8192 on the CPU; an explicit value wins."""
    from polyrl.eval.loading import eval_batch_tokens, eval_engine
    from polyrl.models.decoder import build_model
    from polyrl.models.presets import preset_config

    assert eval_batch_tokens(torch.device("cpu")) == 8192
    assert eval_batch_tokens(torch.device("cuda", 0)) == 32768
    model = build_model(preset_config("tiny"), dtype=torch.float32, device=torch.device("cpu"), seed=0).eval()
    assert eval_engine(model, None, max_model_len=64, num_blocks=64).config.max_num_batched_tokens == 8192
    llm = eval_engine(model, None, max_model_len=64, num_blocks=64, max_num_batched_tokens=1024)
    assert llm.config.max_num_batched_tokens == 1024
