"""The ``eval`` validation level on the CPU: the bundled multiple-choice task scored through the rollout engine and
through the forced PyTorch references agrees (choices, per-request log-likelihoods within 1e-3 in fp32), through
the level's ``run_level``; and the gate fails when the two paths disagree."""

from __future__ import annotations

import argparse

import torch


def test_validate_eval_level_passes_on_cpu(tiny_model_dir):
    from polyrl.validate import LEVELS, eval_level, markdown

    torch.set_num_threads(1)
    assert LEVELS["eval"][0] == "polyrl.validate.eval_level"  # `polyrl validate eval`, in the full run's levels
    args = argparse.Namespace(model=str(tiny_model_dir), preset="tiny", seed=0, eval_dtype=None)
    lvl = eval_level.run_level(args)
    assert lvl["status"] == "passed", lvl
    m = lvl["metrics"]
    assert m["compute_dtype"] == "float32" and m["loglikelihood_max_abs_diff"] <= 1e-3
    assert m["accuracy_fast"] == m["accuracy_reference"]
    assert "40 documents, 160 requests" in m["task"]
    names = {c["name"]: c for c in lvl["checks"]}
    assert names["same choice as the reference (margin > tolerance)"]["status"] == "pass"
    assert markdown.E2E_TITLES["eval"].startswith("Model-level eval gate")


def test_gate_fails_when_the_paths_disagree(tiny_model_dir):
    from polyrl.models.checkpoint import load_model, load_tokenizer
    from polyrl.validate import eval_level

    torch.set_num_threads(1)
    model, tok = load_model(tiny_model_dir, dtype=torch.float32), load_tokenizer(tiny_model_dir)
    reqs = eval_level.requests(tok)
    assert len(reqs) == 160 and all(len(c) >= 1 for *_, c in reqs)
    fast = eval_level.fast_scores(model, tok, reqs)
    ref = eval_level.reference_scores(model, reqs)
    assert max(abs(a - b) for a, b in zip(fast, ref)) <= 1e-3
    # a reference over different weights (a broken kernel would look like this): log-likelihoods far apart
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    other = eval_level.reference_scores(model, reqs)
    assert max(abs(a - b) for a, b in zip(fast, other)) > 0.1
