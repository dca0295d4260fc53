"""A deliberately plain, loop-by-loop transcription of the MoonEP planning steps.

Independent of moonep_ops.planner (no shared code, plain Python ints and lists) so that the
vectorised op can be checked against it bit for bit.  Slow: only for small cases.
"""
from __future__ import annotations


def _argmax(xs):
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def _argmin(xs):
    best = 0
    for i, x in enumerate(xs):
        if x < xs[best]:
            best = i
    return best


def _align(x, a):
    return (x + a - 1) // a * a


def _steps_1_2(cnt, R, B, cap):
    """MoonEP's steps 1-2 towards the per-rank targets ``cap`` (summing to sum(cnt))."""
    E = R * B
    group = [sum(cnt[h * B:(h + 1) * B]) for h in range(R)]

    # step 1
    bal = [group[h] - cap[h] for h in range(R)]
    z = [[0] * R for _ in range(R)]
    while True:
        h = _argmax(bal)
        u = _argmin(bal)
        if bal[h] <= 0 or bal[u] >= 0:
            break
        m = -bal[u]
        z[h][u] = m
        bal[h] -= m
        bal[u] = 0

    return z, _split(cnt, R, B, z)                  # step 2


# policy "cost" (docs/planner.md): levels of its one-stage search
COST_LEVELS = 16


def _cdiv(a, b):
    return -(-a // b)


def _level_quotas(group, L):
    """Donors (group above L) shed the excess; each round the donor with the most excess left
    (ties: lowest rank) refills one receiver nobody used yet: the smallest spare L - group
    covering its excess, else the largest (ties: lowest rank).  None if the excess does not
    fit."""
    R = len(group)
    excess = [max(g - L, 0) for g in group]
    spare = [max(L - g, 0) for g in group]
    free = [sp > 0 for sp in spare]
    z = [[0] * R for _ in range(R)]
    while sum(excess) > 0:
        h = _argmax(excess)
        cover = [d for d in range(R) if free[d] and spare[d] >= excess[h]]
        rest = [d for d in range(R) if free[d]]
        if not rest:
            return None
        u = min(cover, key=lambda d: (spare[d], d)) if cover else \
            max(rest, key=lambda d: (spare[d], -d))
        m = min(excess[h], spare[u])
        z[h][u] = m
        excess[h] -= m
        free[u] = False
    return z


def _split(cnt, R, B, z):
    """MoonEP's step 2 for the quotas z."""
    E = R * B
    alloc = [[0] * R for _ in range(E)]
    for e in range(E):
        alloc[e][e // B] = cnt[e]
    for h in range(R):
        rem = cnt[h * B:(h + 1) * B]
        q = list(z[h])
        while True:
            d = _argmax(q)
            if q[d] <= 0:
                break
            le = _argmax(rem)
            t = min(rem[le], q[d])
            assert t > 0, "owner ran out of tokens"
            alloc[h * B + le][d] += t
            alloc[h * B + le][h] -= t
            rem[le] -= t
            q[d] -= t
    return alloc


def _score(alloc, R, B, X):
    """max load + X * busiest link (max over ranks of replicas out and slots in)."""
    E = R * B
    load = [sum(alloc[e][d] for e in range(E)) for d in range(R)]
    out = [0] * R
    inn = [0] * R
    for e in range(E):
        for d in range(R):
            if d != e // B and alloc[e][d] > 0:
                out[e // B] += 1
                inn[d] += 1
    return max(load) + X * max(max(o, i) for o, i in zip(out, inn))


def _cost_steps_1_2(cnt, R, B, cap, T, slack_ppm, X):
    """Policy "cost": the lowest-scoring of MoonEP's plan and the feasible level plans."""
    group = [sum(cnt[h * B:(h + 1) * B]) for h in range(R)]
    even = _cdiv(T, R)
    limit = _cdiv(even * (1_000_000 + slack_ppm), 1_000_000)
    hi = min(max(max(group), even), limit)
    n = COST_LEVELS
    INF = float("inf")

    def level(L):
        z = _level_quotas(group, L)
        if z is None:
            return None, None, INF
        alloc = _split(cnt, R, B, z)
        return z, alloc, _score(alloc, R, B, X)

    levels = [even + _cdiv((hi - even) * k, n - 1) for k in range(n)]
    z0, a0 = _steps_1_2(cnt, R, B, cap)
    cands = [(z0, a0, _score(a0, R, B, X))] + [level(L) for L in levels]
    best = min(range(len(cands)), key=lambda i: (cands[i][2], i))
    return cands[best][0], cands[best][1]


def reference_plan(topk, R, E, tp=1, *, policy="moonep", slack_ppm=0, replica_cost=0):
    """topk: list of R lists of flat expert ids (rank r has s_r*K entries).

    Returns dict with per-rank dst lists (duplicates negated), cu[R][2epn], etc[R][epn],
    zf[R][2epn][2], stats[R][2], plus alloc[e][d] and z[h][d].  policy "moonep" or "cost"
    (with slack_ppm 0 the latter is the former).
    """
    B = E // R
    K_entries = [len(t) for t in topk]
    tpe = [[0] * E for _ in range(R)]
    for r in range(R):
        for e in topk[r]:
            tpe[r][e] += 1
    T = sum(K_entries)
    base, extra = divmod(T, R)
    cap = [base + (1 if r < extra else 0) for r in range(R)]
    cnt = [sum(tpe[r][e] for r in range(R)) for e in range(E)]
    if policy == "cost" and slack_ppm:
        z, alloc = _cost_steps_1_2(cnt, R, B, cap, T, slack_ppm, replica_cost)
    else:
        z, alloc = _steps_1_2(cnt, R, B, cap)

    # step 3
    etc = [[-1] * B for _ in range(R)]
    cu = [[0] * (2 * B) for _ in range(R)]
    zf = [[[0, 0] for _ in range(2 * B)] for _ in range(R)]
    off = [dict() for _ in range(R)]
    stats = [[0, 0] for _ in range(R)]
    for d in range(R):
        remote = [e for e in range(E) if e // B != d and alloc[e][d] > 0]
        assert len(remote) <= B
        for b, e in enumerate(remote):
            etc[d][b] = e
        stats[d][0] = len(remote)
        experts = [d * B + j for j in range(B)] + [etc[d][b] for b in range(B)]
        run = 0
        for g, e in enumerate(experts):
            c = alloc[e][d] if e >= 0 else 0
            p = _align(c, tp) if c > 0 else 0
            if c > 0:
                off[d][e] = run
            if p > c:
                zf[d][g] = [run + c, p - c]
            run += p
            cu[d][g] = run
    for d in range(R):
        for dd in range(R):
            for e in etc[dd]:
                if e >= 0 and e // B == d:
                    stats[d][1] += 1

    # step 4
    dst = []
    for r in range(R):
        seen = [0] * E
        out = []
        for i, e in enumerate(topk[r]):
            gr = sum(tpe[rr][e] for rr in range(r)) + seen[e]
            seen[e] += 1
            acc = 0
            for d in range(R):
                if acc + alloc[e][d] > gr:
                    break
                acc += alloc[e][d]
            else:
                raise AssertionError("no destination")
            out.append((d, off[d][e] + gr - acc))
        dst.append(out)
    return dict(tpe=tpe, cap=cap, alloc=alloc, z=z, etc=etc, cu=cu, zf=zf, stats=stats,
                dest_loff=dst)


def encode_dst(dest_loff, K, NvS):
    """Encode (dest, loff) pairs as d*NvS + loff, negating later same-destination copies."""
    out = []
    for t in range(len(dest_loff) // K):
        seen = set()
        for k in range(K):
            d, loff = dest_loff[t * K + k]
            v = d * NvS + loff
            out.append(v if d not in seen else -v - 1)
            seen.add(d)
    return out
