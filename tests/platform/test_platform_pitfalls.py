"""Every pitfall rule fires on its 'fires' fixture with its severity and passes on its 'passes' fixture."""

from __future__ import annotations

import pytest
from _platform_fixtures import SNAPSHOTS, evaluate, load_base, merge, pitfall_case, row

from polyrl.platform import kb, pitfalls

RULES = [r.id for r in kb.rules()]


@pytest.mark.parametrize("rule_id", RULES)
def test_rule_fires(rule_id):
    rule = next(r for r in kb.rules() if r.id == rule_id)
    res, rows = evaluate(pitfall_case(rule_id, "fires"))
    r = row(rows, rule_id)
    assert r.status == rule.severity.upper(), (r, res.to_dict())
    assert r.message and r.next_step
    assert "{" not in r.message + r.next_step, "unfilled template field"
    if rule.severity == "fail":
        assert not pitfalls.ready(rows)


@pytest.mark.parametrize("rule_id", RULES)
def test_rule_passes(rule_id):
    _, rows = evaluate(pitfall_case(rule_id, "passes"))
    assert row(rows, rule_id).status == "OK"


def _all_outputs():
    for path in sorted(SNAPSHOTS.glob("*.json")):
        yield path.stem, load_base(path.stem)
    for rule_id in RULES:
        for which in ("fires", "passes"):
            yield f"{rule_id}.{which}", pitfall_case(rule_id, which)


def test_wording_is_vendor_neutral():
    """'NVIDIA' appears only when the platform is NVIDIA."""
    checked = 0
    for name, snap in _all_outputs():
        res, rows = evaluate(snap)
        text = " ".join(r.title + r.message + r.next_step for r in rows) + " ".join(res.evidence)
        if res.platform != "nvidia":
            checked += 1
            assert "NVIDIA" not in text, (name, res.platform, text)
    assert checked >= 20


def test_unverified_facts_soften_the_wording():
    # MUSA's Triton backend directory is an unverified fact: the warning says "reportedly".
    snap = merge(
        load_base("musa"),
        {"triton_providers": [{"dist": "triton", "version": "3.6.0", "local": None, "backends": ["amd", "nvidia"]}]},
    )
    r = row(evaluate(snap)[1], "triton-wrong-build")
    assert r.status == "WARN" and "reportedly not the Triton build" in r.message
    # Ascend's Triton distribution is verified: no hedge.
    r = row(evaluate(pitfall_case("triton-wrong-build", "fires"))[1], "triton-wrong-build")
    assert "reportedly" not in r.message and "triton-ascend" in r.next_step


def test_autoload_failure_suggests_disabling_autoload():
    r = row(evaluate(pitfall_case("torch-plugin-autoload-failed", "fires"))[1], "torch-plugin-autoload-failed")
    assert "'torch_musa'" in r.message and "undefined symbol" in r.message
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in r.next_step
    plain = row(evaluate(pitfall_case("torch-plugin-autoload-failed", "fires"))[1], "torch-import-failed")
    assert plain.status == "OK"  # one failure, one row


def test_driver_rule_reads_smi_header_versions():
    r = row(evaluate(pitfall_case("driver-older-than-runtime", "fires"))[1], "driver-older-than-runtime")
    assert "12.2" in r.message and "12.8" in r.message
    # without --deep and without a visible device the driver cannot be judged: skipped, not OK
    blind = merge(load_base("nvidia"), {"torch_runtime": {"count": 0, "devices": [], "device_type": "cpu"}})
    assert row(evaluate(blind)[1], "driver-older-than-runtime").status == "SKIP"


def test_extension_mismatch_names_both_versions():
    r = row(evaluate(pitfall_case("vendor-extension-mismatch", "fires"))[1], "vendor-extension-mismatch")
    assert "torch-npu 2.9.0.post1" in r.message and "torch 2.10.0" in r.message and "2.10.0" in r.next_step


def test_sdk_rule_gives_the_setup_command():
    r = row(evaluate(pitfall_case("sdk-env-not-sourced", "fires"))[1], "sdk-env-not-sourced")
    assert "/usr/local/Ascend" in r.message and "set_env.sh" in r.next_step
