"""``--device`` of generate, serve, eval and the benches: a name torch does not know, a device type this machine does
not have, or an index past the last device is one clear sentence and exit 2 (it was torch's "Expected one of cpu,
cuda, ..." traceback, or a pin_memory error from the checkpoint loader)."""

from __future__ import annotations

import pytest

from polyrl.cli.main import main
from polyrl.errors import UserError
from polyrl.platform import device


def _absent_type() -> str:
    """A device type torch knows that this machine has none of."""
    return next(t for t in ("cuda", "npu", "musa", "mlu", "xpu") if device._type_count(t) == 0)


def test_parse_device_takes_what_this_machine_has():
    assert device.parse_device("cpu").type == "cpu"
    assert device.parse_device(str(device.torch_device())) == device.torch_device()


@pytest.mark.parametrize(
    "spec, says",
    [
        ("bogus", "--device 'bogus' is not a device torch knows; use cpu"),
        ("cuda:", "is not a device torch knows"),
    ],
)
def test_parse_device_refuses_unknown_names(spec, says):
    with pytest.raises(UserError, match=says.replace("(", r"\(")):
        device.parse_device(spec)


def test_parse_device_refuses_an_absent_type_and_a_past_the_end_index():
    kind = _absent_type()
    with pytest.raises(UserError, match=f"this machine has no {kind} device torch can use.*leave --device out"):
        device.parse_device(f"{kind}:0")
    if device.is_accelerator():
        dt, n = device.device_type(), device.count()
        with pytest.raises(UserError, match=f"only {n} {dt} device"):
            device.parse_device(f"{dt}:{n}")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "{model}", "--prompt", "hi", "--max-tokens", "2"],
        ["eval", "--model", "{model}", "--data", "builtin:arithmetic@test", "--reward", "numeric", "--n", "1"],
        ["serve", "--model", "{model}", "--port", "0"],
        ["bench", "rollout", "--shape", "tiny", "--batch", "2", "--gen-len", "2", "--baselines", "none"],
    ],
    ids=["generate", "eval", "serve", "bench-rollout"],
)
@pytest.mark.parametrize("spec", ["bogus", "absent"])
def test_commands_refuse_a_bad_device_before_loading(argv, spec, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = _absent_type() if spec == "absent" else spec
    rc = main([a.format(model=tiny_model_dir) for a in argv] + ["--device", spec])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"error: --device {spec}") or err.startswith(f"error: --device '{spec}'"), err
    assert "Traceback" not in err and "pin_memory" not in err


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--prompt-len", "-1"), ("--gen-len", "0")])
def test_bench_rollout_refuses_empty_sizes_before_building_the_model(flag, value, capsys):
    # before: --batch 0 ran and ended in a ZeroDivisionError, --prompt-len -1 in torch's negative-dimension traceback
    rc = main(["bench", "rollout", "--shape", "tiny", "--baselines", "none", "--gen-len", "2", flag, value])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert captured.err == f"error: {flag} {value}: --batch, --prompt-len and --gen-len must each be >= 1\n"
    assert "# tiny on" not in captured.out  # nothing was built or timed
