"""`polyrl bench grpo --async` and the reward-curve mode on the CPU at the tiny preset: one row per K with the
step time, split and staleness (K = 1 trains exactly one version stale), equal-length reward curves per K written
as JSON (+ PNG), the busy-fraction arithmetic, and the TRL row's settings (issue 27). The GPU test runs the same
rows on an accelerator, where the busy fraction is measured."""

from __future__ import annotations

import json
import re

import pytest

from polyrl.bench import grpo_async, grpo_trl
from polyrl.bench.gpu_busy import union_fraction
from polyrl.cli.main import main
from polyrl.errors import ConfigError

TINY = ["--shape", "tiny", "--prompts", "2", "--n", "2", "--gen-len", "4", "--prompt-len", "6"]
ROW_KEYS = {"k", "producer", "step_s", "ratio_to_sync", "gpu_busy", "rollout_s", "logprob_s", "train_s", "wait_s"}
ROW_KEYS |= {"sync_s", "staleness_mean", "staleness_max", "stale_dropped", "response_length", "steps_all"}


def _async_rows(model_dir, tmp_path, capsys, extra=()):
    out = tmp_path / "async.json"
    argv = ["bench", "grpo", *TINY, "--steps", "2", "--warmup", "1", "--micro-batch-tokens", "128", "--async", "1"]
    argv += ["--model-dir", str(model_dir)]
    assert main([*argv, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_async_rows_sync_and_k1(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Sync and K = 1 colocated, and the 1 rollout + 1 train row's plumbing: the placement the bench picks on 2 GPUs
    (cuda:1, cuda:0) stood in for by a CPU rollout replica; its run is the real loop's (a worker process fed over
    gloo, tests/run/test_placement.py), here the row's config, validated by the run's config builder, is checked."""
    from polyrl.run import config as run_config

    assert grpo_async.placement_pair() is None  # the CPU: no such row, and the note says why
    assert grpo_async.two_gpu_note(None).startswith("not run: needs 2 GPUs (no GPU here)")
    split_raw = []
    real = grpo_async.timed_run

    def timed(raw, warmup, steps, rollout_stream=False, busy_devices=None):
        if raw["grpo"].get("rollout_devices"):
            split_raw.append((raw, busy_devices))
            run_config.build(raw)  # the placement settings pass the run's own validation
            return {**real_row, "steps_all": [1.0] * (warmup + steps + 1)}
        return real(raw, warmup, steps, rollout_stream)

    monkeypatch.setattr(grpo_async, "placement_pair", lambda: ("cpu", ""))
    monkeypatch.setattr(grpo_async, "timed_run", timed)
    real_row = {"k": 1, "producer": "process", "step_s": 0.5, "train_s": 0.1}
    res, text = _async_rows(tiny_model_dir, tmp_path, capsys)
    rows = res["async_rows"]
    assert [(r["k"], r["placement"]) for r in rows] == [(0, "1"), (1, "1"), (1, "1+1")]  # K = 0 added: the reference
    for r in rows[:2]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["step_s"] > 0 and r["rollout_s"] > 0 and r["train_s"] > 0
        assert r["gpu_busy"] is None  # the CPU: n/a
    sync, k1, split = rows
    assert sync["ratio_to_sync"] == 1.0 and sync["producer"] == "sync" and sync["staleness_mean"] == 0.0
    assert k1["ratio_to_sync"] == pytest.approx(k1["step_s"] / sync["step_s"])
    # K = 1: every timed sample was generated one version before the weights it trains
    assert k1["producer"] == "thread" and k1["staleness_mean"] == 1.0 and k1["staleness_max"] == 1.0
    assert k1["stale_dropped"] == 0.0 and k1["sync_s"] > 0
    assert len(sync["steps_all"]) == 3 and len(k1["steps_all"]) == 4  # warm-up + timed (+ K untimed)
    assert 4 * 0.5 <= k1["response_length"] <= 4  # at most --gen-len new tokens
    ((raw, busy),) = split_raw
    g = raw["grpo"]
    assert (g["rollout_devices"], g["train_devices"], g["async_producer"], g["max_staleness"]) == (
        "cpu",
        "",
        "process",
        1,
    )
    assert busy is None and raw["out"].endswith("k1-split")  # no NVML on the CPU
    assert split["producer"] == "process (cpu -> default)" and split["ratio_to_sync"] == pytest.approx(
        0.5 / sync["step_s"]
    )
    header = next(line for line in text.splitlines() if line.startswith("k "))
    for col in ("placement", "step_s", "ratio_to_sync", "gpu_busy", "rollout_s", "train_s", "wait_s"):
        assert col in header
    assert "1 rollout + 1 train GPU: ran with --rollout-devices cpu --train-devices the default device" in text
    assert res["two_gpu"].startswith("ran with") and "n/a (CPU)" in text


def test_curve_mode_writes_equal_length_curves_per_k(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from polyrl.bench import grpo_curve

    # the demo's recipe at a CPU test's size: 8 prompts x 4 samples per step
    monkeypatch.setitem(grpo_curve.CURVE, "prompts", 8)
    monkeypatch.setitem(grpo_curve.CURVE, "n", 4)
    out, curve = tmp_path / "bench.json", tmp_path / "curve" / "c"
    argv = ["bench", "grpo", "--model-dir", str(tiny_model_dir), "--task", "arithmetic", "--curve-samples", "70"]
    argv += ["--curve-sft-steps", "0", "--async", "0,1", "--curve-out", str(curve), "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    written = json.loads(curve.with_suffix(".json").read_text())
    assert written == json.loads(out.read_text())["curve"]
    curves = written["curves"]
    assert set(curves) == {"k0", "k1"}
    for c in curves.values():
        assert c["samples"] == [32, 64]  # 70 samples = 2 whole steps of 8 prompts x 4 samples
        assert len(c["reward"]) == 2 and all(0.0 <= r <= 1.0 for r in c["reward"])
        assert c["final_steps"] == 1 and c["final_mean"] == c["reward"][-1]
    # step 1 of both runs samples the same prompts with the same seeds from the same weights
    assert curves["k0"]["reward"][0] == curves["k1"]["reward"][0]
    pytest.importorskip("matplotlib")
    assert curve.with_suffix(".png").stat().st_size > 1000
    assert re.search(r"final mean", text)


def test_parse_ks_and_final_window_and_union():
    assert grpo_async.parse_ks("2,1") == [0, 1, 2]
    with pytest.raises(ConfigError, match="max-staleness values"):
        grpo_async.parse_ks("1,x")
    from polyrl.bench.grpo_curve import final_window

    assert final_window([0.0, 0.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0]) == (0.9, pytest.approx(0.1), 2)
    # two overlapping spans and one outside the window: busy 2..6 of the window 0..10
    assert union_fraction([(2.0, 5.0), (4.0, 6.0), (11.0, 12.0)], 0.0, 10.0) == pytest.approx(0.4)
    assert union_fraction([(-5.0, 20.0)], 0.0, 10.0) == 1.0 and union_fraction([], 1.0, 1.0) is None


def test_trl_settings_and_missing_trl(monkeypatch, capsys, tmp_path):
    desc, micro, force_len, ckpt = grpo_trl.TRL_CONFIGS["fast"]
    assert (micro, force_len) == (64, False)  # the fast setting: 64 per fwd/bwd, no forced minimum length
    assert grpo_trl.TRL_CONFIGS["old"][1:3] == (16, True)
    monkeypatch.setitem(__import__("sys").modules, "trl", None)  # import trl raises ImportError
    assert grpo_trl.trl_rows(tmp_path, None, None) == {}
    assert f"pip install trl=={grpo_trl.TRL_PINNED}" in capsys.readouterr().out


@pytest.mark.gpu
def test_async_rows_measure_gpu_busy_on_an_accelerator(tiny_model_dir, tmp_path, capsys):
    from polyrl.platform import device

    if not device.is_accelerator():
        pytest.skip("needs an accelerator")
    res, _ = _async_rows(tiny_model_dir, tmp_path, capsys, extra=("--rollout-stream", "both"))
    rows = res["async_rows"]
    assert [(r["k"], r["producer"]) for r in rows] == [(0, "sync"), (1, "thread"), (1, "thread+stream")]
    for r in rows:
        assert r["gpu_busy_kind"] in ("nvml", "events")
        assert r["gpu_busy"] is None or 0.0 <= r["gpu_busy"] <= 1.0
        assert r["staleness_mean"] == (1.0 if r["k"] else 0.0)


def test_trl_row_times_each_setting_and_ratios_the_fastest(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    out = tmp_path / "trl.json"
    argv = ["bench", "grpo", *TINY, "--steps", "1", "--warmup", "1", "--micro-batch-tokens", "128", "--kv", "keep"]
    assert main([*argv, "--model-dir", str(tiny_model_dir), "--trl-configs", "fast,old", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["trl_version"] and res["trl_config"] in ("fast", "old")
    steady = {name: res[f"trl_{name}_step_s"] for name in ("fast", "old")}
    assert res["trl_step_s"] == min(steady.values()) and res["trl_config"] == min(steady, key=steady.get)
    assert res["speedup_vs_trl"] == pytest.approx(res["trl_step_s"] / res["step_s"])
    assert res["trl_old_completion_len"] == 4  # the old row forces --gen-len new tokens
    assert "TRL fast (no forced minimum length; 4 per fwd/bwd" in capsys.readouterr().out


@pytest.mark.gpu
def test_nvml_busy_sees_a_busy_gpu_and_an_idle_one():
    import time

    import torch

    from polyrl.bench.gpu_busy import NvmlBusy
    from polyrl.platform import device

    pynvml = pytest.importorskip("pynvml")
    if not device.is_accelerator():
        pytest.skip("needs an accelerator")
    meter = NvmlBusy(pynvml, [device.current_index()])
    try:
        x = torch.randn(4096, 4096, device=device.torch_device())
        time.sleep(1.5)  # idle: NVML's own averaging window is up to 1 s
        t0 = time.perf_counter()
        time.sleep(1.0)
        t1 = time.perf_counter()
        end = t1 + 3.0
        while time.perf_counter() < end:
            for _ in range(20):
                x = (x @ x).clamp_(-1, 1)
            device.synchronize()
        t2 = time.perf_counter()
        idle, busy = meter.fraction(t0, t1)[0], meter.fraction(t1 + 1.0, t2)[0]
    finally:
        meter.close()
    assert meter.error is None
    assert busy is not None and busy > 0.8, busy
    assert idle is not None and idle < 0.3, idle
