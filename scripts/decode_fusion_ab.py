"""A/B of the decode step's non-attention work with and without ``kernels.rmsnorm_linear`` (the RMSNorm + residual
add fused into the projection after it, and SwiGLU into the gate/up projection), at qwen3-0.6b's decode shapes.

    PYTHONPATH=$PWD python3 scripts/decode_fusion_ab.py [--rows 256 64] [--layers 28] [--no-configs]
    PYTHONPATH=$PWD python3 scripts/decode_fusion_ab.py --cpu-check   # the variants' numerics at a tiny shape, on
                                                                     # the CPU under the Triton interpreter

Per layer (H = 1024, fused q/k/v N = 4096, o K = 2048, fused gate/up 2I = 6144, down K = 3072; bf16; attention
left out: o reads the q columns of the q/k/v output, a strided view, as a stand-in for its input):

(a) today:   rmsnorm(x, residual) -> qkv F.linear ; o F.linear -> rmsnorm(o, residual) -> gate_up F.linear ->
             swiglu -> down F.linear                                                        (7 kernels)
(b) fused:   rmsnorm_linear(x, residual, qkv) ; o F.linear -> rmsnorm_linear(o, residual, gate_up, "swiglu") ->
             down F.linear                                                                  (4 kernels)
(c) addmm:   (b) where o and down add their output to the residual stream (torch.addmm, beta = 1), so the fused
             norms read one tensor and add nothing (the first layer still adds its input's residual); the add
             is rounded once with the product (fp32), not after it, so (c) is not bit-close to (a)

Each variant runs ``--layers`` layers (separate weights per layer, as a model has) captured in ONE CUDA graph and is
timed as graph replays (CUDA events over many replays, L2 not flushed: the weights, 30 MB a layer, do not fit it
anyway). Prints per-layer microseconds, the step saving for the layer count, the two fused pairs timed alone
against their unfused kernels, (b) and (c) with explicit tile configs, and the max abs differences of the final
hidden / residual against (a). Needs a CUDA device (or ``--cpu-check``); measures, asserts nothing. Time on an H200:
mostly the Triton compiles (4 kernel variants per tile config; ``--no-configs`` skips the configs, a second run hits
Triton's cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

if "--cpu-check" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from polyrl import kernels

EPS = 1e-6

# (block_m, block_n, block_k, num_warps, num_stages, one_pass) tried for (b) and (c) besides the default heuristic.
# one_pass: the kernel's experiment that reads x / residual once and scales the accumulator by rstd (not bit-close to
# the unfused ops). Each program re-reads its rows' activations for every column tile: wide BLOCK_N reads them
# fewer times, at the price of fewer programs (M = 256, N = 4096: 64 x 64 tiles give 256 programs, 128 x 64 give 128).
CONFIGS = [
    (64, 64, 64, 4, 3, False),
    (64, 64, 64, 4, 3, True),
    (64, 128, 64, 8, 3, True),
    (128, 64, 64, 8, 3, False),
    (128, 64, 64, 8, 3, True),
    (256, 32, 64, 8, 3, True),
    (64, 32, 128, 4, 3, True),
]


@dataclass
class Shape:
    hidden: int = 1024
    q: int = 2048  # q columns of the fused q/k/v output (16 heads x 128): o's input width
    qkv: int = 4096  # q + k + v (8 kv heads x 128 each)
    inter: int = 3072


@dataclass
class Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def make_layers(n: int, shape: Shape, dev, dtype, seed: int = 0) -> list[Layer]:
    gen = torch.Generator(device=dev).manual_seed(seed)

    def mat(rows, cols):
        return (torch.randn(rows, cols, generator=gen, device=dev) / cols**0.5).to(dtype)

    def norm():
        return (torch.rand(shape.hidden, generator=gen, device=dev) * 0.5 + 0.75).to(dtype)

    return [
        Layer(norm(), mat(shape.qkv, shape.hidden), mat(shape.hidden, shape.q), norm(),
              mat(2 * shape.inter, shape.hidden), mat(shape.hidden, shape.inter))
        for _ in range(n)
    ]  # fmt: skip


def step_unfused(x, res, layers, shape):
    for lay in layers:
        h, res = kernels.rmsnorm(x, lay.in_norm, EPS, residual=res)
        qkv = F.linear(h, lay.qkv)
        o = F.linear(qkv[:, : shape.q], lay.o)
        h, res = kernels.rmsnorm(o, lay.post_norm, EPS, residual=res)
        gu = F.linear(h, lay.gate_up)
        x = F.linear(kernels.swiglu(gu[:, : shape.inter], gu[:, shape.inter :]), lay.down)
    return x, res


def step_fused(x, res, layers, shape, fn):
    for lay in layers:
        qkv, res = fn(x, res, lay.in_norm, lay.qkv, EPS)
        o = F.linear(qkv[:, : shape.q], lay.o)
        act, res = fn(o, res, lay.post_norm, lay.gate_up, EPS, "swiglu")
        x = F.linear(act, lay.down)
    return x, res


def step_addmm(x, res, layers, shape, fn):
    stream = None
    for i, lay in enumerate(layers):
        if i == 0:
            qkv, stream = fn(x, res, lay.in_norm, lay.qkv, EPS)
        else:
            qkv, _ = fn(stream, None, lay.in_norm, lay.qkv, EPS)
        stream = torch.addmm(stream, qkv[:, : shape.q], lay.o.t())
        act, _ = fn(stream, None, lay.post_norm, lay.gate_up, EPS, "swiglu")
        stream = torch.addmm(stream, act, lay.down.t())
    return stream


def capture(fn, *args):
    """Warm up (compiles the Triton kernels) on a side stream, then capture ``fn(*args)`` in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def time_graph(graph, reps: int = 30, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean ms of ``reps`` back-to-back replays."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    times.sort()
    return times[len(times) // 2]


def _ops_unfused_qkv(x, res, layers, shape):
    for lay in layers:
        h, _ = kernels.rmsnorm(x, lay.in_norm, EPS, residual=res)
        F.linear(h, lay.qkv)


def _ops_fused_qkv(x, res, layers, shape):
    for lay in layers:
        kernels.rmsnorm_linear(x, res, lay.in_norm, lay.qkv, EPS)


def _ops_unfused_mlp_in(x, res, layers, shape):
    for lay in layers:
        h, _ = kernels.rmsnorm(x, lay.post_norm, EPS, residual=res)
        gu = F.linear(h, lay.gate_up)
        kernels.swiglu(gu[:, : shape.inter], gu[:, shape.inter :])


def _ops_fused_mlp_in(x, res, layers, shape):
    for lay in layers:
        kernels.rmsnorm_linear(x, res, lay.post_norm, lay.gate_up, EPS, "swiglu")


PER_OP = [
    ("rmsnorm(res) + qkv F.linear", _ops_unfused_qkv),
    ("rmsnorm_linear qkv", _ops_fused_qkv),
    ("rmsnorm(res) + gate_up + swiglu", _ops_unfused_mlp_in),
    ("rmsnorm_linear gate_up swiglu", _ops_fused_mlp_in),
]


def _maxdiff(a, b) -> str:
    d = (a.float() - b.float()).abs().max().item()
    return f"{d:.3e} (max |ref| {b.float().abs().max().item():.3e})"


def run_device(rows_list, n_layers, try_configs) -> None:
    from polyrl.kernels.rmsnorm_linear import triton as rl_triton

    dev, dtype, shape = torch.device("cuda"), torch.bfloat16, Shape()
    t0 = time.time()
    layers = make_layers(n_layers, shape, dev, dtype)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  {n_layers} layers, bf16, qwen3-0.6b shapes")
    for rows in rows_list:
        gen = torch.Generator(device=dev).manual_seed(rows)
        x = torch.randn(rows, shape.hidden, generator=gen, device=dev).to(dtype)
        res = torch.randn(rows, shape.hidden, generator=gen, device=dev).to(dtype)
        print(f"\n## M = {rows}  (default tiles qkv {rl_triton.launch_config(rows, shape.qkv, shape.hidden, False)},"
              f" gate_up {rl_triton.launch_config(rows, shape.inter, shape.hidden, True)})")  # fmt: skip
        results = {}
        with torch.no_grad():
            g_a, (xa, ra) = capture(step_unfused, x, res, layers, shape)
            results["a unfused (7 kernels/layer)"] = time_graph(g_a)
            g_b, (xb, rb) = capture(step_fused, x, res, layers, shape, kernels.rmsnorm_linear)
            results["b fused rmsnorm_linear (4)"] = time_graph(g_b)
            g_c, sc = capture(step_addmm, x, res, layers, shape, kernels.rmsnorm_linear)
            results["c fused + addmm residual (4)"] = time_graph(g_c)
            base = results["a unfused (7 kernels/layer)"]
            for name, ms in results.items():
                print(f"{name:<34} {ms * 1e3 / n_layers:8.2f} us/layer  {ms * 1e3:9.1f} us/step  "
                      f"saving {(base - ms) * 1e3:8.1f} us/step")  # fmt: skip
            print(f"max |x_b - x_a| {_maxdiff(xb, xa)};  max |res_b - res_a| {_maxdiff(rb, ra)}")
            print(f"max |stream_c - (x_a + res_a)| {_maxdiff(sc, xa + ra)}")
            del g_a, g_b, g_c
            print("per op, all layers' weights in one graph (independent calls on the same input):")
            for name, fn in PER_OP:
                g, _ = capture(fn, x, res, layers, shape)
                print(f"  {name:<32} {time_graph(g) * 1e3 / n_layers:8.2f} us/call")
                del g
            if try_configs:
                print("explicit tiles (block_m, block_n, block_k, warps, stages, one_pass): (b) and (c)")
                for cfg in CONFIGS:
                    bm, bn, bk, nw, ns, one = cfg
                    tuning = {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": nw, "num_stages": ns,
                              "one_pass": one}  # fmt: skip

                    def fn(*a, _t=tuning):
                        return rl_triton.rmsnorm_linear(*a, tuning=_t)

                    try:
                        g, (xt, _) = capture(step_fused, x, res, layers, shape, fn)
                        ms_b = time_graph(g)
                        del g
                        g, st = capture(step_addmm, x, res, layers, shape, fn)
                        ms_c = time_graph(g)
                        del g
                        per_b, per_c = ms_b * 1e3 / n_layers, ms_c * 1e3 / n_layers
                        print(f"  {cfg!s:<32} b {per_b:7.2f} us/layer (saving {(base - ms_b) * 1e3:7.1f} us/step)"
                              f"  c {per_c:7.2f} us/layer (saving {(base - ms_c) * 1e3:7.1f})"
                              f"  max |x_b - x_a| {_maxdiff(xt, xa)}")  # fmt: skip
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                        print(f"  {cfg!s:<32} failed: {type(exc).__name__}: {str(exc)[:120]}")
    print(f"\n# total {time.time() - t0:.1f} s")


def run_cpu_check() -> None:
    """The three variants at a tiny shape under the Triton interpreter (fp32): they must agree to fp32 rounding."""
    from polyrl.kernels.rmsnorm_linear import triton as rl_triton

    shape = Shape(hidden=64, q=32, qkv=64, inter=48)
    layers = make_layers(3, shape, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(20, shape.hidden, generator=gen), torch.randn(20, shape.hidden, generator=gen)
    with torch.no_grad():
        xa, ra = step_unfused(x, res, layers, shape)
        xb, rb = step_fused(x, res, layers, shape, rl_triton.rmsnorm_linear)
        sc = step_addmm(x, res, layers, shape, rl_triton.rmsnorm_linear)

        def one_pass(*a):
            return rl_triton.rmsnorm_linear(*a, tuning={"one_pass": True, "block_m": 16, "block_n": 16})

        xo, _ = step_fused(x, res, layers, shape, one_pass)
    print(f"cpu check: max |x_b - x_a| {_maxdiff(xb, xa)}; max |res_b - res_a| {_maxdiff(rb, ra)}")
    print(f"max |stream_c - (x_a + res_a)| {_maxdiff(sc, xa + ra)}; one_pass max |x - x_a| {_maxdiff(xo, xa)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--no-configs", action="store_true", help="skip the explicit tile configs of (b)")
    ap.add_argument("--cpu-check", action="store_true")
    args = ap.parse_args()
    if args.cpu_check:
        run_cpu_check()
        return
    if not torch.cuda.is_available():
        print("decode_fusion_ab: needs a CUDA device (or --cpu-check)")
        return
    run_device(args.rows, args.layers, not args.no_configs)


if __name__ == "__main__":
    main()
