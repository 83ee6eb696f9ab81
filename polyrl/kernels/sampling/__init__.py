"""sample_tokens: one fused pass per row that draws the next token (Gumbel-max with a counter-based hash
RNG keyed by (seed, offset, vocab index), or greedy argmax) and returns its temperature-scaled log-prob.

Contract (``reference.py`` is the spec)::

    sample_tokens(logits [B, V] fp32 (or bf16/fp16, read as fp32), temperature [B] fp32, seeds [B] int64,
                  offsets [B] int64, greedy [B] bool) -> (tokens int64 [B], logprobs fp32 [B])

- ``z = logits * (1 / T)`` (the reciprocal rounded to fp32 once; T is taken as 1 on greedy rows, and must be
  > 0 on sampled rows).
- Sampled row: ``token = argmax_v(z_v + G_v)``, ``G_v = -log(E_v)``, ``E_v = -log(1 - w_v)`` with ``w_v`` in
  (0, 1) from ``hash_uniform(seed_b, offset_b, v)``: an exact categorical draw from ``softmax(z)``. The same
  (seed, offset) gives the same noise on every device and in every implementation (the hash and ``w`` are
  bit-identical; the logs may differ by an ulp between devices, which matters only at exact ties).
- Greedy row: ``token = argmax_v(logits_v)``.
- ``logprob = z[token] - logsumexp(z)``. Ties go to the lowest index.

This op does not truncate (top-k/top-p/min-p) and does not mask tokens: the caller hands it already-masked
logits when it wants either, and computes any other reported distribution itself.
"""

from polyrl.kernels.registry import register

register("sample_tokens", "reference", "polyrl.kernels.sampling.reference:sample_tokens")
register(
    "sample_tokens",
    "triton",
    "polyrl.kernels.sampling.triton:sample_tokens",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
