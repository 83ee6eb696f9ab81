"""Issue 33 items 12-13: a reward file that exits at import, a dead reward worker, and ``fit(...)`` at the top level
of a script (spawn/forkserver workers re-import the main module) each end in one line that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from polyrl.algorithms import rewards as R
from polyrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_reward_file_that_exits_at_import_names_file_and_exit(tmp_path):
    f = tmp_path / "exits.py"
    f.write_text("import sys\nsys.exit(3)\n\ndef fn(c, e):\n    return 1.0\n")
    with pytest.raises(ConfigError) as err:
        R.RewardPool(f"{f}:fn", workers=0)
    msg = str(err.value)
    assert f"reward file {f} failed to import: SystemExit: 3" in msg and "__main__" in msg


def test_dead_worker_reports_its_real_exit_code(tmp_path):
    f = tmp_path / "dies.py"
    f.write_text("import os\n\ndef fn(c, e):\n    os._exit(7)\n")
    with R.RewardPool(f"{f}:fn", workers=1, timeout=30) as pool:
        result = pool.score(["a"], [{"answer": "a"}])
    assert result.failures["crash"] == 1
    assert result.messages == [f"crash: the reward worker running {f}:fn died (exit code 7)"]


def test_worker_killed_by_a_signal_names_it(tmp_path):
    f = tmp_path / "segv.py"
    f.write_text("import os, signal\n\ndef fn(c, e):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    with R.RewardPool(f"{f}:fn", workers=1, timeout=30) as pool:
        result = pool.score(["a"], [{"answer": "a"}])
    assert result.messages == [f"crash: the reward worker running {f}:fn died (killed by signal 9, SIGKILL)"]


@pytest.mark.skipif(sys.platform == "win32", reason="forkserver/spawn main re-import")
def test_fit_at_module_level_fails_at_once_with_the_fix(tmp_path, tiny_model_dir):
    script = tmp_path / "train_ppo.py"
    script.write_text(
        textwrap.dedent(f"""
        from polyrl.trainer import fit
        fit("grpo", model={str(tiny_model_dir)!r}, data="builtin:arithmetic?max=9&n=16", out={str(tmp_path / "out")!r},
            train={{"max_steps": 1, "log_every": 100}},
            grpo={{"reward": "exact_match", "reward_workers": 1, "prompts_per_step": 1, "samples_per_prompt": 2,
                   "max_new_tokens": 2}})
        """)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("polyrl.errors.UserError: ") and 'if __name__ == "__main__":' in last, proc.stderr[-2000:]
    assert elapsed < 90


# ---- adversarial reward specs and return values -----------------------------------------------------------------
ODD = """
import numpy as np

def one(c): return 1.0
def three(c, e, extra): return 1.0
def kw_only(c, e, *, weight): return 1.0
def per_batch(completions, examples): return [1.0 for _ in completions]
def np_bool(c, e): return np.bool_(c == e["answer"])
def np_zero_d(c, e): return np.array(0.5)
def torch_scalar(c, e):
    import torch
    return torch.tensor(0.25)
def dict_np(c, e): return {"reward": np.float32(1.0), "bonus": np.array(2.0)}
def raises(c, e):
    raise KeyError("answer_text")
"""


@pytest.fixture()
def odd_file(tmp_path):
    path = tmp_path / "odd_rewards.py"
    path.write_text(ODD)
    return path


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # a folder, a relative file that is not there, a file without a function
        ("{dir}:fn", "reward file '{dir}' is a folder (from --reward '{dir}:fn'); give the Python file in it"),
        ("nope.py:fn", "reward file 'nope.py' does not exist (looked for {cwd}/nope.py)"),
        ("{file}", "reward '{file}' names a file but no function; add it: --reward {file}:FUNCTION_NAME"),
        ("{file}:on", "has no function 'on' (did you mean one?); it defines dict_np, kw_only, np_bool"),
        # a signature every call would fail on is refused when the spec resolves
        ("{file}:one", "one(c) cannot be called as one(completion, example) (too many positional arguments)"),
        ("{file}:three", "three(c, e, extra) cannot be called as three(completion, example) (missing a required"),
        ("{file}:kw_only", "def kw_only(completion, example) -> float"),
        # sums: the wrong term is named
        ("exact_match+0.2*think_fromat", "unknown reward 'think_fromat' in 'exact_match+0.2*think_fromat' (did you"),
        ("exact_match+0.2.3*think_format", "the weight '0.2.3' is not a number; write it as 0.2*think_format"),
        ("exact_match + 2x*think_format", "reward term '2x*think_format' of 'exact_match + 2x*think_format'"),
        ("1e400*exact_match", "reward term '1e400*exact_match' of '1e400*exact_match': the weight must be a finite"),
        ("nan*exact_match+think_format", "the weight must be a finite number"),
        ("exact_match++think_format", "the reward sum 'exact_match++think_format' has an empty term"),
        ("exact_match+0.5*{file}:np_bool", "one reward pool runs one function or a sum of builtins; open the sum with"),
        ("exact_match+exact_match", "names 'exact_match' twice; keep one term and weight it instead"),
        ("exact_match+0.5*rewards.py", "reward term 'rewards.py' of 'exact_match+0.5*rewards.py' names a file but no"),
    ],
)
def test_bad_reward_specs_name_what_is_wrong(spec, message, odd_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fill = {"dir": str(tmp_path), "file": str(odd_file), "cwd": str(tmp_path.resolve())}
    with pytest.raises(ConfigError) as err:
        R.resolve(spec.format(**fill))
    assert message.format(**fill) in str(err.value)


def test_numpy_and_torch_scalars_count_and_sequences_say_one_number(odd_file):
    examples = [{"answer": "a"}, {"answer": "b"}]
    scored = {}
    for name in ("np_bool", "np_zero_d", "torch_scalar", "dict_np", "per_batch", "raises"):
        scored[name] = R.RewardPool(f"{odd_file}:{name}", workers=0, failure_reward=-1.0).score(["a", "x"], examples)
    assert scored["np_bool"].rewards == [1.0, 0.0] and scored["np_bool"].num_failures == 0  # booleans count as 0/1
    assert scored["np_zero_d"].rewards == [0.5, 0.5] and scored["torch_scalar"].rewards == [0.25, 0.25]
    assert scored["dict_np"].rewards == [1.0, 1.0] and scored["dict_np"].metrics()["reward/bonus"] == 2.0
    batch = scored["per_batch"]
    assert batch.rewards == [-1.0, -1.0] and batch.failures["non_number"] == 2
    assert "a reward function scores one completion: return one number, not one per sample" in batch.messages[0]
    # an exception names the line of the user's file that raised it
    assert scored["raises"].messages[0] == "error: KeyError: 'answer_text' (odd_rewards.py:15 in raises)"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--reward", "{file}:three"], "three(c, e, extra) cannot be called as three(completion, example)"),
        (["--reward", "{missing}:fn"], "failed to import: ModuleNotFoundError: No module named 'polyrl_no_such_mod'"),
        (["--reward", "{dir}:fn"], "is a folder"),
        (["--set", "grpo.failure_reward=nan"], "grpo.failure_reward must be a finite number"),
        (["--set", 'grpo.failure_reward="low"'], "grpo.failure_reward must be a finite number"),
        (["--set", 'grpo.reward_timeout="10"'], "grpo.reward_timeout must be a number of seconds > 0, got '10'"),
        (["--set", "grpo.reward_timeout=inf"], "grpo.reward_timeout must be a number of seconds > 0, got inf"),
    ],
)
def test_reward_errors_exit_2_before_the_model_loads(extra, message, odd_file, tmp_path, capsys):
    """The model folder does not exist: each error here is raised while the config is checked (a broken reward
    file used to fail after the policy had loaded; a string timeout or a NaN failure reward was a traceback or a
    run of NaN rewards)."""
    from polyrl.cli.main import main

    missing = tmp_path / "needs_missing.py"
    missing.write_text("import polyrl_no_such_mod\n\ndef fn(c, e):\n    return 1.0\n")
    fill = {"file": str(odd_file), "missing": str(missing), "dir": str(tmp_path)}
    argv = ["train", "--algo", "grpo", "--model", str(tmp_path / "no-model"), "--data", "builtin:arithmetic"]
    argv += ["--out", str(tmp_path / "o"), *[a.format(**fill) for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "no-model" not in err, err


def test_a_failing_reward_in_a_run_names_the_spec_the_fallback_and_the_line(tiny_model_dir, tmp_path, capsys):
    """The per-step line said only 'reward function failure (N this step): error: RuntimeError: boom': not which
    reward, what the samples were given instead, nor where it raised."""
    from polyrl.cli.main import main

    f = tmp_path / "boom.py"
    f.write_text("def fn(completion, example):\n    raise RuntimeError('boom')\n")
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", "builtin:arithmetic?max=9&n=4"]
    argv += ["--out", str(tmp_path / "o"), "--max-steps", "1", "--reward", f"{f}:fn", "--reward-workers", "0"]
    argv += ["--prompts-per-step", "1", "--n", "2", "--max-new-tokens", "2", "--report-to", "none"]
    argv += ["--micro-batch-tokens", "256", "--set", "grpo.failure_reward=-0.5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        f"step 1: reward '{f}:fn' failed on 2 of 2 samples (each scored failure_reward=-0.5; counted in "
        "reward_failures_*): error: RuntimeError: boom (boom.py:2 in fn)"
    ) in out, out
