"""rope: rotate-half rotary position embedding on q and k at explicit positions."""

from polyrl.kernels.registry import register

register("rope", "reference", "polyrl.kernels.rope.reference:apply_rope", priority=0)
register(
    "rope",
    "triton",
    "polyrl.kernels.rope.triton:apply_rope",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
