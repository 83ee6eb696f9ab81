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


def _signal_a_two_rank_run(model_dir, out, send) -> tuple[int, str, int]:
    """Start ``polyrl train --nproc-per-node 2`` into ``out``, call ``send(launcher)`` once two steps are logged; the
    launcher's exit code, its output, and the step both ranks stopped after (they must name the same one)."""
    import time

    cmd = [sys.executable, "-m", "polyrl.cli.main", "train", "--nproc-per-node", "2", "--model", str(model_dir)]
    proc = subprocess.Popen([*cmd, "--out", str(out), "--max-steps", "100000", *ARGS], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").is_file() and len(_losses(out)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)[0][-3000:]
            time.sleep(0.1)
        send(proc)
        log, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stops = [line for line in log.splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert len(stops) == 2 and stops[0] == stops[1], log[-3000:]  # both ranks, the same step
    return proc.returncode, log, int(stops[0].split()[5])


def test_sigterm_to_the_launcher_stops_every_rank_after_one_step_with_a_checkpoint(tiny_model_dir, tmp_path):
    """A SIGTERM to ``polyrl train --nproc-per-node 2`` goes on to torchrun and every rank: both finish the step in
    progress, agree on it, write its sharded checkpoint and stop (no rank left running); the one-process resume of
    that checkpoint takes the next step where the one-process run would be."""
    import signal

    environ = {}

    def send(proc):
        for pid in _tree(proc.pid):
            try:
                if b"torch.distributed.run" in open(f"/proc/{pid}/cmdline", "rb").read():  # noqa: SIM115, PTH123
                    raw = open(f"/proc/{pid}/environ", "rb").read()  # noqa: SIM115, PTH123
                    environ.update(kv.decode().split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)
            except OSError:
                pass
        proc.send_signal(signal.SIGTERM)

    out = tmp_path / "two"
    rc, log, k = _signal_a_two_rank_run(tiny_model_dir, out, send)
    assert rc == 143, log[-3000:]  # as one process stopped by SIGTERM (torchrun itself exits 1)
    # torchrun's grace before its SIGKILL, raised from its 30 s for a step and a checkpoint of a large model
    assert environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") == "600", sorted(environ)
    manifest = json.loads((out / "checkpoints" / f"step-{k:08d}" / "manifest.json").read_text())
    assert manifest["sharded"] is True and manifest["world_size"] == 2 and len(_losses(out)) == k
    one = tmp_path / "one"
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(one), "--max-steps", str(k + 1), *ARGS]) == 0
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(out), "--max-steps", str(k + 1), "--resume",
                 *ARGS]) == 0  # fmt: skip
    assert _losses(out)[-1] == pytest.approx(_losses(one)[-1], abs=TOL)


def _tree(pid):
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    import os

    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115, PTH123
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def test_sigterm_to_every_process_at_once_still_saves_the_step(tiny_model_dir, tmp_path):
    """Slurm (``scancel``, a time limit) sends SIGTERM to every process of the step at once: the launcher, torchrun
    and the ranks. torchrun then passes it on to each rank again, a moment later: that echo is not the "second
    SIGTERM" that stops a rank at once; both ranks still save the step in progress."""
    import os
    import signal

    def everyone(proc):
        for pid in _tree(proc.pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    out = tmp_path / "two"
    _, _, k = _signal_a_two_rank_run(tiny_model_dir, out, everyone)
    assert (out / "checkpoints" / f"step-{k:08d}" / "manifest.json").is_file()


def test_torchrun_reads_the_shutdown_grace_the_launcher_sets(monkeypatch):
    """The launcher's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is torchrun's grace between SIGTERM and SIGKILL (torch >=
    2.12, as here); a value the user set is kept."""
    from torch.distributed.launcher.api import LaunchConfig

    from polyrl.cli.train import torchrun_env

    assert torchrun_env({})["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"
    assert torchrun_env({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"})["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "45"
    # set but empty (``export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=``) is unset, not a value torchrun would fail to parse
    for blank in ("", " "):
        env = torchrun_env({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": blank, "PATH": "/bin"})
        assert env == {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600", "PATH": "/bin"}
    with pytest.raises(ValueError):  # what torchrun does with an empty one
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", torchrun_env({})["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2).shutdown_timeout == 600


SLOW_EXPORT = """
import os
if os.environ.get("POLYRL_TEST_SLOW_EXPORT") and "LOCAL_RANK" in os.environ:  # torchrun's ranks only
    import pathlib, time
    import polyrl.run.offline as offline

    real = offline.export_final

    def slow(*args, **kwargs):
        pathlib.Path(os.environ["POLYRL_TEST_SLOW_EXPORT"], f"exporting-{os.environ['LOCAL_RANK']}").touch()
        time.sleep(4)
        return real(*args, **kwargs)

    offline.export_final = slow
"""


def test_sigterm_to_the_launcher_while_the_ranks_finish_lets_the_run_finish_with_exit_0(tiny_model_dir, tmp_path):
    """A SIGTERM to ``polyrl train --nproc-per-node 2`` while the ranks write the final model: they finish it
    (summary: finished), and the launcher exits 0, as one process would, though torchrun, signalled, exits 1."""
    import os
    import signal
    import time

    hooks, out = tmp_path / "hooks", tmp_path / "two"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_EXPORT)
    env = dict(os.environ, POLYRL_TEST_SLOW_EXPORT=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "polyrl.cli.main", "train", "--nproc-per-node", "2", "--model", str(tiny_model_dir)]
    proc = subprocess.Popen([*cmd, "--out", str(out), "--max-steps", "2", *ARGS], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"exporting-{r}").is_file() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)[0][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "the run is finishing" in log, log[-3000:]  # the ranks got it, during the finish
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert (out / "final" / "config.json").is_file()
    assert proc.returncode == 0, log[-3000:]
