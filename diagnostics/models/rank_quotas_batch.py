"""Python model of the device planner's batched rank quotas (csrc/plan_quotas.cuh:
rank_quotas_order and the step in plan_group_kernel), checked against the
round-by-round greedy of moonep_ops.ops.plan rank_quotas with the kernel's packed-key tie rules
(donor: largest balance, ties -> lowest rank; receiver: smallest balance, ties -> lowest rank).

    python3 diagnostics/models/rank_quotas_batch.py        # ~20 s on one core
"""
import random


def kmax(bal, d):
    return (bal, -d)


def kmin(bal, d):
    return (bal, d)


def greedy(bal):
    """Round by round: (donor of each rank or -1, tokens it receives)."""
    R, bal = len(bal), list(bal)
    don, z = [-1] * R, [0] * R
    for _ in range(R - 1):
        h = max(range(R), key=lambda d: kmax(bal[d], d))
        u = min(range(R), key=lambda d: kmin(bal[d], d))
        if bal[h] <= 0 or bal[u] >= 0:
            break
        m = -bal[u]
        bal[h] -= m
        bal[u] += m
        don[u], z[u] = h, z[u] + m
    return don, z


def batched(bal, W=32, gate=True):
    """The kernel's steps (W = 32 lanes) and its policy; None when the gate keeps the rounds."""
    R, bal = len(bal), list(bal)
    surplus = [b for b in bal if b > 0]
    if not surplus or (gate and not (R > 16 and 2 * max(surplus) >= sum(surplus))):
        return None
    order = sorted((d for d in range(R) if bal[d] < 0), key=lambda d: kmin(bal[d], d))
    in_order = set(order)
    lkey = [kmin(bal[d], d) for d in order]
    pre = [0]                                    # deficits before each receiver of the order
    for d in order:
        pre.append(pre[-1] - bal[d])
    don, z = [-1] * R, [0] * R
    p, it, tryb, hprev = 0, 0, True, -1
    while it < R - 1:
        h = max(range(R), key=lambda d: kmax(bal[d], d))
        u = min(range(R), key=lambda d: kmin(bal[d], d))
        if bal[h] <= 0 or bal[u] >= 0:
            break
        head = p < len(order) and lkey[p] == kmin(bal[u], u)
        if tryb and head:
            kx2 = max(kmax(bal[d], d) for d in range(R) if d != h)
            ku = min((kmin(bal[d], d) for d in range(R) if d not in in_order and bal[d] < 0),
                     default=(float("inf"), 0))
            k = 0
            while k < W and p + k < len(order) and k < R - 1 - it:
                bh = bal[h] - (pre[p + k] - pre[p])      # the donor's balance before round k
                if not (bh > 0 and kmax(bh, h) > kx2 and lkey[p + k] < ku):
                    break
                k += 1
            assert k >= 1                                # round 0 is always the greedy's
            for d in order[p:p + k]:
                don[d], z[d], bal[d] = h, z[d] - bal[d], 0
            bal[h] -= pre[p + k] - pre[p]
            p, it, tryb, hprev = p + k, it + k, k > 1, h
            continue
        m = -bal[u]
        bal[h] -= m
        bal[u] += m
        don[u], z[u] = h, z[u] + m
        p += 1 if head else 0
        it, tryb, hprev = it + 1, h == hprev, h
    return don, z


def check(n=40000, seed=1):
    random.seed(seed)
    both = 0
    for _ in range(n):
        R = random.choice([2, 3, 5, 8, 16, 17, 31, 32, 33, 63, 64])
        mode = random.random()
        if mode < 0.3:
            g = [random.randint(0, 5) for _ in range(R)]
        elif mode < 0.6:
            g = [random.randint(90, 110) for _ in range(R)]
            g[random.randrange(R)] += random.randint(0, 400)
        else:
            g = [random.choice([0, 1, 50, 100, 100, 100, 200, 1000]) for _ in range(R)]
        T = sum(g)
        bal = [g[d] - (T // R + (1 if d < T % R else 0)) for d in range(R)]
        ref = greedy(bal)
        for gate in (False, True):
            got = batched(bal, W=random.choice([1, 2, 8, 32]), gate=gate)
            assert got is None or got == ref, bal
        both += any(ref[0][h] >= 0 for h in set(ref[0]) if h >= 0)
    print(f"ok: {n} cases equal to the greedy, {both} with a donor that also receives")


if __name__ == "__main__":
    check()
