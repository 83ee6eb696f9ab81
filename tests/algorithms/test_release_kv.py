"""``release_kv="auto"`` (the default): keep the rollout KV cache and its graphs across RL steps on an accelerator
when the cache takes at most a quarter of device memory; always release on the CPU; explicit settings win."""

from __future__ import annotations

import pytest

from polyrl.algorithms.grpo import GRPOConfig
from polyrl.errors import ConfigError
from polyrl.run import colocated


def test_auto_resolution(monkeypatch):
    assert colocated.keeps_kv_released(True, 1) and not colocated.keeps_kv_released(False, 10**15)
    monkeypatch.setattr(colocated.device, "device_type", lambda: "cpu")
    assert colocated.keeps_kv_released("auto", 1)  # the CPU gives its memory back to training
    monkeypatch.setattr(colocated.device, "device_type", lambda: "cuda")
    monkeypatch.setattr(colocated.device, "mem_get_info", lambda: (50 * 2**30, 140 * 2**30))
    assert not colocated.keeps_kv_released("auto", 35 * 2**30)  # 25% of 140 GiB: kept
    assert colocated.keeps_kv_released("auto", 36 * 2**30)


def test_config_rejects_other_values():
    assert GRPOConfig().release_kv == "auto"
    with pytest.raises(ConfigError, match="release_kv"):
        GRPOConfig(release_kv="sometimes")
