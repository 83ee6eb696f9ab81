"""nf4_matmul: ``x @ dequant(W_nf4)^T`` for the 4-bit frozen base of QLoRA (``reference.py`` has the format)."""

from polyrl.kernels.registry import register

register("nf4_matmul", "reference", "polyrl.kernels.nf4.reference:nf4_matmul", priority=0)
register(
    "nf4_matmul",
    "triton",
    "polyrl.kernels.nf4.triton:nf4_matmul",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
register("nf4_dequantize", "reference", "polyrl.kernels.nf4.reference:dequantize_nf4", priority=0)
register("nf4_dequantize", "triton", "polyrl.kernels.nf4.triton:dequantize", devices=("cuda",), priority=10)
