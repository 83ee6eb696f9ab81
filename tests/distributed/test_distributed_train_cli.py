"""``polyrl train --nproc-per-node 2`` end to end (torchrun, gloo, FSDP2) on the tiny preset: its loss curve
equals the one-process run with the same global batch, and its sharded checkpoint resumes in one process
where the one-process run would have been (data position converted across world sizes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyrl.cli.main import main

TOL = 1e-5
ARGS = ["--data", "builtin:arithmetic?n=48", "--micro-batch-tokens", "256", "--tokens-per-step", "512"]
ARGS += ["--max-seq-len", "64", "--lr", "1e-2", "--lr-decay", "constant", "--log-every", "1", "--seed", "1"]


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_cli_run_matches_and_resumes_in_one_process(tiny_model_dir, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    cmd = [sys.executable, "-m", "polyrl.cli.main", "train", "--nproc-per-node", "2", "--model", str(tiny_model_dir)]
    cmd += ["--out", str(two), "--max-steps", "2", "--save-every", "1", *ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x 2 ranks" in proc.stdout
    manifest = json.loads((two / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["sharded"] is True and manifest["world_size"] == 2
    assert (two / "final" / "config.json").is_file() and json.loads((two / "summary.json").read_text())[
        "world_size"
    ] == 2

    assert main(["train", "--model", str(tiny_model_dir), "--out", str(one), "--max-steps", "3", *ARGS]) == 0
    reference = _losses(one)
    assert _losses(two) == pytest.approx(reference[:2], abs=TOL)

    # Resume the 2-rank run's step-2 checkpoint in this one process and take step 3.
    assert (
        main(["train", "--model", str(tiny_model_dir), "--out", str(two), "--max-steps", "3", "--resume", *ARGS]) == 0
    )
    assert _losses(two)[-1] == pytest.approx(reference[2], abs=TOL)
