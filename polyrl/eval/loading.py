"""Loading what ``polyrl eval`` evaluates: an HF checkpoint folder, or a PEFT adapter folder on its base, into a
rollout engine (``polyrl.infer.LLM``).

A PEFT adapter folder (``adapter_config.json``) loads its base (``base_model_name_or_path``, or ``base`` to repoint
it) and the adapter, which is then merged into the base weights (an eval never trains, and merged weights run at
the base model's speed). The tokenizer comes from the adapter folder when it has one, else from the base. Not
here: what is run on the engine (``harness.py``, ``rewards.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polyrl.errors import UserError
from polyrl.infer.config import RolloutConfig
from polyrl.infer.llm import LLM
from polyrl.models.checkpoint import load_model, load_tokenizer
from polyrl.models.lora import base_model_path, is_adapter_dir, load_adapter, merge_lora
from polyrl.platform import device as platform_device


def resolve_dtype(dtype: str | torch.dtype | None, dev: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if dev.type != "cpu" and platform_device.supports_bf16() else torch.float32
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
    return getattr(torch, dtype)


def load_eval_model(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | None = None, base: str | None = None
) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode, tokenizer) of an HF folder or a PEFT adapter folder (merged into its base)."""
    if not Path(path).is_dir():
        raise UserError(f"--model {path!r} is not a folder; give an HF checkpoint folder or a PEFT adapter folder")
    dev = torch.device(device) if device is not None else platform_device.torch_device()
    dt = resolve_dtype(dtype, dev)
    base_dir = base_model_path(path, base)
    model = load_model(base_dir, dtype=dt, device=dev)
    tok_dir = base_dir
    if is_adapter_dir(path):
        load_adapter(model, path)
        merge_lora(model)
        if (Path(path) / "tokenizer_config.json").is_file():
            tok_dir = str(path)
    model.eval()
    return model, load_tokenizer(tok_dir)


# Tokens per forward of an evaluation engine on an accelerator. An eval forward is host-bound below this size: on the
# H200 an eager 0.6b forward costs ~35 ms of launches whatever its token count, while 8192 tokens take ~15 ms of device
# time (bench eval: 35 scoring batches of 8192 tokens took 1.15 s of launches; a 256-prompt generation task prefilled
# in 4 synchronous steps of ~57 ms). 32768 tokens is 4x fewer launches; the cache sizing reserves ~0.9 GiB more for
# activations at the 0.6b shape (~3.4 GiB at 8b: ``kv_cache.activation_reserve``).
ACCEL_EVAL_BATCH_TOKENS = 32768
CPU_EVAL_BATCH_TOKENS = 8192  # the CPU is compute-bound at any size; the rollout engine's default


def eval_batch_tokens(dev: torch.device) -> int:
    """Default tokens per forward of an evaluation engine on ``dev``."""
    return CPU_EVAL_BATCH_TOKENS if dev.type == "cpu" else ACCEL_EVAL_BATCH_TOKENS


def eval_engine(
    model: torch.nn.Module,
    tokenizer: Any,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    num_blocks: int | None = None,
    fuse_projections: bool = False,
) -> LLM:
    """A rollout engine for evaluation: prefix caching on (a document's choices share their context).
    ``max_num_batched_tokens`` (tokens per forward; None: ``eval_batch_tokens``) sets the scoring batches and the
    prefill steps of generation tasks. ``fuse_projections``: q/k/v and gate/up as one GEMM each
    (``RolloutConfig.fuse_projections``; ``polyrl bench eval --fuse-projections``)."""
    if max_num_batched_tokens is None:
        max_num_batched_tokens = eval_batch_tokens(next(model.parameters()).device)
    cfg = RolloutConfig(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        fuse_projections=fuse_projections,
    )
    return LLM(model, tokenizer, cfg)
