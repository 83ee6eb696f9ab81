"""A run SIGKILLed at a random step and resumed gives bitwise the per-step losses of an uninterrupted run
(CPU, deterministic mode); a SIGKILL inside a checkpoint write leaves the previous checkpoint loadable."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from polyrl.train import CheckpointConfig, CheckpointManager, latest_checkpoint, load_checkpoint
from polyrl.train.checkpoint import list_checkpoints

WORKER = Path(__file__).with_name("resume_worker.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 10, 3


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKER.parent), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # same thread count in every run: bitwise-stable CPU reductions
    return env


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(p[1]): p[2] for p in (ln.split() for ln in lines) if p and p[0] == "loss"}


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(WORKER), str(run_dir), "--steps", str(STEPS), "--every", str(EVERY), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)


def test_sigkill_at_random_step_then_resume_is_bitwise_identical(tmp_path):
    full = _run(tmp_path / "full")
    assert full.returncode == 0, full.stderr
    reference = _losses(full.stdout.splitlines())
    assert sorted(reference) == list(range(1, STEPS + 1))

    kill_at = random.Random().randint(1, STEPS - 1)
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, str(WORKER), str(run_dir), "--steps", str(STEPS), "--every", str(EVERY), "--handshake"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(f"loss {kill_at} "):
                proc.send_signal(signal.SIGKILL)
                break
            if line.startswith("loss "):
                proc.stdin.write("go\n")
                proc.stdin.flush()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"worker did not reach step {kill_at}: {proc.stderr.read()}"
    before = _losses(seen)
    assert max(before) == kill_at

    resumed = _run(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    start = int(resumed.stdout.split()[1])
    assert start == (kill_at // EVERY) * EVERY, f"killed at {kill_at}, resumed from {start}"
    after = _losses(resumed.stdout.splitlines())
    assert sorted(after) == list(range(start + 1, STEPS + 1))
    for step, loss in {**before, **after}.items():
        assert loss == reference[step], f"step {step} (killed at {kill_at}): {loss} != {reference[step]}"
    for step in set(before) & set(after):
        assert before[step] == after[step]

    # metrics.jsonl has each step once, the re-run steps replacing the killed run's records
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [float.hex(r["loss"]) for r in records] == [reference[s] for s in range(1, STEPS + 1)]


def test_sigkill_during_checkpoint_write_leaves_previous_loadable(tmp_path):
    run_dir = tmp_path / "run"
    dead = _run(run_dir, "--die-in-commit", str(2 * EVERY))
    assert dead.returncode == -signal.SIGKILL, dead.stderr
    assert max(_losses(dead.stdout.splitlines())) == 2 * EVERY - 1  # died inside step 2*EVERY's save
    root = run_dir / "checkpoints"
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the interrupted write should have left its temp dir"
    assert [p.name for p in list_checkpoints(root)] == [f"step-{EVERY:08d}"]
    last = latest_checkpoint(run_dir)
    assert load_checkpoint(last, restore_rng=False).data_state == {"position": EVERY}

    # the next manager start cleans the leftover; the kill-and-resume test covers resuming itself
    manager = CheckpointManager(run_dir, CheckpointConfig(every_n_steps=EVERY, keep_last_k=2))
    assert [p.name for p in manager.cleaned] == leftovers
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert manager.latest() == last
