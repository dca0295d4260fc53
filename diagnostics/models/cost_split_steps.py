"""Python model of policy cost's single-donor split with one-expert steps (csrc/plan_cost.cuh
cost_split_steps, called by cost_split_pair), checked against the round-by-round greedy of
planner.split_quotas_batched ("max") for one (candidate, donor) pair, with the kernel's tie
rules (largest quota, ties -> lowest rank; most tokens left, ties -> lowest local expert) and
its R - 1 + B round cap.  A pair's outputs are what the kernel keeps: quotas and tokens left,
pieces and tokens per receiver, pieces and tokens given.

The quotas come from the level plans (diagnostics/models/level_steps.py greedy, the same rules
as planner.level_quotas) of one_group / hot / zipf / uniform histograms at R up to 64 and
E/R up to 256, plus random quota sets as in split_steps.py.

    python3 diagnostics/models/cost_split_steps.py           # ~15 s on one core
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from level_steps import greedy as level_greedy  # noqa: E402


def ceil_log2(x):
    return 0 if x <= 1 else (x - 1).bit_length()


def _rounds(q, rem, nin, tin, no, to, first, R):
    """The greedy's rounds first .. R - 2 + B, in place on q, rem, nin, tin; -> (no, to)."""
    B = len(rem)
    for _ in range(first, R - 1 + B):
        if not q:
            break
        d = max(q, key=lambda d: (q[d], -d))
        le = max(range(B), key=lambda l: (rem[l], -l))
        if q[d] <= 0 or rem[le] <= 0:
            break
        t = min(q[d], rem[le])
        q[d] -= t
        rem[le] -= t
        nin[d] += 1
        tin[d] += t
        no += 1
        to += t
    return no, to


def greedy(q, rem, R):
    """cost_split_pair round by round: q {receiver: quota}, rem [tokens per local expert]."""
    q, rem = dict(q), list(rem)
    nin, tin = {d: 0 for d in q}, {d: 0 for d in q}
    no, to = _rounds(q, rem, nin, tin, 0, 0, 0, R)
    return q, rem, nin, tin, no, to


def one_expert_steps(st, R, B, W=32):
    """The one-expert steps of cost_split_pair on the state st (q, rem, nin, tin, no, to; updated
    in place); returns the greedy rounds they took."""
    q, rem, nin, tin = st["q"], st["rem"], st["nin"], st["tin"]
    ibR, ibB = ceil_log2(R), ceil_log2(B)
    MR, MB = (1 << ibR) - 1, (1 << ibB) - 1
    qk = lambda d: (q[d] << ibR) | (MR - d) if q[d] > 0 else 0     # noqa: E731
    ek = lambda l: (rem[l] << ibB) | (MB - l)                       # noqa: E731
    if sum(1 for d in q if q[d] > 0) < 8:
        return 0
    KQ = max(qk(d) for d in q)
    keys = sorted((ek(l) for l in range(B)), reverse=True)
    KR, KR2 = keys[0], (keys[1] if B > 1 else 0)
    QM, RM = KQ >> ibR, KR >> ibB
    if QM == 0 or RM <= QM or (((RM - QM) << ibB) | (KR & MB)) <= KR2:
        return 0
    order = sorted((d for d in q if q[d] > 0), key=qk, reverse=True)
    sq = [qk(d) for d in order]
    nq, p, rounds = len(order), 0, 0
    while p < nq:
        keys = sorted((ek(l) for l in range(B)), reverse=True)
        KR, KR2 = keys[0], (keys[1] if B > 1 else 0)
        c = KR >> ibB
        if c == 0:
            break
        lanes = [sq[p + i] if p + i < nq else 0 for i in range(W)]
        qv = [k >> ibR for k in lanes]
        P = [sum(qv[:i]) for i in range(W)]
        ok = [qv[i] > 0 and P[i] < c and ((((c - P[i]) << ibB) | (KR & MB)) > KR2)
              for i in range(W)]
        k = ok.index(False) if False in ok else W
        if k == 0:
            break
        partial = qv[k - 1] > c - P[k - 1]
        used = c if partial else P[k - 1] + qv[k - 1]
        for i in range(k):
            d = MR - (lanes[i] & MR)
            t = min(qv[i], c - P[i])
            q[d] -= t
            nin[d] += 1
            tin[d] += t
        rem[MB - (KR & MB)] -= used
        st["no"] += k
        st["to"] += used
        rounds += k
        p += k
        if k < W or partial:
            break
    return rounds


def kernel(q, rem, R, pk=True, W=32, b_gate=True, stats=None):
    """cost_split_pair as the kernel runs it: one-expert steps over packed keys (pk, B <= 64:
    the register path), then the greedy from the same state for the rounds left."""
    B = len(rem)
    st = {"q": dict(q), "rem": list(rem), "nin": {d: 0 for d in q}, "tin": {d: 0 for d in q},
          "no": 0, "to": 0}
    rounds = one_expert_steps(st, R, B, W) if pk and (B <= 64 or not b_gate) else 0
    if stats is not None:
        stats.append(rounds)
    no, to = _rounds(st["q"], st["rem"], st["nin"], st["tin"], st["no"], st["to"], rounds, R)
    return st["q"], st["rem"], st["nin"], st["tin"], no, to


def hist(rng, R, B, shape, sk):
    """[R][B] expert counts of a routing of R * sk token copies."""
    E, T = R * B, R * sk
    if shape == "one_group":
        w = [0.0] * E
        for e in range(B):
            w[e] = 1.0 + 0.05 * rng.random()
    elif shape == "hot":
        w = [1.0 + 0.2 * rng.random() for _ in range(E)]
        w[rng.randrange(E)] = E * rng.uniform(0.1, 0.6)
    elif shape == "zipf":
        a = rng.uniform(0.6, 1.4)
        w = [1.0 / (i + 1) ** a for i in range(E)]
        rng.shuffle(w)
    else:
        w = [rng.random() for _ in range(E)]
    s = sum(w)
    c = [int(x / s * T) for x in w]
    for _ in range(T - sum(c)):
        c[rng.randrange(E)] += 1
    return [c[r * B:(r + 1) * B] for r in range(R)], T


def pairs(rng):
    """(quotas, tokens, R) of the level plans' donors of one routing."""
    R = rng.choice([8, 16, 17, 32, 33, 63, 64, 64, 64])
    B = rng.choice([1, 2, 4, 4, 4, 8, 16, 32, 64, 64, 128, 256])
    shape = rng.choice(["one_group", "hot", "zipf", "uniform"])
    sk = rng.choice([64, 256, 512, 1024, 4096, 8192]) if R * B <= 4096 else rng.choice([64, 256])
    h, T = hist(rng, R, B, shape, sk)
    g = [sum(x) for x in h]
    even = -(-T // R)
    eps = rng.choice([0.02, 0.05, 0.1])
    U = -(-even * (1000000 + int(eps * 1e6)) // 1000000)
    hi = min(max(max(g), even), U)
    out = []
    for L in {even, hi, rng.randint(even, hi)}:
        dn, zz, ok, _ = level_greedy(g, L)
        if not ok:
            continue
        for d0 in set(x for x in dn if x >= 0):
            out.append(({d: zz[d] for d in range(R) if dn[d] == d0}, h[d0], R, shape))
    return out


def main():
    rng = random.Random(11)
    n = stepped = 0
    by, r64 = {}, {}
    while n < 20000:
        if rng.random() < 0.7:
            cases = pairs(rng)
        else:                                           # random quota sets (split_steps.py)
            R = rng.randint(2, 64)
            B = rng.randint(1, 64)
            nq = rng.randint(1, R - 1)
            rs = rng.sample(range(R), nq)
            if rng.random() < 0.5:
                rem = [rng.randint(30, 50) for _ in range(B)]
                rem[rng.randrange(B)] += rng.randint(100, 3000)
                q = {d: rng.randint(5, 60) for d in rs}
            else:
                rem = [rng.choice([0, 1, 5, 5, 10, 100]) for _ in range(B)]
                q = {d: rng.choice([0, 1, 5, 10, 50]) for d in rs}
            cases = [(q, rem, R, "random")]
        for q, rem, R, shape in cases:
            ref = greedy(q, rem, R)
            st = []
            for W, bg in ((32, True), (rng.choice([1, 2, 8]), False)):
                got = kernel(q, rem, R, W=W, b_gate=bg, stats=st)
                assert got == ref, (q, rem, R, W)
            if st[0] > 0:
                stepped += 1
            if R == 64 and len(rem) == 4 and shape != "random":
                a = r64.setdefault(shape, [0, 0, 0])    # pairs, greedy rounds, rounds left
                a[0] += 1
                a[1] += ref[4]
                a[2] += ref[4] - st[0]
            # did the steps take rounds?  (a whole-greedy case proves nothing)
            base = kernel(q, rem, R, pk=False)
            assert base == ref
            n += 1
            by[shape] = by.get(shape, 0) + 1
    print(f"ok: {n} pairs equal to the greedy ({by}); {stepped} of them took step rounds")
    for shape, (k, g, left) in sorted(r64.items()):
        print(f"  R = 64, B = 4, {shape}: {k} pairs, {g / k:.1f} greedy rounds a pair, "
              f"{left / k:.1f} left to the round loop")


if __name__ == "__main__":
    main()
