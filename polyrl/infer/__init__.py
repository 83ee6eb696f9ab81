"""polyrl.infer: the rollout and serving engine (paged KV cache, continuous batching, CUDA graphs).

Batch API (RL rollouts, ``polyrl generate``)::

    llm = LLM(model, tokenizer, RolloutConfig(...))        # or LLM.from_pretrained(dir, config, dtype=...)
    outs = llm.generate(prompts, SamplingParams(...))     # prompts: list[str] or list[list[int]]
    outs = llm.chat([[{"role": "user", "content": "hi"}]], params)   # through the chat template
    out = outs[i]                                         # RequestOutput, in prompt order
    out.prompt_token_ids, out.num_prompt_tokens
    c = out.outputs[j]                                    # CompletionOutput, j < params.n
    c.token_ids, c.text, c.logprobs, c.cumulative_logprob, c.finish_reason ("stop" | "length" | "abort"),
    c.stop_reason (stop token id / stop string / None), c.top_logprobs (list[dict[id, logprob]] if asked)
    c.routed_experts (MoE with RolloutConfig(record_routing=True): int [prompt + output tokens, MoE layers, k], the
    experts each MoE layer chose per token, prefix-cache hits included; the last token's row -1: never fed)

Log-probs: ``c.logprobs[i] = log_softmax(logits / T)[token_ids[i]]`` with T the request's temperature
(1 for greedy), computed from the fp32 logits of the model the engine holds, WITHOUT top-k/top-p/min-p
truncation and without the min_tokens EOS mask: the "old log-probs" RL ratios need. Token ids include
the EOS / stop token that ended a sample (its log-prob too); the text excludes it and any stop string.

Prompt log-probs (scoring, lm-eval, distillation teachers): ``SamplingParams(prompt_logprobs=k)`` fills
``out.prompt_logprobs`` (``PromptLogprobs``: per prompt token its log-prob under the raw distribution, the first
``None``, and the top-``k`` alternatives), computed in the prefill (``prompt_logprobs.py``: chunked, prefix-cache
aware, equal to the training forward's ``kernels.token_logprobs``). ``prompt_logprobs_from=i`` scores positions
``i..`` only, so a shared context may come from the prefix cache.

Colocated training (RL): the engine keeps a reference to the training ``DecoderLM`` (never a copy), so
in-place optimizer updates are seen by the next rollout. After the weights change call
``llm.reset_prefix_cache()`` (cached KV of old weights would be reused otherwise). ``llm.release()``
frees the KV cache memory for the training phase, ``llm.reallocate()`` takes it back (same block count);
CUDA graphs are re-captured lazily after a release. If parameter *tensors* are replaced (not updated in
place), call ``llm.runner.invalidate_graphs()``. With ``RolloutConfig(weight_precision="fp8")`` the engine samples
with FP8 copies of the projection weights (``fp8_weights.py``, docs/fp8-rollout.md), which
``llm.reset_prefix_cache()`` marks for requantisation before the next forward; the training forward never sees them.
``RolloutConfig(fuse_projections=True)`` likewise gives it concatenated q/k/v and gate/up copies (one GEMM per group,
``fused_projections.py``), rewritten after ``llm.reset_prefix_cache()``, freed by ``llm.release()``.

Streaming API (the OpenAI server)::

    rid = llm.add_request(prompt_or_ids, params, request_id=None, stream=True)   # thread-safe
    llm.abort_request(rid)                                                        # thread-safe
    while llm.has_unfinished_requests():
        for out in llm.step():        # streaming requests that changed, and requests that finished
            for c in out.outputs:     # c.new_token_ids / c.new_text: what arrived since the last output
                ...                   # (text held back while it could still be the start of a stop string)
            if out.finished: ...

``add_request`` validates in the caller's thread (raises ``UserError`` for an empty prompt, ids outside
the vocabulary, or a prompt that does not fit ``llm.max_model_len``) and hands over through a queue;
``step()``/``generate()``/``chat()`` must run on ONE thread (the server's engine thread). ``generate``
drives ``step`` itself, so do not mix it with a server loop on the same engine. ``llm.stats()`` gives
running/waiting counts, KV-cache usage, prefix-cache hit rate, preemptions and token counts for
metrics.

Deliberately not here: HTTP (``polyrl.server``), training, weight loading (``polyrl.models``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LLM",
    "RolloutConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "StructuredOutputs",
    "PromptLogprobs",
]

_EXPORTS = {
    "LLM": "polyrl.infer.llm",
    "RolloutConfig": "polyrl.infer.config",
    "SamplingParams": "polyrl.infer.sampling_params",
    "RequestOutput": "polyrl.infer.sequence",
    "CompletionOutput": "polyrl.infer.sequence",
    "StructuredOutputs": "polyrl.infer.sampling_params",
    "PromptLogprobs": "polyrl.infer.sequence",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'polyrl.infer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
