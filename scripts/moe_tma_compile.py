"""Compile moe_experts' TMA rows-GEMM kernel (polyrl/kernels/moe/tma.py) for an H200 (sm_90) on any machine, no GPU:
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` at Qwen3-30B-A3B's tiles, and report what the
compiler made of each GEMM: TMA copies (``cp.async.bulk.tensor``), plain async copies (``cp.async.cg``), wgmma, warps,
shared memory, registers (ptxas -v).

    PYTHONPATH=$PWD python scripts/moe_tma_compile.py [--json] [--quick | --sweep]

(``--quick``: two kernels, for the test; ``--sweep``: scripts/moe_tile_sweep.py's TMA candidates.)

Runs on whichever Triton is importable (3.6 on the device, 3.9 in CI); tests/kernels/test_moe.py runs it (slow).
Prints one line per kernel, or with ``--json`` one JSON object {name: report} on the last line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from polyrl.kernels.moe import tma  # noqa: E402
from polyrl.kernels.moe import triton as tk  # noqa: E402

_INTS = {"N", "K", "stride_am", "b_up", "stride_cm", "stride_hm", "NUM_M", "NUM_N"}
_ALIGNED = _INTS - {"NUM_M", "NUM_N"}
_PTRS = {"tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "offsets_ptr": "*i64", "a_idx_ptr": "*i32",
         "dwp_ptr": "*fp32"}  # fmt: skip


def _signature(fn, consts: dict, a_block: list[int], b_block: list[int]) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "a_desc":
            sig[name] = f"tensordesc<bf16[{', '.join(map(str, a_block))}]>"
        elif name == "b_desc":
            sig[name] = f"tensordesc<bf16[{', '.join(map(str, b_block))}]>"
        elif name in _INTS:
            sig[name] = "i32"
        else:
            sig[name] = _PTRS.get(name, "*bf16")
    return sig


# (GEMM, its rows-GEMM constexprs): A gathered or not, B's layout, the epilogue, as moe_experts runs them
GEMMS = {
    "up": dict(GATHER_A=True, B_KN=False, EPI=1, STORE_H=True, NEED_DW=False),
    "down": dict(GATHER_A=False, B_KN=False, EPI=0, STORE_H=False, NEED_DW=False),
    "dact": dict(GATHER_A=False, B_KN=True, EPI=2, STORE_H=False, NEED_DW=True),
    "dx": dict(GATHER_A=False, B_KN=True, EPI=0, STORE_H=False, NEED_DW=False),
}


def _registers(ptx: str) -> tuple[int | None, int | None]:
    """(registers per thread, spill-store bytes) from ``ptxas -v`` for sm_90a."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:  # noqa: BLE001 - registers are a nicety
        return None, None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)  # fmt: skip
    regs = re.findall(r"Used (\d+) registers", run.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", run.stderr)
    return (int(regs[-1]) if regs else None), (int(spills[-1]) if spills else None)


def compile_one(gemm: str, cfg: tuple) -> dict:
    bm, bn, bk, warps, stages, group_m = cfg
    consts = dict(GEMMS[gemm], DOT_F32=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                  NUM_STAGES=stages, EVEN_K=True)  # fmt: skip
    if GEMMS[gemm]["GATHER_A"]:
        consts.update(a_desc=None)
    b_block = [1, bk, bn] if consts["B_KN"] else [1, bn, bk]
    a_block = b_block if consts["GATHER_A"] else [bm, bk]
    fn = tma._grouped_rows_tma_kernel
    sig = _signature(fn, consts, a_block, b_block)
    # what the JIT would specialise at the real shape: pointers, sizes and strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a][0] == "*" or a in _ALIGNED}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    regs, spills = _registers(ptx)
    return {
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "cp_async": len(re.findall(r"cp\.async\.cg", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "num_warps": k.metadata.num_warps,
        "shared_bytes": k.metadata.shared,
        "registers": regs,
        "spill_bytes": spills,
    }


# scripts/moe_tile_sweep.py's TMA rows (checked here to compile for sm_90 first: ``--sweep``)
TMA_CANDS = {
    "up": [(128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 8), (128, 64, 64, 4, 4, 8)],
    "down": [(128, 256, 64, 8, 4, 8), (128, 256, 64, 8, 3, 8)],
    "dact": [(64, 128, 64, 4, 4, 4), (128, 128, 64, 8, 4, 8)],
    "dx": [(128, 256, 64, 8, 4, 8), (128, 256, 64, 8, 3, 8)],
}


def cases(quick: bool = False, sweep: bool = False) -> list[tuple[str, tuple]]:
    """Each GEMM at its TMA_CONFIGS entry ("dact", which has none, at its first candidate)."""
    if sweep:
        return [(gemm, cfg) for gemm, cands in TMA_CANDS.items() for cfg in cands]
    if quick:  # the test's subset: A and B through TMA ("down"), a gathered A beside TMA weight tiles ("up")
        return [("down", tk.TMA_CONFIGS["down"]), ("up", tk.TMA_CONFIGS["up"])]
    return [(gemm, tk.TMA_CONFIGS.get(gemm, TMA_CANDS[gemm][0])) for gemm in GEMMS]


def main() -> None:
    report = {"triton": triton.__version__}
    for gemm, cfg in cases("--quick" in sys.argv, "--sweep" in sys.argv):
        name = f"{gemm}:{','.join(map(str, cfg))}"
        try:
            report[name] = compile_one(gemm, cfg)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: one GEMM failing says something
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            report[name] = {"error": f"{type(exc).__name__}: {first}"}
        if "--json" not in sys.argv:
            print(name, report[name], flush=True)
    if "--json" in sys.argv:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
