"""Python model of the device planner's level quotas with steps (csrc/plan_cost.cuh
level_quotas_warp: while a single donor is left, 32 rounds that find no fit at once over the
free receivers sorted by spare; with several donors, a round that finds no fit takes the first
free receiver of that order, without the fit reductions), checked against the round-by-round greedy of
planner.level_quotas with its tie rules (most excess, ties -> lowest rank; smallest free spare
covering it, ties -> lowest, else the largest free spare, ties -> lowest).  The greedy here is
itself checked against planner.level_quotas (torch) on part of the cases when torch imports.

    python3 diagnostics/models/level_steps.py        # ~60 s on one core
"""
import random
import sys


def greedy(g, L):
    """Round by round (planner.level_quotas for one level): (donor per rank, quota per rank,
    feasible, rounds that moved something)."""
    R = len(g)
    ex = [max(x - L, 0) for x in g]
    sp = [max(L - x, 0) for x in g]
    fr = [s > 0 for s in sp]
    dn, zz = [-1] * R, [0] * R
    moved = 0
    for _ in range(R - 1):
        h = max(range(R), key=lambda d: (ex[d], -d))
        eh = ex[h]
        fits = [d for d in range(R) if fr[d] and sp[d] >= eh]
        if fits:
            u = min(fits, key=lambda d: (sp[d], d))
        else:
            u = max(range(R), key=lambda d: (sp[d] if fr[d] else -1, -d))
        su = sp[u] if fr[u] else 0
        m = min(eh, su)
        if m > 0:
            ex[h] -= m
            dn[u], zz[u] = h, m
            fr[u] = False
            moved += 1
    return dn, zz, sum(ex) == 0, moved


def kernel(g, L, ib, W=32, stats=None):
    """level_quotas_warp with pk (packed keys of ib index bits) and R >= 16, step for step."""
    R = len(g)
    MR = (1 << ib) - 1
    ex = [max(x - L, 0) for x in g]
    sp = [max(L - x, 0) for x in g]
    fr = [s > 0 for s in sp]
    dn, zz = [-1] * R, [0] * R
    steps = R >= 16
    ndon = sum(1 for x in ex if x > 0)
    key = [(sp[d] << ib) | (MR - d) if fr[d] else 0 for d in range(R)]
    order = sorted((d for d in range(R) if fr[d]), key=lambda d: -key[d])
    pos = [-1] * R
    sq = [0] * R
    for i, d in enumerate(order):
        pos[d], sq[i] = i, key[d]
    nq, p = len(order), 0
    n_rounds = n_steps = 0
    stats_fast = [0]
    it = 0
    while it < R - 1:
        EH = max(ex)
        H = ex.index(EH)                               # first max
        if EH <= 0:
            break
        stepped_full = False
        kk = [sq[p + l] if p + l < nq else 0 for l in range(W)]   # read before the reduction
        fast = False
        if steps and ndon == 1 and p < nq:
            n_steps += 1
            v = [k >> ib for k in kk]
            P = [sum(v[:l]) for l in range(W)]
            ok = [p + l < nq and (kk[l] == 0 or (P[l] < EH and v[l] < EH - P[l]))
                  for l in range(W)]
            f = ok.index(False) if False in ok else W
            if f > 0:
                used = P[f - 1] + v[f - 1]
                taken = sum(1 for l in range(f) if ok[l] and kk[l] != 0)
                for d in range(R):
                    if fr[d] and p <= pos[d] < p + f:
                        assert d != H and (key[d] >> ib) == sp[d]
                        fr[d], dn[d], zz[d] = False, H, sp[d]
                ex[H] -= used
                assert ex[H] > 0
                it += taken
                p += f
                EH -= used
                if it >= R - 1:
                    break
                if f == W:
                    stepped_full = True
        elif steps:                                      # several donors: the fast round
            nz = [l for l in range(W) if kk[l] != 0]
            if nz:
                f0 = nz[0]
                kf = kk[f0]
                p += f0
                if (kf >> ib) < EH:
                    fast = True
                    u, m = MR - (kf & MR), kf >> ib
                    assert fr[u] and sp[u] == m
                    assert m == max(sp[d] for d in range(R) if fr[d])
                    p += 1
            else:
                p = min(p + W, nq)
        if stepped_full:
            continue                                     # the kernel's --it; continue
        fit = False
        if fast:
            stats_fast[0] += 1
        else:
            n_rounds += 1
            fv = [sp[d] for d in range(R) if fr[d] and sp[d] >= EH]
            lv = max([sp[d] for d in range(R) if fr[d]], default=0)
            if lv <= 0:
                break
            fit = bool(fv)
            if fit:
                FV = min(fv)
                u = next(d for d in range(R) if fr[d] and sp[d] == FV)
                m = min(EH, FV)
            else:
                u = next(d for d in range(R) if fr[d] and sp[d] == lv)
                m = min(EH, lv)
        ex[H] -= m
        fr[u], dn[u], zz[u] = False, H, m
        if steps:
            sq[pos[u]] = 0
        ndon -= 1 if fit else 0
        assert ndon == sum(1 for x in ex if x > 0)
        it += 1
    if stats is not None:
        stats[0] += n_rounds
        stats[1] += n_steps
        stats[2] += stats_fast[0]
    left = 0
    for x in ex:
        left |= x
    return dn, zz, left == 0


def case(rng):
    R = rng.choice([16, 17, 24, 31, 32, 33, 48, 63, 64])
    kind = rng.randrange(6)
    cap = rng.choice([3, 20, 1000, 100000])
    if kind == 0:                                        # one_group: one rank holds it all
        g = [0] * R
        g[rng.randrange(R)] = rng.randint(1, cap * R)
        if rng.random() < 0.5:
            for d in range(R):
                if rng.random() < 0.3:
                    g[d] += rng.randint(0, cap // 4 + 1)
    elif kind == 1:                                      # hot: one rank well above the rest
        g = [rng.randint(0, cap) for _ in range(R)]
        g[rng.randrange(R)] += rng.randint(cap, cap * R)
    elif kind == 2:                                      # zipf-like
        g = [int(cap * R / (1 + rng.randrange(R)) ** rng.choice([0.5, 1.0, 1.5])) for _ in range(R)]
    elif kind == 3:                                      # ties everywhere
        g = [rng.choice([0, cap, 2 * cap, 5 * cap]) for _ in range(R)]
    elif kind == 4:                                      # a few donors
        g = [rng.randint(0, cap) for _ in range(R)]
        for _ in range(rng.randint(1, 4)):
            g[rng.randrange(R)] += rng.randint(0, cap * R // 2)
    else:
        g = [rng.randint(0, cap) for _ in range(R)]
    T = sum(g)
    even = (T + R - 1) // R
    hi = max(max(g), even)
    L = rng.choice([even, hi, rng.randint(even, hi) if hi >= even else even,
                    max(0, even - rng.randint(0, 3)), even + rng.randint(0, 3)])
    return g, L


def main():
    rng = random.Random(12345)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    try:
        import torch
        from moonep_ops.planner import level_quotas
    except Exception:                                    # noqa: BLE001 (model only)
        torch = None
    stats = [0, 0, 0]
    greedy_rounds = 0
    nt = 0
    for i in range(n):
        g, L = case(rng)
        R = len(g)
        ib = max(1, (R - 1).bit_length())
        ref_dn, ref_zz, ref_ok, moved = greedy(g, L)
        greedy_rounds += moved
        dn, zz, ok = kernel(g, L, ib, stats=stats)
        assert (dn, zz, ok) == (ref_dn, ref_zz, ref_ok), (g, L)
        if torch is not None and i % 20 == 0:
            z, feas = level_quotas(torch.tensor(g, dtype=torch.int64),
                                   torch.tensor([L], dtype=torch.int64))
            z = z[0]
            tdn = [int(z[:, d].nonzero()[0]) if int(z[:, d].sum()) > 0 else -1 for d in range(R)]
            tzz = [int(z[:, d].sum()) for d in range(R)]
            assert (tdn, tzz, bool(feas[0])) == (ref_dn, ref_zz, ref_ok), (g, L)
            nt += 1
    print(f"{n} cases equal ({nt} also against planner.level_quotas); greedy rounds {greedy_rounds},"
          f" kernel: full rounds {stats[0]}, fast rounds {stats[2]}, steps {stats[1]}")


if __name__ == "__main__":
    main()
