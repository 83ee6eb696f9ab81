"""swiglu: silu(gate) * up."""

from polyrl.kernels.registry import register

register("swiglu", "reference", "polyrl.kernels.swiglu.reference:swiglu", priority=0)
register(
    "swiglu",
    "triton",
    "polyrl.kernels.swiglu.triton:swiglu",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
