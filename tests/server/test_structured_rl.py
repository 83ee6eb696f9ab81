"""RL rollouts constrained by ``grpo.rollout_response_format``: every sampled completion matches the grammar, the
trainer learns from the unmasked log-probs and the run reports what the mask removed (``rollout_mask_logmass``)."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main
from polyrl.errors import UserError
from polyrl.infer.sampling_params import StructuredOutputs


def test_response_format_specs(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert StructuredOutputs.from_spec("") is None
    assert StructuredOutputs.from_spec("json_object") == StructuredOutputs("json_object")
    assert StructuredOutputs.from_spec(f"json_schema:{schema}").kind == "json"
    assert StructuredOutputs.from_spec('json_schema:{"type": "string"}').spec == '{"type":"string"}'
    assert StructuredOutputs.from_spec("choice:yes|no") == StructuredOutputs.choice(["yes", "no"])
    assert StructuredOutputs.from_spec("regex:[0-9]+") == StructuredOutputs("regex", "[0-9]+")
    with pytest.raises(UserError, match="not one of"):
        StructuredOutputs.from_spec("yaml:x")
    with pytest.raises(UserError, match="cannot read"):
        StructuredOutputs.from_spec(f"json_schema:{tmp_path / 'none.json'}")


def test_grpo_rollouts_follow_the_format(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--out", str(out)]
    args += ["--data", "builtin:arithmetic?max=9&n=16", "--micro-batch-tokens", "64", "--reward-workers", "0"]
    args += ["--n", "4", "--prompts-per-step", "2", "--max-new-tokens", "8", "--max-steps", "2", "--log-every", "1"]
    args += ["--set", "grpo.rollout_response_format=regex:[0-9]{1,2}", "--set", "grpo.rollouts_to_save=8"]
    assert main(args) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "rollout_mask_logmass" in r]
    assert len(steps) == 2 and all(r["rollout_mask_logmass"] < 0 for r in steps)
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert rows and all(r["completion"].isdigit() and len(r["completion"]) <= 2 for r in rows), rows[:2]
    bad = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--out", str(tmp_path / "bad")]
    bad += ["--data", "builtin:arithmetic?n=8", "--set", "grpo.rollout_response_format=yaml:x"]
    assert main(bad) == 2
    assert "grpo.rollout_response_format" in capsys.readouterr().err
