"""Scratch: the decode kernel's register cap over fp8 and bf16 caches at the bench shapes (real entry point)."""
import torch
from polyrl.bench import common
from polyrl.kernels.paged_attention.triton import _paged_attention

dev = torch.device("cuda")
bw = common.measure_copy_bandwidth(dev)
print(f"copy bw {bw/1e9:.0f} GB/s")
for label, b, ctx_len, cap, hq, hk in (("8b B256 ctx256", 256, 256, 400, 32, 8), ("0.6b B256 ctx256", 256, 256, 400, 16, 8),
                                       ("0.6b B256 ctx116", 256, 116, 2048, 16, 8), ("8b B128 ctx384", 128, 384, 400, 32, 8)):
    D, PAGE = 128, 16
    gen = torch.Generator(device="cpu").manual_seed(0)
    width = -(-cap // PAGE)
    blocks = b * width
    tables = torch.randperm(blocks, generator=gen).view(b, width).to(dev, torch.int32)
    lens = torch.full((b,), ctx_len, dtype=torch.int32, device=dev)
    cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, D, generator=gen).to(dev, torch.bfloat16)
    for kvd in (torch.float8_e4m3fn, torch.bfloat16):
        kc = torch.randn(blocks, PAGE, hk, D, generator=gen).to(dev, kvd)
        vc = torch.randn(blocks, PAGE, hk, D, generator=gen).to(dev, kvd)
        moved = 2 * b * ctx_len * hk * D * kc.element_size()
        ref = _paged_attention(q, kc, vc, tables, lens, cu, 1, None, None, None, None).clone()
        tunings = [None, {"max_registers": 0}, {"max_registers": 128}, {"max_registers": 112}, {"max_registers": 96},
                   {"max_registers": 128, "num_stages": 3}, {"max_registers": 112, "num_stages": 3},
                   {"max_registers": 128, "num_stages": 2}, {"max_registers": 104, "num_stages": 2}]
        for tu in tunings:
            out = _paged_attention(q, kc, vc, tables, lens, cu, 1, None, None, None, tu)
            same = torch.equal(out, ref)
            r = common.time_graph(lambda tu=tu: _paged_attention(q, kc, vc, tables, lens, cu, 1, None, None, None, tu), dev, reps=30)
            ms = r["median_ms"]
            print(f"{label} {str(kvd)[6:]:14s} {str(tu):45s} {ms*1e3:6.1f} us {moved/(ms*1e-3)/bw:4.0%} same={same}", flush=True)
