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
