"""The ``eval`` validation level: a model-level accuracy gate on a bundled log-likelihood task.

The bundled four-way multiple-choice task (``polyrl/eval/tasks/polyrl_arith_mc``: 40 documents, 160 requests,
built as lm-eval builds them: context ``"Question: ...\\nAnswer:"``, continuation ``" <choice>"``, split by encoding
``context + continuation`` and cutting at the context's length) is scored twice on the same weights:

- fast path: the rollout engine's batched scorer (``infer.scoring``: paged KV, a document's context computed once
  for its four choices, only the continuation rows through the LM head, every kernel the registry picks here), as
  the ``polyrl`` lm-eval model and ``polyrl eval`` score;
- reference path: ``POLYRL_KERNELS=reference`` (every op's plain-PyTorch reference) and a plain full forward of each
  request, ``log_softmax`` over the whole vocabulary in fp32.

Checks: the chosen answer (argmax of the four log-likelihoods) agrees on every document whose reference margin
(best minus second best) exceeds the log-likelihood tolerance (near-ties of a random model are reported, not
gated); the max abs per-request log-likelihood difference is within the tolerance of the compute dtype (fp32 1e-3,
bf16/fp16 a per-token 0.05: the engine and the reference round differently); and the accuracies are equal. Needs no
lm-eval (the task's jsonl is read directly). Not here: lm-eval's own agreement (``tests/eval``), op-level numerics
(the ``ops`` level).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from polyrl.validate import model_source
from polyrl.validate.result import check, level_result

TASK = "polyrl_arith_mc"
FP32_TOL = 1e-3  # per request (a sum over the continuation's tokens)
HALF_TOL_PER_TOKEN = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("eval level")
    group.add_argument(
        "--eval-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="compute dtype of the eval gate (default: bf16 on an accelerator that has it, else fp32)",
    )


def requests(tokenizer: Any) -> list[tuple[int, int, list[int], list[int]]]:
    """(document, label, context ids, continuation ids) of every choice of the bundled task, lm-eval's split."""
    # lazy: polyrl.eval sits above validate's imports only when the level runs
    from polyrl.eval.bundled import TASK_DIR

    out = []
    for d, line in enumerate((TASK_DIR / f"{TASK}.jsonl").read_text().splitlines()):
        doc = json.loads(line)
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            whole = list(tokenizer.encode(context + " " + str(choice)))
            ctx = list(tokenizer.encode(context))
            out.append((d, int(doc["label"]), whole[: len(ctx)], whole[len(ctx) :]))
    return out


def fast_scores(model: Any, tokenizer: Any, reqs: list[tuple[int, int, list[int], list[int]]]) -> list[float]:
    """Sum of continuation log-probs per request through the rollout engine's batched scorer
    (``infer.scoring.score_continuations``: what the ``polyrl`` lm-eval model and ``polyrl eval`` run), a document's
    context computed once for its choices."""
    # lazy: the engine loads only when the level runs
    from polyrl.infer import LLM, RolloutConfig
    from polyrl.infer.scoring import score_continuations

    llm = LLM(model, tokenizer, RolloutConfig(num_blocks=256, max_num_seqs=64))
    index: dict[tuple[int, ...], int] = {}
    contexts: list[list[int]] = []
    owner: list[int] = []
    for _, _, ctx, _ in reqs:
        owner.append(index.setdefault(tuple(ctx), len(index)))
        if owner[-1] == len(contexts):
            contexts.append(ctx)
    res = score_continuations(llm, contexts, [cont for _, _, _, cont in reqs], owner)
    llm.release()
    return [float(x) for x in res.logprobs]


def reference_scores(model: Any, reqs: list[tuple[int, int, list[int], list[int]]]) -> list[float]:
    """The same sums from a plain full forward per request with every kernel forced to its PyTorch reference."""
    # lazy: torch and the kernel registry load only when the level runs
    import torch

    from polyrl.kernels import registry
    from polyrl.models.attention_metadata import AttnMetadata
    from polyrl.platform import envvars

    name = envvars.POLYRL_KERNELS.name
    before = os.environ.get(name)
    os.environ[name] = "reference"
    registry.reset_cache()
    dev = next(model.parameters()).device
    out = []
    try:
        with torch.no_grad():
            for _, _, ctx, cont in reqs:
                ids = torch.tensor(ctx + cont, device=dev)
                pos = torch.arange(len(ids), device=dev)
                hidden = model(ids, pos, AttnMetadata.from_seqlens([len(ids)]).to(dev))
                logp = torch.log_softmax(model.compute_logits(hidden).float(), -1)
                start = max(1, len(ctx))
                rows = logp[start - 1 : len(ids) - 1]
                out.append(float(rows.gather(-1, ids[start:, None]).sum()))
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        registry.reset_cache()
    return out


def choices(reqs: list[tuple[int, int, list[int], list[int]]], scores: list[float]) -> dict[int, list[float]]:
    per_doc: dict[int, list[float]] = {}
    for (d, _, _, _), s in zip(reqs, scores):
        per_doc.setdefault(d, []).append(s)
    return per_doc


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch

    from polyrl.platform import device

    name = getattr(args, "eval_dtype", None)
    if name is None:
        name = "bfloat16" if device.device_type() != "cpu" and device.supports_bf16() else "float32"
    dtype = getattr(torch, name)
    model, tokenizer, _ = model_source.load(args, dtype=dtype)
    model.eval()
    reqs = requests(tokenizer)
    fast = fast_scores(model, tokenizer, reqs)
    ref = reference_scores(model, reqs)
    longest = max(len(c) for _, _, _, c in reqs)
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL_PER_TOKEN * longest
    diffs = [abs(a - b) for a, b in zip(fast, ref)]
    f_docs, r_docs = choices(reqs, fast), choices(reqs, ref)
    labels = {d: lab for d, lab, _, _ in reqs}
    gated, agree, ties = 0, 0, 0
    for d, rs in r_docs.items():
        top = sorted(rs, reverse=True)
        same = max(range(len(rs)), key=rs.__getitem__) == max(range(len(rs)), key=f_docs[d].__getitem__)
        if top[0] - top[1] > tol:
            gated += 1
            agree += int(same)
        else:
            ties += 1
    acc_f = sum(max(range(4), key=f_docs[d].__getitem__) == labels[d] for d in f_docs) / len(f_docs)
    acc_r = sum(max(range(4), key=r_docs[d].__getitem__) == labels[d] for d in r_docs) / len(r_docs)
    max_diff = max(diffs)
    checks = [
        check("same choice as the reference (margin > tolerance)", agree == gated, f"{agree}/{gated}", "all",
              f"{ties} near-tie document(s) not gated"),
        check("per-request log-likelihood max abs diff", max_diff <= tol, max_diff, f"<= {tol:g} ({name})",
              f"mean {sum(diffs) / len(diffs):.2e} over {len(reqs)} requests"),
        check("accuracy fast path == reference", acc_f == acc_r if ties == 0 else None, acc_f, f"{acc_r} (reference)"),
    ]  # fmt: skip
    metrics = {
        "model": model_source.describe(args),
        "task": f"{TASK} (bundled, {len(r_docs)} documents, {len(reqs)} requests)",
        "compute_dtype": name,
        "accuracy_fast": acc_f,
        "accuracy_reference": acc_r,
        "loglikelihood_max_abs_diff": max_diff,
        "near_ties": ties,
    }
    notes = [
        "Fast path: the rollout engine's prompt log-probs (paged KV, prefix cache, the kernels the registry picks "
        "here); reference: POLYRL_KERNELS=reference and a plain full forward with an fp32 log_softmax."
    ]
    return level_result("eval", checks, metrics, notes)
