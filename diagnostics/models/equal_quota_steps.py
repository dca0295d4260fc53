"""Python model of policy cost's equal-quota steps (csrc/plan_cost.cuh cost_equal_steps, called
by cost_split_pair after its one-expert steps), checked against the round-by-round greedy of
planner.split_quotas_batched ("max") for one (candidate, donor) pair, with the kernel's tie
rules (largest quota, ties -> lowest rank; most tokens left, ties -> lowest local expert) and
its R - 1 + B round cap.

Why: one_group's level plans at R = 64 give nearly every receiver the same quota L, and the
single donor's 4 similar experts take turns, so the one-expert steps never start and the pair
is ~62 dependent greedy rounds.  While the m largest quotas all equal Q and the expert picked
holds >= Q, a round fills one of them whole (lowest rank first), and the greedy's expert
sequence is the merge, by value (ties -> lowest expert), of the sequences r_e - k Q.  With
r_e = a_e Q + b_e (0 <= b_e < Q) the element r_e - k Q has "level" a_e - k, and the order is
level first, then b descending, then expert ascending.  So n whole fills (n = min(m, sum_e a_e,
rounds left)) take from expert e

    k_e = max(0, a_e - J) + [e among the first n - S(J + 1) experts of level J by (b desc, e)]

with S(j) = sum_e max(0, a_e - j + 1) (elements of level >= j) and J the largest j with
S(j) >= n, found by a binary search over [max(1, A - n + 1), A] (A = max a_e: the largest
expert alone supplies n elements above A - n + 1, so each term is <= n and the sums stay small).
The step repeats while the next largest quotas form a run of >= kMin; the round loop finishes
(partial fills, quotas that are not equal).

    python3 diagnostics/models/equal_quota_steps.py          # ~40 s on one core
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cost_split_steps import _rounds, greedy, one_expert_steps, pairs  # noqa: E402

KMIN = 4             # smallest run of equal largest quotas worth a step (kCostEqualMin)


def equal_steps(st, R, B, it0, kmin=KMIN, stats=None, cover=None):
    """cost_equal_steps: whole fills of the run of equal largest quotas, step after step.
    Every quantity is what a lane or a warp reduction computes in the kernel (B <= 64 experts,
    lane l holding experts l and l + 32; receivers d = lane + 32 j)."""
    q, rem, nin, tin = st["q"], st["rem"], st["nin"], st["tin"]
    cap = R - 1 + B
    it = it0
    while it < cap:
        QM = max(q.values(), default=0)                          # warp max of the quotas
        if QM <= 0:
            break
        run = sorted(d for d in q if q[d] == QM)                 # ballots of q == QM
        m = len(run)
        if m < kmin:
            break
        a = [r // QM for r in rem]                               # per expert, one division
        b = [r - x * QM for r, x in zip(rem, a)]
        nsat = sum(min(x, m) for x in a)                         # warp sum, each term <= m
        n = min(m, nsat, cap - it)
        if n <= 0:
            break
        A = max(a)                                               # warp max
        S = lambda j: sum(max(0, x - j + 1) for x in a)          # noqa: E731 (a warp sum)
        lo, hi = max(1, A - n + 1), A                            # S(lo) >= n; find the last
        while lo < hi:                                           # ceil_log2(hi - lo + 1) sums
            mid = (lo + hi + 1) >> 1
            if S(mid) >= n:
                lo = mid
            else:
                hi = mid - 1
        J = lo
        need = n - S(J + 1)                                      # 1 <= need <= #level-J experts
        nJ = sum(1 for x in a if x >= J)
        assert 1 <= need <= nJ
        if cover is not None:                                    # which limits were hit
            cover["tie"] += need < nJ
            cover["run_short"] += n < m
            cover["cap"] += n == cap - it < min(m, nsat)
            cover["search"] += A - n + 1 > 1
        key = [b[l] if a[l] >= J else -1 for l in range(B)]
        for l in range(B):
            # rank of expert l in level J: experts before it by (b desc, l asc)
            rk = sum(1 for e in range(B) if key[e] > key[l] or (key[e] == key[l] and e < l))
            k = max(0, a[l] - J) + (1 if key[l] >= 0 and rk < need else 0)
            rem[l] -= k * QM
        for d in run[:n]:                                        # rank order: ballot prefix
            q[d] = 0
            nin[d] += 1
            tin[d] += QM
        st["no"] += n
        st["to"] += n * QM
        it += n
        if stats is not None:
            stats.append(n)
        if n < m:                                                # an expert fell below QM
            break
    return it - it0


def equal_steps_lanes(st, R, B, it0, kmin=KMIN):
    """cost_equal_steps line by line on 32 lanes (registers r0 / r1: experts lane and lane + 32;
    q[j][lane]: receiver lane + 32 j), to check the kernel's indexing (ranks, ballot prefixes)."""
    NJ = 2 if R > 32 else 1
    q = [[st["q"].get(l + 32 * j, 0) for l in range(32)] for j in range(NJ)]
    nin = [[0] * 32 for _ in range(NJ)]
    tin = [[0] * 32 for _ in range(NJ)]
    rem = st["rem"]
    r0 = [rem[l] if l < B else 0 for l in range(32)]
    r1 = [rem[l + 32] if l + 32 < B else 0 for l in range(32)]
    popc = lambda x: bin(x).count("1")                           # noqa: E731
    ballot = lambda p: sum(1 << l for l in range(32) if p[l])    # noqa: E731
    cap = R - 1 + B
    it = it0
    while it < cap:
        QM = max(max(q[j][l] for j in range(NJ)) for l in range(32))
        if QM <= 0:
            break
        m = sum(popc(ballot([q[j][l] == QM for l in range(32)])) for j in range(NJ))
        if m < kmin:
            break
        a0 = [x // QM for x in r0]
        a1 = [x // QM for x in r1]
        nsat = sum(min(a0[l], m) + min(a1[l], m) for l in range(32))
        n = min(min(m, nsat), cap - it)
        if n <= 0:
            break
        A = max(max(a0[l], a1[l]) for l in range(32))
        S = lambda j: sum(max(0, a0[l] - j + 1) + max(0, a1[l] - j + 1)  # noqa: E731
                          for l in range(32))
        lo, hi = max(1, A - n + 1), A
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if S(mid) >= n:
                lo = mid
            else:
                hi = mid - 1
        J = lo
        need = n - S(J + 1)
        key0 = [r0[l] - a0[l] * QM if a0[l] >= J else -1 for l in range(32)]
        key1 = [r1[l] - a1[l] * QM if a1[l] >= J else -1 for l in range(32)]
        rk0, rk1 = [0] * 32, [0] * 32
        for lane in range(32):
            for ll in range(min(B, 32)):
                v = key0[ll]
                rk0[lane] += 1 if (v > key0[lane] or (v == key0[lane] and ll < lane)) else 0
                rk1[lane] += 1 if v >= key1[lane] else 0
            for ll in range(B - 32):
                v = key1[ll]
                rk0[lane] += 1 if v > key0[lane] else 0
                rk1[lane] += 1 if (v > key1[lane] or (v == key1[lane] and ll < lane)) else 0
        for lane in range(32):
            r0[lane] -= (max(0, a0[lane] - J) + (1 if key0[lane] >= 0 and rk0[lane] < need
                                                 else 0)) * QM
            r1[lane] -= (max(0, a1[lane] - J) + (1 if key1[lane] >= 0 and rk1[lane] < need
                                                 else 0)) * QM
        before = 0
        for j in range(NJ):
            run = ballot([q[j][l] == QM for l in range(32)])
            for lane in range(32):
                if q[j][lane] == QM and before + popc(run & ((1 << lane) - 1)) < n:
                    q[j][lane] = 0
                    nin[j][lane] += 1
                    tin[j][lane] += QM
            before += popc(run)
        st["no"] += n
        st["to"] += n * QM
        it += n
        if n < m:
            break
    for d in st["q"]:
        j, l = divmod(d, 32)
        st["q"][d] = q[j][l]
        st["nin"][d] += nin[j][l]
        st["tin"][d] += tin[j][l]
    for l in range(B):
        rem[l] = r0[l] if l < 32 else r1[l - 32]
    return it - it0


def kernel(q, rem, R, eq=True, kmin=KMIN, stats=None, cover=None, lanes=False):
    """cost_split_pair's register path: one-expert steps, equal-quota steps, then the greedy."""
    B = len(rem)
    st = {"q": dict(q), "rem": list(rem), "nin": {d: 0 for d in q},
          "tin": {d: 0 for d in q}, "no": 0, "to": 0}
    it = one_expert_steps(st, R, B)
    if eq and lanes:
        it += equal_steps_lanes(st, R, B, it, kmin)
    elif eq:
        it += equal_steps(st, R, B, it, kmin, stats, cover)
    q, rem, nin, tin = st["q"], st["rem"], st["nin"], st["tin"]
    no, to = _rounds(q, rem, nin, tin, st["no"], st["to"], it, R)
    rounds = no - st["no"]                                       # one copy-out a round
    st["no"], st["to"] = no, to
    if stats is not None:
        stats.append(-rounds - 1)                                # loop rounds, tagged
    return q, rem, nin, tin, st["no"], st["to"]


def random_equal(rng):
    """Random quotas with runs of equal values (the largest run or not), random tokens."""
    R = rng.randint(2, 64)
    B = rng.randint(1, 64)
    nq = rng.randint(1, R - 1)
    rs = rng.sample(range(R), nq)
    Q = rng.choice([1, 2, 3, 7, 50, 512, 4096, 1 << 20])
    vals = [Q] * rng.randint(1, nq)
    while len(vals) < nq:
        v = max(0, Q + rng.choice([-Q, -1, 1, Q // 2, -(Q // 2), rng.randint(-Q, Q)]))
        vals += [v] * rng.randint(1, nq - len(vals))
    rng.shuffle(vals)
    q = dict(zip(rs, vals))
    tot = sum(vals) + rng.randint(0, 3 * Q)
    mode = rng.random()
    if mode < 0.4:                                               # similar experts
        w = [1.0 + 0.05 * rng.random() for _ in range(B)]
    elif mode < 0.7:
        w = [rng.random() for _ in range(B)]
    else:                                                        # exact multiples of Q
        rem = [Q * rng.randint(0, 2 * nq // B + 2) + rng.choice([0, 0, 1, Q - 1])
               for _ in range(B)]
        return q, rem, R
    s = sum(w)
    rem = [int(x / s * tot) for x in w]
    if rng.random() < 0.5:
        for _ in range(tot - sum(rem)):
            rem[rng.randrange(B)] += 1
    return q, rem, R


def main():
    rng = random.Random(23)
    n = stepped = lanes_checked = 0
    by, r64 = {}, {}
    cover = {"tie": 0, "run_short": 0, "cap": 0, "search": 0}
    while n < 24000:
        x = rng.random()
        if x < 0.3:
            cases = pairs(rng)
        else:
            cases = [random_equal(rng) + ("random",)]
        for q, rem, R, shape in cases:
            if len(rem) > 64:
                continue                                         # the shared-memory path
            ref = greedy(q, rem, R)
            st = []
            got = kernel(q, rem, R, stats=st, cover=cover)
            assert got == ref, (q, rem, R)
            for km in (1, 2):                                    # more steps, same greedy
                assert kernel(q, rem, R, kmin=km) == ref, (q, rem, R, km)
            steps = [s for s in st if s >= 0]
            loop = -st[-1] - 1
            if steps or n % 8 == 0:                              # the lane-level model
                assert kernel(q, rem, R, lanes=True) == ref, (q, rem, R)
                lanes_checked += 1
            if steps:
                stepped += 1
            if R == 64 and len(rem) == 4 and shape != "random":
                base = []
                kernel(q, rem, R, eq=False, stats=base)
                a = r64.setdefault(shape, [0, 0, 0, 0, 0])
                a[0] += 1
                a[1] += ref[4]                                   # greedy rounds
                a[2] += -base[-1] - 1                            # loop rounds before
                a[3] += loop                                     # loop rounds after
                a[4] += len(steps)
            n += 1
            by[shape] = by.get(shape, 0) + 1
    print(f"ok: {n} pairs equal to the greedy ({by}); {stepped} of them took equal-quota steps "
          f"({lanes_checked} pairs also on the lane-level model); "
          f"steps that broke a tie inside a level, stopped short of the run, hit the round "
          f"cap, searched above level 1: {cover}")
    for shape, (k, g, b0, b1, s) in sorted(r64.items()):
        print(f"  R = 64, B = 4, {shape}: {k} pairs, {g / k:.1f} greedy rounds a pair, loop "
              f"rounds {b0 / k:.1f} -> {b1 / k:.1f} (+ {s / k:.2f} equal steps)")


if __name__ == "__main__":
    main()
