"""skinny_linear: ``y = x @ W^T + b`` for a few rows of ``x`` (decode steps of small batches), without autograd.

Contract (``reference.py`` is the spec)::

    skinny_linear(x [M, K], weight [N, K], bias [N] | None) -> y [M, N]   (x's dtype; M <= MAX_ROWS)
    skinny_linear(x [M, K], (w_0 [N_0, K], ... up to 3), (b_0, ...) | None) -> y [M, N_0 + N_1 + ...]

The product is accumulated in fp32 and rounded once to ``x``'s dtype, as a GEMM does; only the summation order
differs from cuBLAS. Why an op of its own: at batch 1-8 the decode step's projections are weight reads (a 4-12 MB
matrix for a few hundred FLOPs per byte), and cuBLAS's small-M kernels read them at a fraction of the bandwidth
(H200, qwen3-0.6b shape: ~9 us for a 12 MB matrix, 7 projections per layer). The Triton kernel gives each program a
few output columns for every row, so hundreds of programs stream the matrix at once.

``polyrl.models.decoder`` routes a plain ``nn.Linear`` here when its input has at most ``ROUTE_MAX_ROWS`` rows and
autograd is off (the rollout engine's batch-1 decode graphs); training never comes here.
"""

from polyrl.kernels.registry import register
from polyrl.kernels.skinny_linear.reference import MAX_ROWS

__all__ = ["MAX_ROWS", "ROUTE_MAX_ROWS"]
# What the decoder routes to it: measured on the H200 (bench kernels --ops skinny_linear, graph replays, qwen3-0.6b
# projections, 2026-12-01) it beats cuBLAS at 1 row (e.g. o_proj 7.4 vs 15.3 us, k/v 5.5 vs 10.1 us; batch-1 decode
# 2.38 -> 1.77 ms/token in one bench rollout run) but not at 8 rows (26-49 vs 7-10 us), where cuBLAS's tensor-core
# tiles already read the weight at speed. Rows 2..4 are unmeasured: they stay with cuBLAS.
ROUTE_MAX_ROWS = 1

register("skinny_linear", "reference", "polyrl.kernels.skinny_linear.reference:skinny_linear", priority=0)
register(
    "skinny_linear",
    "triton",
    "polyrl.kernels.skinny_linear.triton:skinny_linear",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
