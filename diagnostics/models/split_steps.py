"""Python model of the device planner's split steps for one expert serving many quotas
(csrc/plan_split.cuh split_one_expert_steps), checked against the per-donor split greedy with
the kernel's packed-key tie rules (largest quota, ties -> lowest rank; most tokens left, ties ->
lowest local expert).

    python3 diagnostics/models/split_steps.py        # ~20 s on one core
"""
import random


def qkey(q, d):
    return (q, -d)


def ekey(c, le):
    return (c, -le)


def greedy(q, rem, q_rounds=None):
    """Round by round from (quota per receiver, tokens per expert): (quotas, tokens, moves
    {(d, le): t}, pieces per expert)."""
    q, rem = dict(q), list(rem)
    recv, pc = {}, [0] * len(rem)
    for _ in range(len(q) + len(rem) + 1):
        d = max(q, key=lambda d: qkey(q[d], d))
        le = max(range(len(rem)), key=lambda l: ekey(rem[l], l))
        if q[d] == 0 or rem[le] == 0:
            break
        t = min(q[d], rem[le])
        q[d] -= t
        rem[le] -= t
        pc[le] += 1
        assert (d, le) not in recv             # each round empties a quota or an expert
        recv[(d, le)] = t
    return q, rem, recv, pc


def stepped(q, rem, W=32):
    """The kernel: steps while the largest expert serves quotas in their sorted order (gate:
    >= 8 receivers and the expert still leads after the largest quota), then the greedy."""
    q, rem = dict(q), list(rem)
    recv, pc = {}, [0] * len(rem)

    def top():
        le = max(range(len(rem)), key=lambda l: ekey(rem[l], l))
        kr2 = max((ekey(rem[l], l) for l in range(len(rem)) if l != le), default=(-1, 0))
        return le, kr2

    le, kr2 = top()
    dmax = max(q, key=lambda d: qkey(q[d], d))
    if len(q) >= 8 and 0 < q[dmax] < rem[le] and ekey(rem[le] - q[dmax], le) > kr2:
        order = sorted(q, key=lambda d: qkey(q[d], d), reverse=True)
        p = 0
        while p < len(order):
            le, kr2 = top()
            c = rem[le]
            if c == 0:
                break
            k, used, partial = 0, 0, False
            while k < W and p + k < len(order):
                qi = q[order[p + k]]
                if qi == 0 or used >= c or not ekey(c - used, le) > kr2:
                    break
                partial = qi > c - used
                used += min(qi, c - used)
                k += 1
                if partial:
                    break
            if k == 0:
                break
            for d in order[p:p + k]:
                t = min(q[d], rem[le])
                q[d] -= t
                rem[le] -= t
                pc[le] += 1
                assert (d, le) not in recv
                recv[(d, le)] = t
            p += k
            if k < W or partial:
                break
    a = greedy(q, rem)
    recv.update(a[2])
    return a[0], a[1], recv, [x + y for x, y in zip(pc, a[3])]


def check(n=30000, seed=4):
    random.seed(seed)
    for _ in range(n):
        nq, B = random.randint(1, 63), random.randint(1, 64)
        mode = random.random()
        if mode < 0.4:
            rem = [random.randint(0, 50) for _ in range(B)]
            q = {d: random.randint(0, 40) for d in range(nq)}
        elif mode < 0.7:                        # one hot expert, many small quotas
            rem = [random.randint(30, 50) for _ in range(B)]
            rem[random.randrange(B)] += random.randint(100, 3000)
            q = {d: random.randint(5, 60) for d in range(nq)}
        else:
            rem = [random.choice([0, 1, 5, 5, 10, 100]) for _ in range(B)]
            q = {d: random.choice([0, 1, 5, 10, 50]) for d in range(nq)}
        assert stepped(q, rem, W=random.choice([1, 2, 8, 32])) == greedy(q, rem), (q, rem)
    print(f"ok: {n} cases equal to the greedy")


if __name__ == "__main__":
    check()
