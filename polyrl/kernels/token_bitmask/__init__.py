"""apply_token_bitmask: a grammar's packed token bitmask applied to rows of logits, with the two log-normalisers
structured outputs need, in one pass over each guided row.

Contract (``reference.py`` is the spec)::

    apply_token_bitmask(logits [B, V] (fp32, bf16 or fp16), bitmask [G, W] int32 (W >= ceil(V / 32)),
                        rows [G] int64 or None (None: G == B, row j is row j), inv_temps [B] fp32)
        -> (masked [B, V] logits' dtype, lse [G] fp32, lse_masked [G] fp32)

- Bit ``v`` of row ``j`` is bit ``v % 32`` (LSB first) of word ``bitmask[j, v // 32]`` (llguidance's layout);
  a 0 bit forbids token ``v``.
- ``masked``: a new tensor equal to ``logits``, except row ``rows[j]`` is -inf where row ``j``'s bit is 0.
- ``lse[j] = logsumexp(logits[r] * inv_temps[r])`` and ``lse_masked[j]`` the same over ``masked[r]``
  (``r = rows[j]``; products in fp32). So ``lse_masked - lse`` is the log of the probability mass the grammar
  allows, and ``logits[r, t] * inv_temps[r] - lse`` the unmasked log-prob of a token ``t`` drawn from ``masked``.

Not here: drawing (``sample_tokens`` draws from ``masked``), computing the mask (``polyrl.infer.structured``).
"""

from polyrl.kernels.registry import register

register("apply_token_bitmask", "reference", "polyrl.kernels.token_bitmask.reference:apply_token_bitmask")
register(
    "apply_token_bitmask",
    "triton",
    "polyrl.kernels.token_bitmask.triton:apply_token_bitmask",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
