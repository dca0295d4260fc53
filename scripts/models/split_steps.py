"""Python model of csrc/plan_kernels.cu split_one_expert_steps (WIP branch, session 8) against the
per-donor split greedy with packed keys: random cases with ties, several step widths W.

    python3 scripts/models/split_steps.py
"""
import random
def qkey(q, d): return (q, -d)       # largest quota first, ties -> lowest d
def ekey(c, le): return (c, -le)     # most tokens first, ties -> lowest le
def greedy(q, rem):
    q = dict(q); rem = list(rem); recv = {}; pc = [0]*len(rem)
    for _ in range(len(q) + len(rem) + 1):
        d = max(q, key=lambda d: qkey(q[d], d)); le = max(range(len(rem)), key=lambda l: ekey(rem[l], l))
        if q[d] == 0 or rem[le] == 0: break
        t = min(q[d], rem[le]); q[d] -= t; rem[le] -= t; pc[le] += 1
        assert (d, le) not in recv; recv[(d, le)] = t
    return q, rem, recv, pc
def stepped2(q, rem, W=32):
    """Steps while each one serves W full rounds from one expert; then the plain greedy."""
    q = dict(q); rem = list(rem); recv = {}; pc = [0]*len(rem); nsteps = 0
    le = max(range(len(rem)), key=lambda l: ekey(rem[l], l))
    others = [ekey(rem[l], l) for l in range(len(rem)) if l != le]
    KR2 = max(others) if others else (-1, 0)
    dmax = max(q, key=lambda d: qkey(q[d], d))
    gate = q[dmax] > 0 and rem[le] > q[dmax] and ekey(rem[le] - q[dmax], le) > KR2
    if gate:
        order = sorted([d for d in q if q[d] > 0], key=lambda d: qkey(q[d], d), reverse=True)
        p = 0
        while p < len(order):
            le = max(range(len(rem)), key=lambda l: ekey(rem[l], l))
            others = [ekey(rem[l], l) for l in range(len(rem)) if l != le]
            KR2 = max(others) if others else (-1, 0)
            c = rem[le]
            if c == 0: break
            nsteps += 1
            k = 0; P = 0; partial = False
            for i in range(W):
                if p + i >= len(order): break
                d = order[p + i]; qi = q[d]; ci = c - P
                if ci <= 0 or not (ekey(ci, le) > KR2): break
                k += 1; P += min(qi, ci)
                if qi > ci: partial = True; break
            if k == 0: break
            for i in range(k):
                d = order[p + i]; t = min(q[d], c); q[d] -= t; c -= t; pc[le] += 1
                assert (d, le) not in recv; recv[(d, le)] = t
            rem[le] = c; p += k
            if k < W or partial: break   # short step: expert overtaken, partial fill, order done
    # plain greedy from this state
    for _ in range(len(q) + len(rem) + 1):
        d = max(q, key=lambda d: qkey(q[d], d)); le = max(range(len(rem)), key=lambda l: ekey(rem[l], l))
        if q[d] == 0 or rem[le] == 0: break
        t = min(q[d], rem[le]); q[d] -= t; rem[le] -= t; pc[le] += 1
        assert (d, le) not in recv; recv[(d, le)] = t
    return q, rem, recv, pc, nsteps
random.seed(4)
for trial in range(30000):
    nq = random.randint(1, 63); B = random.randint(1, 64)
    mode = random.random()
    if mode < 0.4:
        rem = [random.randint(0, 50) for _ in range(B)]; q = {d: random.randint(0, 40) for d in range(nq)}
    elif mode < 0.7:
        rem = [random.randint(30, 50) for _ in range(B)]; rem[random.randrange(B)] += random.randint(100, 3000)
        q = {d: random.randint(5, 60) for d in range(nq)}
    else:
        rem = [random.choice([0, 1, 5, 5, 10, 100]) for _ in range(B)]; q = {d: random.choice([0, 1, 5, 10, 50]) for d in range(nq)}
    a = greedy(q, rem); b = stepped2(q, rem, W=random.choice([1, 2, 8, 32]))
    assert a[:4] == b[:4], (q, rem)
print("ok")
