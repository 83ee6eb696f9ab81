"""Scratch: FP8 paged decode variants at the qwen3-8b B256 ctx256 shape (not committed)."""
import sys

import torch
import triton
import triton.language as tl

from polyrl.bench import common
from polyrl.kernels.paged_attention.triton import LOG2E, _paged_attention


@triton.jit
def _var_kernel(Q, KC, VC, BT, CTX, CUQ, O, qk_scale, num_kv_heads,
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                stride_ot, stride_oh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HC: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, UPK: tl.constexpr, UPV: tl.constexpr, ABL: tl.constexpr, KROWS: tl.constexpr, PF: tl.constexpr,
                CMP: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(CUQ + b)
    ctx = tl.load(CTX + b)
    TILE: tl.constexpr = BLOCK_N * HC
    r = tl.arange(0, ROWS)
    head = c * HC * GROUP + r
    row_valid = (r < HC * GROUP) & (c * HC + r // GROUP < num_kv_heads)
    offs_d = tl.arange(0, HEAD_DIM)
    t64 = t.to(tl.int64)
    q = tl.load(Q + t64 * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    scale = qk_scale
    if UPK:
        scale = qk_scale * 256.0
    qs = (q.to(tl.float32) * scale).to(tl.float16)
    j = tl.arange(0, TILE)
    j_head = c * HC + j % HC
    own = (r // GROUP)[:, None] == (j % HC)[None, :]
    head_ok = j_head < num_kv_heads
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    if PF:
        k_pos0 = j // HC
        kv0 = (k_pos0 < ctx) & head_ok
        if BLOCK_N > PAGE:
            blk0 = tl.load(bt_row + k_pos0 // PAGE, mask=k_pos0 < ctx, other=0).to(tl.int64)
        else:
            blk0 = tl.load(bt_row).to(tl.int64)
        ip0 = (k_pos0 % PAGE).to(tl.int64)
        kt_n = tl.load(KC + (blk0 * stride_kb + ip0 * stride_ks + j_head * stride_kh)[None, :] + offs_d[:, None],
                       mask=kv0[None, :], other=0.0)
        v_n = tl.load(VC + (blk0 * stride_vb + ip0 * stride_vs + j_head * stride_vh)[:, None] + offs_d[None, :],
                      mask=kv0[:, None], other=0.0)
        for start in range(0, ctx, BLOCK_N):
            k_pos = start + j // HC
            k_valid = (k_pos < ctx) & head_ok
            kt = kt_n
            v = v_n
            nk_pos = k_pos + BLOCK_N
            nv = (nk_pos < ctx) & head_ok
            if BLOCK_N > PAGE:
                nblk = tl.load(bt_row + nk_pos // PAGE, mask=nk_pos < ctx, other=0).to(tl.int64)
            else:
                nblk = tl.load(bt_row + (start + BLOCK_N) // PAGE, mask=start + BLOCK_N < ctx, other=0).to(tl.int64)
            nip = (nk_pos % PAGE).to(tl.int64)
            kt_n = tl.load(KC + (nblk * stride_kb + nip * stride_ks + j_head * stride_kh)[None, :] + offs_d[:, None],
                           mask=nv[None, :], other=0.0)
            v_n = tl.load(VC + (nblk * stride_vb + nip * stride_vs + j_head * stride_vh)[:, None] + offs_d[None, :],
                          mask=nv[:, None], other=0.0)
            if UPK:
                y = kt.to(tl.uint16)
                kt = (((y & 0x80) << 8) | ((y & 0x7F) << 7)).to(tl.float16, bitcast=True)
            else:
                kt = kt.to(tl.float16)
            if UPV:
                y = v.to(tl.uint16)
                v = (((y & 0x80) << 8) | ((y & 0x7F) << 7)).to(tl.float16, bitcast=True)
            else:
                v = v.to(tl.float16)
            qk = tl.dot(q, kt) * scale
            allowed = own & k_valid[None, :]
            qk = tl.where(allowed, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(tl.float16), v, acc)
            m_i = m_new
    else:
        for start in range(0, ctx, BLOCK_N):
            k_pos = start + j // HC
            k_valid = (k_pos < ctx) & head_ok
            if BLOCK_N > PAGE:
                block = tl.load(bt_row + k_pos // PAGE, mask=k_pos < ctx, other=0).to(tl.int64)
            else:
                block = tl.load(bt_row + start // PAGE).to(tl.int64)
            in_page = (k_pos % PAGE).to(tl.int64)
            slot_k = block * stride_kb + in_page * stride_ks + j_head * stride_kh
            slot_v = block * stride_vb + in_page * stride_vs + j_head * stride_vh
            if KROWS:
                kr = tl.load(KC + slot_k[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0)  # [TILE, D]
                if UPK:
                    y = kr.to(tl.uint16)
                    kr = (((y & 0x80) << 8) | ((y & 0x7F) << 7)).to(tl.float16, bitcast=True)
                else:
                    kr = kr.to(tl.float16)
                kt = tl.trans(kr)
            else:
                kt = tl.load(KC + slot_k[None, :] + offs_d[:, None], mask=k_valid[None, :], other=0.0)  # [D, TILE]
                if UPK:
                    y = kt.to(tl.uint16)
                    kt = (((y & 0x80) << 8) | ((y & 0x7F) << 7)).to(tl.float16, bitcast=True)
                else:
                    kt = kt.to(tl.float16)
            v = tl.load(VC + slot_v[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0)
            if UPV:
                y = v.to(tl.uint16)
                v = (((y & 0x80) << 8) | ((y & 0x7F) << 7)).to(tl.float16, bitcast=True)
            else:
                v = v.to(tl.float16)
            if CMP:
                qk = tl.dot(qs, kt)
                qk3 = tl.reshape(qk, [ROWS, BLOCK_N, HC])
                own3 = tl.reshape(own, [ROWS, BLOCK_N, HC])
                sc = tl.sum(tl.where(own3, qk3, 0.0), axis=2)  # [ROWS, BLOCK_N]
                tok_ok = (start + tl.arange(0, BLOCK_N)) < ctx
                sc = tl.where(tok_ok[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                pc = tl.math.exp2(sc - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(pc, 1)
                acc = acc * alpha[:, None]
                p3 = tl.where(own3, tl.reshape(pc, [ROWS, BLOCK_N, 1]).broadcast_to([ROWS, BLOCK_N, HC]), 0.0)
                p = tl.reshape(p3, [ROWS, TILE])
                acc = tl.dot(p.to(tl.float16), v, acc)
                m_i = m_new
            else:
                qk = tl.dot(q, kt) * scale
                allowed = own & k_valid[None, :]
                qk = tl.where(allowed, qk, float("-inf"))
                if ABL == 1:  # ablation: no online softmax (wrong numbers, timing only)
                    p = tl.where(allowed, qk, 0.0)
                    l_i += tl.sum(p, 1)
                    acc = tl.dot(p.to(tl.float16), v, acc)
                else:
                    m_new = tl.maximum(m_i, tl.max(qk, 1))
                    p = tl.math.exp2(qk - m_new[:, None])
                    alpha = tl.math.exp2(m_i - m_new)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None]
                    acc = tl.dot(p.to(tl.float16), v, acc)
                    m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if UPV:
        out = out * 256.0
    tl.store(O + t64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_valid[:, None])


def run_var(q, kc, vc, bt, ctx, cu, out, hc=4, bn=16, upk=0, upv=0, abl=0, krows=0, pf=0, cmp=0, warps=4, stages=5, maxnreg=None):
    _, hq, d = q.shape
    _, page, hk, _ = kc.shape
    kcu, vcu = kc.view(torch.uint8), vc.view(torch.uint8)
    use_k = kcu if upk else kc
    use_v = vcu if upv else vc
    _var_kernel[(bt.shape[0], triton.cdiv(hk, hc))](
        q, use_k, use_v, bt, ctx, cu, out, LOG2E / d ** 0.5, hk,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        bt.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hk, HEAD_DIM=d, PAGE=page, HC=hc, ROWS=max(16, hq // hk * hc), BLOCK_N=bn, UPK=upk, UPV=upv,
        ABL=abl, KROWS=krows, PF=pf, CMP=cmp, num_warps=warps,
        num_stages=stages, maxnreg=maxnreg)


def main():
    dev = torch.device("cuda")
    mode = sys.argv[1] if len(sys.argv) > 1 else "time"
    b, ctx_len, cap, hq, hk, D, PAGE = 256, 256, 400, 32, 8, 128, 16
    gen = torch.Generator(device="cpu").manual_seed(0)
    width = -(-cap // PAGE)
    blocks = b * width
    tables = torch.randperm(blocks, generator=gen).view(b, width).to(dev, torch.int32)
    lens = torch.full((b,), ctx_len, dtype=torch.int32, device=dev)
    cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, D, generator=gen).to(dev, torch.bfloat16)
    kc16 = torch.randn(blocks, PAGE, hk, D, generator=gen).to(dev, torch.bfloat16)
    vc16 = torch.randn(blocks, PAGE, hk, D, generator=gen).to(dev, torch.bfloat16)
    kc8, vc8 = kc16.to(torch.float8_e4m3fn), vc16.to(torch.float8_e4m3fn)
    out = torch.empty_like(q)
    if mode == "ncu":
        for _ in range(2):
            _paged_attention(q, kc8, vc8, tables, lens, cu, 1, None, None, None, None)
            _paged_attention(q, kc16, vc16, tables, lens, cu, 1, None, None, None, None)
            run_var(q, kc8, vc8, tables, lens, cu, out, pf=1, stages=1)
            run_var(q, kc8, vc8, tables, lens, cu, out, pf=1, stages=1, upk=1, upv=1)
        torch.cuda.synchronize()
        return
    bw = common.measure_copy_bandwidth(dev)
    ref = torch.empty_like(q)
    _paged_attention(q, kc8, vc8, tables, lens, cu, 1, None, None, None, None)
    ref.copy_(_paged_attention(q, kc8, vc8, tables, lens, cu, 1, None, None, None, None))
    moved8 = 2 * b * ctx_len * hk * D

    def t(label, fn, moved):
        r = common.time_graph(fn, dev, reps=30)
        ms = r.get("median_ms") or r.get("ms") or r.get("mean_ms")
        print(f"{label:60s} {ms*1e3:7.1f} us  {moved/(ms*1e-3)/bw:5.0%} of copy", flush=True)

    print(f"copy bw {bw/1e9:.0f} GB/s")
    t("default fp8", lambda: _paged_attention(q, kc8, vc8, tables, lens, cu, 1, None, None, None, None), moved8)
    t("default bf16", lambda: _paged_attention(q, kc16, vc16, tables, lens, cu, 1, None, None, None, None), 2 * moved8)
    for splits in (2, 4):
        t(f"default fp8 splits {splits}", lambda splits=splits: _paged_attention(
            q, kc8, vc8, tables, lens, cu, 1, None, None, splits, None), moved8)
    t("fp8 hc8 w8 splits 2", lambda: _paged_attention(
        q, kc8, vc8, tables, lens, cu, 1, None, None, 2, {"kv_heads": 8, "block_n": 16, "num_warps": 8}), moved8)
    variants = [dict(hc=4, bn=16), dict(hc=4, bn=16, cmp=1), dict(hc=4, bn=16, cmp=1, upv=1)]
    for st in (5, 3, 2, 1):
        for mr in (None, 128):
            variants.append(dict(hc=4, bn=16, stages=st, maxnreg=mr))
            variants.append(dict(hc=4, bn=16, stages=st, maxnreg=mr, cmp=1))
    for mr in (128, 168):
        variants.append(dict(hc=4, bn=16, pf=1, stages=1, maxnreg=mr))
    for bn in (8, 32):
        variants.append(dict(hc=4, bn=bn, stages=3, maxnreg=128))
        variants.append(dict(hc=4, bn=bn, stages=3, maxnreg=128, cmp=1))
    for v in variants:
        o = torch.empty_like(q)
        try:
            run_var(q, kc8, vc8, tables, lens, cu, o, **v)
            err = (o.float() - ref.float()).abs().max().item()
            t(f"{v} err {err:.1e}", lambda v=v, o=o: run_var(q, kc8, vc8, tables, lens, cu, o, **v), moved8)
        except Exception as exc:
            print(f"{v} failed: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
