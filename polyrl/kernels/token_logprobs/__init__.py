"""token_logprobs: fused lm-head + log-prob of given tokens (+ entropy), with temperature."""

from polyrl.kernels.registry import register

register("token_logprobs", "reference", "polyrl.kernels.token_logprobs.reference:token_logprobs")
register(
    "token_logprobs",
    "triton",
    "polyrl.kernels.token_logprobs.triton:token_logprobs",
    devices=("cuda",),
    dtypes=("bfloat16", "float16", "float32"),
    priority=10,
)
