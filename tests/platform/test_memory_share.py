"""POLYRL_DEVICE_MEMORY_SHARE: a process sees a share of the device's memory (several processes on one device)."""

import pytest

from polyrl.errors import UserError
from polyrl.platform import device


class _FakeAccel:
    """The calls mem_get_info reads, with fixed numbers (a 100 GiB device, 80 free; this process's allocator holds
    10 GiB, of which 6 are allocated and 4 cached for reuse)."""

    @staticmethod
    def mem_get_info():
        return (80 * 2**30, 100 * 2**30)

    @staticmethod
    def memory_reserved():
        return 10 * 2**30

    @staticmethod
    def memory_allocated():
        return 6 * 2**30


@pytest.fixture
def fake_accelerator(monkeypatch):
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(device, "_mod", lambda: _FakeAccel)


def test_unset_is_the_whole_device(fake_accelerator, monkeypatch):
    monkeypatch.delenv("POLYRL_DEVICE_MEMORY_SHARE", raising=False)
    assert device.mem_get_info() == (80 * 2**30, 100 * 2**30)


def test_a_share_scales_total_and_counts_what_this_process_holds(fake_accelerator, monkeypatch):
    monkeypatch.setenv("POLYRL_DEVICE_MEMORY_SHARE", "0.3")
    free, total = device.mem_get_info()
    assert total == int(100 * 2**30 * 0.3)
    assert free == total - 6 * 2**30  # the 30 GiB share minus our 6 allocated (the 4 cached ones are reusable)


def test_a_share_never_reports_more_free_than_the_device_has(fake_accelerator, monkeypatch):
    monkeypatch.setenv("POLYRL_DEVICE_MEMORY_SHARE", "1.0")
    assert device.mem_get_info() == (80 * 2**30, 100 * 2**30)
    monkeypatch.setattr(_FakeAccel, "mem_get_info", staticmethod(lambda: (5 * 2**30, 100 * 2**30)))
    monkeypatch.setenv("POLYRL_DEVICE_MEMORY_SHARE", "0.5")
    assert device.mem_get_info() == ((5 + 4) * 2**30, 50 * 2**30)  # the device's 5 free plus our 4 cached


@pytest.mark.parametrize("bad", ["0", "1.5", "half", "-0.2"])
def test_a_bad_share_says_what_to_write(fake_accelerator, monkeypatch, bad):
    monkeypatch.setenv("POLYRL_DEVICE_MEMORY_SHARE", bad)
    with pytest.raises(UserError, match="fraction in \\(0, 1\\]"):
        device.mem_get_info()
