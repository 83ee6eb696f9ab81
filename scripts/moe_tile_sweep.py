"""Device-side tile sweep of polyrl.kernels.moe.triton at Qwen3-30B-A3B's expert shapes (bf16, T=4096): each grouped
GEMM alone against cuBLAS on the same shape, several (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M) each.

Run on the device: ``PYTHONPATH=$PWD OUT=dir python3 scripts/moe_tile_sweep.py [seconds]``; writes ``tune.json``.
After the pointer kernel's rows, the TMA variant's rows (polyrl/kernels/moe/tma.py; ``tune.json["tma"]``), each with
its max abs difference from the pointer kernel's outputs; ``seconds`` budgets each of the two parts.
"""

import json
import os
import sys
import time

import torch
import triton

from polyrl.kernels.moe import triton as tk

out_dir = os.environ.get("OUT", ".")
dev = "cuda"
T, H, I, E, K = 4096, 2048, 768, 128, 8
torch.manual_seed(0)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
w, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), K, dim=-1)
gu = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * H**-0.5
dn = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * I**-0.5
route = tk._Routing(ids, E)
N = route.n
act = torch.empty(N, I, device=dev, dtype=torch.bfloat16)
h = torch.empty(N, 2 * I, device=dev, dtype=torch.bfloat16)
y = torch.empty(N, H, device=dev, dtype=torch.bfloat16)
dys = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
dh = torch.empty(N, 2 * I, device=dev, dtype=torch.bfloat16)
dxr = torch.empty(N, H, device=dev, dtype=torch.bfloat16)
ddn = torch.empty(E, H, I, device=dev, dtype=torch.bfloat16)
dgu = torch.empty(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
w_rows = w.reshape(-1)[route.order].to(torch.bfloat16)
wact = torch.empty(N, I, device=dev, dtype=torch.bfloat16)
gus = (gu.stride(0), gu.stride(2), gu.stride(1))
gemms = {
    "up": lambda: tk._rows_gemm(
        route, x, route.token, gu, gus, I, H, act, cfg="up", epi=1, h=h, store_h=True, b_up=I * gu.stride(1)
    ),
    "down": lambda: tk._rows_gemm(
        route, act, None, dn, (dn.stride(0), dn.stride(2), dn.stride(1)), H, I, y, cfg="down"
    ),
    # as the backward runs it: w-scaled SwiGLU backward, w * act stored for d down, d topk_weights partial sums
    "dact": lambda: tk._rows_gemm(
        route,
        dys,
        None,
        dn,
        (dn.stride(0), dn.stride(1), dn.stride(2)),
        I,
        H,
        dh,
        cfg="dact",
        epi=2,
        h=h,
        w_rows=w_rows,
        wact=wact,
        need_dw=True,
    ),  # fmt: skip
    "dx": lambda: tk._rows_gemm(
        route, dh, None, gu, (gu.stride(0), gu.stride(1), gu.stride(2)), H, 2 * I, dxr, cfg="dx"
    ),
    "wgrad_down": lambda: tk._wgrad_gemm(route, dys, wact, None, H, I, ddn),
    "wgrad_gu": lambda: tk._wgrad_gemm(route, dh, x, route.token, 2 * I, H, dgu),
}
flops = {
    "up": 2 * N * H * 2 * I,
    "down": 2 * N * I * H,
    "dact": 2 * N * H * I,
    "dx": 2 * N * 2 * I * H,
    "wgrad_down": 2 * N * H * I,
    "wgrad_gu": 2 * N * 2 * I * H,
}
# dense references (cuBLAS) of the same GEMM shapes
a1 = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
b1 = gu[0]
a2 = torch.randn(N, I, device=dev, dtype=torch.bfloat16)
b2 = dn[0]
dense = {
    "up": lambda: a1 @ b1.t(),
    "down": lambda: a2 @ b2.t(),
    "dact": lambda: a1 @ b2,
    "dx": lambda: dh @ b1,
    "wgrad_down": lambda: a1.t() @ a2,
    "wgrad_gu": lambda: dh.t() @ a1,
}
cands = {
    "up": [
        (128, 128, 64, 8, 3, 8),
        (128, 128, 64, 8, 3, 4),
        (128, 128, 64, 8, 4, 8),
        (128, 64, 64, 8, 4, 8),
        (256, 64, 64, 8, 3, 8),
        (128, 128, 64, 8, 3, 16),
    ],
    "down": [
        (128, 256, 64, 8, 3, 8),
        (128, 256, 64, 8, 3, 4),
        (128, 128, 64, 8, 4, 8),
        (64, 256, 64, 4, 3, 8),
        (128, 256, 64, 8, 4, 8),
        (256, 128, 64, 8, 3, 8),
    ],
    "dact": [
        (64, 128, 64, 4, 4, 8),
        (64, 128, 64, 4, 3, 8),
        (128, 128, 64, 8, 4, 8),
        (64, 256, 64, 8, 3, 8),
        (128, 64, 64, 4, 4, 8),
        (64, 128, 64, 4, 4, 4),
    ],
    "dx": [
        (128, 256, 64, 8, 3, 8),
        (128, 256, 64, 8, 4, 8),
        (128, 128, 64, 8, 4, 8),
        (64, 256, 64, 4, 3, 8),
        (256, 128, 64, 8, 3, 8),
        (128, 256, 64, 8, 3, 16),
    ],
    "wgrad": [
        (128, 128, 64, 4, 3, 1),
        (128, 128, 64, 4, 2, 1),
        (128, 128, 32, 4, 3, 1),
        (128, 256, 64, 8, 2, 1),
        (256, 128, 64, 8, 2, 1),
        (64, 128, 64, 4, 3, 1),
    ],
}
res = {}
t_start = time.time()
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 120
for g, fn in gemms.items():
    cfg_name = "wgrad" if g.startswith("wgrad") else g
    ms_d = triton.testing.do_bench(dense[g], warmup=5, rep=20)
    res[g] = {"dense_ms": ms_d, "dense_tflops": flops[g] / ms_d / 1e9, "configs": []}
    print(f"{g}: dense {ms_d:.3f} ms {flops[g] / ms_d / 1e9:.0f} TFLOP/s", flush=True)
    saved = tk.CONFIGS[cfg_name]
    for c in cands[cfg_name]:
        if time.time() - t_start > budget:
            print("  budget spent", flush=True)
            break
        tk.CONFIGS[cfg_name] = c
        try:
            ms = triton.testing.do_bench(fn, warmup=5, rep=20)
            res[g]["configs"].append((c, ms, flops[g] / ms / 1e9))
            print(f"  {c}: {ms:.3f} ms {flops[g] / ms / 1e9:.0f} TFLOP/s ({ms_d / ms:.0%} of dense)", flush=True)
        except Exception as exc:
            print(f"  {c}: {type(exc).__name__} {str(exc)[:200]}", flush=True)
    tk.CONFIGS[cfg_name] = saved
    if res[g]["configs"]:
        best = min(res[g]["configs"], key=lambda r: r[1])
        print(f"  best {best}", flush=True)

# --- the opt-in TMA variant (polyrl/kernels/moe/tma.py): "up", "down", "dact", "dx" through TMA descriptors ----------
# Each row: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M), its time, and the max abs difference of its outputs
# from the pointer kernel's (CONFIGS as shipped) on the same inputs; outputs are NaN-filled before each TMA run, so
# rows it failed to write show as nan. A row that did not take the TMA path says so. Own time budget, the
# same seconds again.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_tma_compile import TMA_CANDS  # noqa: E402 - the candidates that scripts/moe_tma_compile.py checks

outputs = {"up": (act, h), "down": (y,), "dact": (dh, wact), "dx": (dxr,)}


def _run(g):
    """Run GEMM g once; its outputs (and dact's d w partial sums)."""
    extra = gemms[g]()
    return [o.clone() for o in outputs[g]] + ([extra.sum(1)] if extra is not None else [])  # d w per row


json.dump(res, open(os.path.join(out_dir, "tune.json"), "w"), indent=1)  # again below, with the TMA rows
res["tma"] = {}
t_start = time.time()
saved_cfgs = dict(tk.TMA_CONFIGS)
for g, cands in TMA_CANDS.items():
    tk.TMA = False
    want = _run(g)  # the pointer kernel's outputs; also leaves valid inputs for the next GEMM
    ms_ptr = triton.testing.do_bench(gemms[g], warmup=5, rep=20)
    ms_d = res[g]["dense_ms"]
    res["tma"].setdefault(g, {"pointer_ms": [], "configs": []})["pointer_ms"].append(ms_ptr)
    print(f"{g} TMA: pointer kernel {ms_ptr:.3f} ms ({ms_d / ms_ptr:.0%} of dense)", flush=True)
    for c in cands:
        if time.time() - t_start > budget:
            print("  budget spent", flush=True)
            break
        tk.TMA, tk.TMA_CONFIGS[g] = True, c
        try:
            for o in outputs[g]:
                o.fill_(float("nan"))
            n0 = tk.tma_launches
            got = _run(g)
            if tk.tma_launches == n0:
                print(f"  {c}: did not take the TMA path", flush=True)
                continue
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            ms = triton.testing.do_bench(gemms[g], warmup=5, rep=20)
            res["tma"][g]["configs"].append((c, ms, flops[g] / ms / 1e9, diff))
            print(f"  {c}: {ms:.3f} ms {flops[g] / ms / 1e9:.0f} TFLOP/s ({ms_d / ms:.0%} of dense, "
                  f"{ms_ptr / ms:.2f}x pointer) max|diff| {diff:.3e}", flush=True)  # fmt: skip
        except Exception as exc:
            print(f"  {c}: {type(exc).__name__} {str(exc).strip()[:300]}", flush=True)
        finally:
            tk.TMA, tk.TMA_CONFIGS = False, dict(saved_cfgs)
    _run(g)  # the pointer kernel's outputs back in place for the GEMMs that read them
    if res["tma"][g]["configs"]:
        best = min(res["tma"][g]["configs"], key=lambda r: r[1])
        print(f"  best TMA {best}", flush=True)
json.dump(res, open(os.path.join(out_dir, "tune.json"), "w"), indent=1)
