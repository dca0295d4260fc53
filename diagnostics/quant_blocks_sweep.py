"""Launch variants of the 128 x 128 weight-block quantiser (quantize_fp8_triton._blocks_kernel)
on one GPU: achieved bytes/s of each, bitwise against the library's kernel (diagnostic, one H200).

    python diagnostics/quant_blocks_sweep.py [--both]

A variant is (column blocks per program, num_warps, num_stages); shapes are the DeepSeek-V3
expert weights of one rank (w1 [B, F, D], w2 [B, D, F]) and two held-out ones.
--both: one kernel writing both layouts (q of w and q of w^T) from one HBM read of w, against
the library's two passes: the transposed tile from the registers (tl.trans) or from a second
load of the same block (an L2 hit), at 8 and 16 warps.
"""
import sys
import torch
import triton
import triton.language as tl

from moonep_ops.ops import quantize_fp8_triton as qt


@triton.jit
def _strip_kernel(w_ptr, q_ptr, s_ptr, O, I, P, C, POW2: tl.constexpr, TRANS: tl.constexpr,
                  CPB: tl.constexpr, STAGES: tl.constexpr):
    # one program: CPB consecutive 128 x 128 blocks of one block row, loads pipelined
    n = tl.program_id(0)
    pp = tl.program_id(1)
    r = pp * 128 + tl.arange(0, 128)
    base = n.to(tl.int64) * O * I
    for k in tl.range(0, CPB, num_stages=STAGES):
        pc = tl.program_id(2) * CPB + k
        c = pc * 128 + tl.arange(0, 128)
        mask = (r[:, None] < O) & (c[None, :] < I)
        offs = base + r[:, None].to(tl.int64) * I + c[None, :]
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = qt._scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), POW2)
        q = qt._quant(w, s)
        if TRANS:
            offs_t = base + c[:, None].to(tl.int64) * O + r[None, :]
            mask_t = (c[:, None] < I) & (r[None, :] < O)
            tl.store(q_ptr + offs_t, tl.trans(q), mask=mask_t)
            tl.store(s_ptr + (n.to(tl.int64) * C + pc) * P + pp, s, mask=pc < C)
        else:
            tl.store(q_ptr + offs, q, mask=mask)
            tl.store(s_ptr + (n.to(tl.int64) * P + pp) * C + pc, s, mask=pc < C)


def run(w, trans, cpb, warps, stages):
    *lead, O, I = w.shape
    n = w.numel() // (O * I)
    P, C = triton.cdiv(O, 128), triton.cdiv(I, 128)
    qs, ss = ((*lead, I, O), (*lead, C, P)) if trans else ((*lead, O, I), (*lead, P, C))
    q = torch.empty(qs, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(ss, dtype=torch.float32, device=w.device)
    _strip_kernel[(n, P, triton.cdiv(C, cpb))](w, q, s, O, I, P, C, POW2=False, TRANS=trans,
                                              CPB=cpb, STAGES=stages, num_warps=warps)
    return q, s


@triton.jit
def _both_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, O, I, P, C, RELOAD: tl.constexpr):
    n = tl.program_id(0)
    pp = tl.program_id(1)
    pc = tl.program_id(2)
    r = pp * 128 + tl.arange(0, 128)
    c = pc * 128 + tl.arange(0, 128)
    base = n.to(tl.int64) * O * I
    mask = (r[:, None] < O) & (c[None, :] < I)
    offs = base + r[:, None].to(tl.int64) * I + c[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = qt._scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), False)
    q = qt._quant(w, s)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + (n.to(tl.int64) * P + pp) * C + pc, s)
    offs_t = base + c[:, None].to(tl.int64) * O + r[None, :]
    mask_t = (c[:, None] < I) & (r[None, :] < O)
    if RELOAD:      # w^T's tile read again (the block is in L2): no register transpose
        wt = tl.load(w_ptr + base + r[None, :].to(tl.int64) * I + c[:, None], mask=mask_t,
                     other=0.0).to(tl.float32)
        tl.store(qt_ptr + offs_t, qt._quant(wt, s), mask=mask_t)
    else:
        tl.store(qt_ptr + offs_t, tl.trans(q), mask=mask_t)
    tl.store(st_ptr + (n.to(tl.int64) * C + pc) * P + pp, s)


def run_both(w, reload, warps):
    *lead, O, I = w.shape
    n = w.numel() // (O * I)
    P, C = triton.cdiv(O, 128), triton.cdiv(I, 128)
    q = torch.empty((*lead, O, I), dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((*lead, P, C), dtype=torch.float32, device=w.device)
    qt_ = torch.empty((*lead, I, O), dtype=torch.float8_e4m3fn, device=w.device)
    st = torch.empty((*lead, C, P), dtype=torch.float32, device=w.device)
    _both_kernel[(n, P, C)](w, q, s, qt_, st, O, I, P, C, RELOAD=reload, num_warps=warps)
    return q, s, qt_, st


def main_both():
    torch.manual_seed(0)
    shapes = [("w1 dsv3", (32, 2048, 7168)), ("w2 dsv3", (32, 7168, 2048)),
              ("held-out qwen3-235b w1", (16, 1536, 4096)), ("held-out w2", (16, 4096, 1536)),
              ("cut tiles", (3, 200, 336))]
    for name, shp in shapes:
        w = torch.randn(shp, device="cuda", dtype=torch.bfloat16)
        ref = qt.quantize_blocks(w, False) + qt.quantize_blocks(w, False, True)
        t0 = timed(lambda: (qt.quantize_blocks(w, False), qt.quantize_blocks(w, False, True)))
        print(f"{name:24s} library, two passes {t0 * 1e3:7.3f} ms")
        for reload in (False, True):
            for warps in (8, 16):
                got = run_both(w, reload, warps)
                same = bitwise(got, ref)
                t = timed(lambda: run_both(w, reload, warps))
                print(f"{name:24s} both reload={int(reload)} w={warps:2d} {t * 1e3:7.3f} ms "
                      f"x{t0 / t:4.2f} {'bitwise' if same else 'DIFFERS'}")


def bitwise(got, ref) -> bool:
    """Every tensor of ``got`` equals ``ref``'s bit for bit (e4m3 compared as bytes)."""
    return all(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
               for a, b in zip(got, ref))


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e-3


def main():
    torch.manual_seed(0)
    shapes = [("w1 dsv3", (32, 2048, 7168)), ("w2 dsv3", (32, 7168, 2048)),
              ("held-out qwen3-235b w1", (16, 1536, 4096)), ("held-out w2", (16, 4096, 1536))]
    variants = [(1, 8, 1), (1, 4, 1), (1, 16, 1), (2, 8, 2), (4, 8, 2), (4, 8, 3), (8, 8, 3),
                (4, 4, 3), (8, 4, 3), (2, 4, 2)]
    for name, shp in shapes:
        w = torch.randn(shp, device="cuda", dtype=torch.bfloat16)
        nbytes = w.numel() * 3 + 4 * (w.numel() // 16384)
        for trans in (False, True):
            ref = qt.quantize_blocks(w, False, trans)
            t0 = timed(lambda: qt.quantize_blocks(w, False, trans))
            print(f"{name:24s} trans={int(trans)} library      {t0 * 1e3:7.3f} ms "
                  f"{nbytes / t0 / 1e12:5.2f} TB/s")
            for cpb, warps, stages in variants:
                got = run(w, trans, cpb, warps, stages)
                same = bitwise(got, ref)
                t = timed(lambda: run(w, trans, cpb, warps, stages))
                print(f"{name:24s} trans={int(trans)} cpb={cpb} w={warps:2d} st={stages} "
                      f"{t * 1e3:7.3f} ms {nbytes / t / 1e12:5.2f} TB/s  x{t0 / t:4.2f} "
                      f"{'bitwise' if same else 'DIFFERS'}")


if __name__ == "__main__":
    main_both() if "--both" in sys.argv[1:] else main()
