"""linear_cross_entropy: hidden @ W^T -> cross-entropy with ignore index, never all logits at once."""

from polyrl.kernels.registry import register

register("linear_cross_entropy", "reference", "polyrl.kernels.linear_cross_entropy.reference:linear_cross_entropy")
register(
    "linear_cross_entropy",
    "triton",
    "polyrl.kernels.linear_cross_entropy.triton:linear_cross_entropy",
    devices=("cuda",),
    dtypes=("bfloat16", "float16", "float32"),
    priority=10,
)
