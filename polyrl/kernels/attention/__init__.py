"""attention: causal attention over packed variable-length sequences (cu_seqlens), GQA, sliding window.

Implementations: ``reference`` (explicit softmax, the spec), ``sdpa`` (per-sequence
``scaled_dot_product_attention`` on any device, the portable path), ``triton`` (flash attention,
forward + backward, CUDA-compatible devices) and ``cudnn`` (CUDA, bf16/fp16: batches of equal-length
sequences go to one SDPA call on the cuDNN or flash backend; anything else is handed to ``triton``).
"""

from polyrl.kernels.registry import register

register("attention", "reference", "polyrl.kernels.attention.reference:varlen_attention", priority=0)
register(
    "attention",
    "sdpa",
    "polyrl.kernels.attention.sdpa:varlen_attention",
    priority=5,
    description="per-sequence torch SDPA (any device; one host sync per call)",
)
register(
    "attention",
    "triton",
    "polyrl.kernels.attention.triton:varlen_attention",
    devices=("cuda",),
    dtypes=("bfloat16", "float16", "float32"),
    priority=10,
)
register(
    "attention",
    "cudnn",
    "polyrl.kernels.attention.cudnn:varlen_attention",
    devices=("cuda",),
    dtypes=("bfloat16", "float16"),
    priority=20,
    description="equal-length batches: one SDPA call (cuDNN, else flash backend); otherwise triton",
)
