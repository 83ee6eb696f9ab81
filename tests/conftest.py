"""Shared session fixtures: tiny models every package's tests can use.

- ``tiny_model_dir``: a ``polyrl init-model --preset tiny`` folder (HF format, ChatML tokenizer), made once per
  session. Read-only by convention: copy it (``shutil.copytree``) before changing anything in it.
- ``tiny_config``: a factory ``tiny_config(family="qwen3", **hf_overrides) -> ModelConfig`` of a random-test-sized
  decoder of each family (llama, mistral, qwen2, qwen3) with that family's features switched on.
- ``tiny_model``: a factory ``tiny_model(family="qwen3", seed=0, **hf_overrides) -> DecoderLM`` (fp32, CPU,
  random HF-style init).

- ``_return_gpu_memory_between_parallel_tests`` (autouse): under pytest-xdist, each test's cached GPU memory is
  returned to the device when it ends (several workers share one GPU in the GPU suite).
- ``_restore_torch_global_modes`` (autouse): a test that builds a deterministic ``TrainEngine`` turns on
  ``torch.use_deterministic_algorithms`` for the process (what a run wants); the flag is put back after each
  test (to torch's default, off) so that later tests see the default.
- ``pytest_configure``: under pytest-xdist (``make test`` runs the CPU suite in 2 processes), each worker gets its share
  of the CPU cores as torch threads (``OMP_NUM_THREADS`` too, for the processes tests start), so workers do not
  oversubscribe the machine; an ``OMP_NUM_THREADS`` already set is kept.
- ``pytest_collection_modifyitems``: under pytest-xdist, the files that hold a ``slow`` test are collected first (the
  scheduler hands out whole files in collection order: the longest start first instead of finishing last). A serial
  run keeps pytest's order.
- ``pytest_runtest_logreport``: with ``POLYRL_TESTS_FAILURE_LOG=PATH`` (the GPU suite's stage sets it), each failure's
  traceback is appended to PATH the moment it happens, from every xdist worker: a run cut off by a time limit before
  pytest's summary still leaves the reasons.

- ``pytest_runtest_protocol`` (from ``gpu_sharing.py``): under pytest-xdist, ``gpu`` tests share the device under a
  lock, and one that runs out of memory beside other workers' tests is re-run alone (see that module).

Nothing here imports transformers at collection time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpu_sharing import pytest_runtest_protocol  # noqa: F401  (a hook: the GPU suite's workers share one device)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pytest_configure(config):
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // int(worker["workercount"]))))
    import torch

    torch.set_num_threads(int(threads))


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file keeps its order


def pytest_runtest_logreport(report):
    path = os.environ.get("POLYRL_TESTS_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def _restore_torch_global_modes():
    # Back to torch's default, not to the state at the test's start: a module-scoped fixture (a CLI run, say)
    # may already have switched it on before this function-scoped fixture starts.
    import torch

    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def _return_gpu_memory_between_parallel_tests():
    """Under pytest-xdist (the GPU suite runs test files in several processes on one GPU), memory a finished test
    freed goes back to the device, so the next test of another worker can have it (torch's allocator keeps it)."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import gc

        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gc.collect()
            # cuBLAS keeps its per-stream workspaces in the caching allocator: one allocated inside a big test's
            # segment pins the whole segment (the memory log showed a worker keeping ~60 GiB after such a test)
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()


# Per family: config.json fields that exercise what the family adds over plain Llama.
TINY_FAMILY_OVERRIDES: dict[str, dict] = {
    "llama": dict(
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(tie_word_embeddings=False, sliding_window=6),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1_000_000.0),
    "qwen3": dict(tie_word_embeddings=True, rope_theta=1_000_000.0),
}


@pytest.fixture
def unenterable_dir(tmp_path, monkeypatch):
    """A folder the user may not enter: ``Path.exists`` under it raises PermissionError, as it does for a non-root
    user under another user's 0700 folder (these tests run as root, who enters anywhere, so it is made to)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_exists = Path.exists

    def exists(self, *args, **kwargs):
        if locked in self.absolute().parents:
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", exists)
    return locked


def tiny_hf_dict(family: str = "qwen3", **overrides) -> dict:
    d = dict(
        model_type=family,
        vocab_size=131,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )
    d.update(TINY_FAMILY_OVERRIDES[family])
    d.update(overrides)
    return d


@pytest.fixture(scope="session")
def tiny_config():
    from polyrl.models.config import ModelConfig

    def make(family: str = "qwen3", **overrides):
        return ModelConfig.from_hf_dict(tiny_hf_dict(family, **overrides))

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    from polyrl.models.decoder import build_model

    def make(family: str = "qwen3", seed: int = 0, **overrides):
        return build_model(tiny_config(family, **overrides), seed=seed)

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from polyrl.models.presets import create_model_from_preset

    return create_model_from_preset("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)
