"""GPU checks (H200 / any CUDA-compatible device): bf16 parity with transformers at the Qwen3-0.6B shape.

Run: ``.venv/bin/python -m pytest tests/models/test_model_gpu.py -m gpu -q -s``.
"""

from __future__ import annotations

import argparse

import pytest

from polyrl.platform import device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not device.is_accelerator(), reason="needs an accelerator")]


def test_bf16_parity_at_qwen3_0_6b_shape():
    pytest.importorskip("transformers")
    from polyrl.bench.model_parity import parity
    from polyrl.models import preset_config

    args = argparse.Namespace(parity_batch=2, parity_seq=1024, seed=0)
    rows = {name: vals for name, *vals in parity(preset_config("qwen3-0.6b-shape"), args, device.torch_device())}
    hf_err, our_err = rows["transformers bf16 (sdpa)"], rows["polyrl bf16"]
    for name, vals in rows.items():
        print(f"{name}: logits max {vals[0]:.4g} rel {vals[1]:.4g}; logprobs max {vals[2]:.4g} rel {vals[3]:.4g}")
    # Our bf16 error against fp32 is of the size of transformers' own bf16 error.
    assert our_err[1] <= 1.5 * hf_err[1] + 1e-3  # logits relative L2
    assert our_err[3] <= 1.5 * hf_err[3] + 1e-3  # log-probs relative L2
    assert our_err[1] < 0.05
