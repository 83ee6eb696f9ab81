"""rmsnorm: y = weight * normalize(x), with an optional fused residual add."""

from polyrl.kernels.registry import register

register("rmsnorm", "reference", "polyrl.kernels.rmsnorm.reference:rmsnorm", priority=0)
register(
    "rmsnorm",
    "triton",
    "polyrl.kernels.rmsnorm.triton:rmsnorm",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
