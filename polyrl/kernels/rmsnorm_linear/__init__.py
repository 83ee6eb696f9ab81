"""rmsnorm_linear: a decode step's RMSNorm (with the residual add) fused into the projection that reads it, and for
the MLP also the SwiGLU after it. Inference only (no autograd).

Contract (``reference.py`` is the spec)::

    rmsnorm_linear(x [M, H], residual [M, H] | None, norm_weight [H], weight [N, H], eps, epilogue="none")
        -> (y [M, N], new_residual [M, H] | None)
    rmsnorm_linear(..., weight [2I, H], ..., epilogue="swiglu") -> (y [M, I], new_residual)

``s = x + residual`` (None: ``s = x`` and ``new_residual`` is None), ``h = rmsnorm(s) * norm_weight``,
``y = h @ weight^T``; with ``epilogue="swiglu"`` ``weight`` is the fused gate/up copy of
``polyrl.infer.fused_projections`` (gate rows ``[0, I)``, then up rows ``[I, 2I)``) and ``y = silu(gate) * up``.

It is exactly the unfused sequence ``kernels.rmsnorm(x, norm_weight, eps, residual)`` -> ``F.linear`` ->
``kernels.swiglu`` (the reference is that composition of the reference ops), and the Triton kernel keeps each of
its rounding points:

1. ``s = (x + residual)`` rounded to x's dtype (the rmsnorm op's residual path; ``new_residual`` is this ``s``);
2. ``rstd = rsqrt(mean(s_f32^2) + eps)`` in fp32;
3. the normalised value ``s_f32 * rstd`` rounded to x's dtype, then times ``norm_weight`` in fp32 and rounded
   again to the dtype (the rmsnorm op's output ``h``, as HF Llama/Qwen compute it) - before the dot;
4. the dot accumulated in fp32 and rounded once to the dtype (what a GEMM does; only the summation order differs
   from cuBLAS);
5. ``"swiglu"``: gate and up are each rounded to the dtype first (the GEMM's output), then ``silu(gate) * up`` in
   fp32 and rounded once, as the Triton ``swiglu`` op does (the reference ``F.silu(g) * u`` rounds ``silu(g)`` too:
   at most about one ulp apart).

So the fused result is bit-equal to the unfused one up to the GEMM's summation order (and the SwiGLU rounding of
point 5 against the reference). The Triton kernel takes one dtype for x, residual, norm_weight and weight
(the engine's bf16 model); each program computes a ``[BLOCK_M rows, BLOCK_N columns]`` tile: a first pass over K
for its rows' sums of squares, a second that normalises the A tiles as it loads them and feeds ``tl.dot``; the
programs of the first column tile write ``new_residual``. fp32 runs IEEE dots (no TF32).

Status: not used by the engine yet; ``scripts/decode_fusion_ab.py`` measures it against the unfused decode sequence
(28 layers of qwen3-0.6b's non-attention work in one CUDA graph each way) so that the wiring can be decided on
device numbers.
"""

from polyrl.kernels.registry import register
from polyrl.kernels.rmsnorm_linear.reference import EPILOGUES

__all__ = ["EPILOGUES"]

register("rmsnorm_linear", "reference", "polyrl.kernels.rmsnorm_linear.reference:rmsnorm_linear", priority=0)
register(
    "rmsnorm_linear",
    "triton",
    "polyrl.kernels.rmsnorm_linear.triton:rmsnorm_linear",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
