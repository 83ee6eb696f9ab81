"""device.visible_devices reads the knowledge base for the current device type (this CPU machine: none apply)."""

from __future__ import annotations

import pytest

from polyrl.platform import device


def test_visible_devices_on_cpu_ignores_accelerator_variables(monkeypatch):
    if device.device_type() != "cpu":
        pytest.skip("this machine has an accelerator; the CPU case does not apply")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    assert device.visible_devices() == {}


@pytest.mark.gpu
def test_visible_devices_on_cuda(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    assert device.visible_devices() == {"CUDA_VISIBLE_DEVICES": "0"}
