// The device planner's policy "cost" (plan_group.cuh, kCost instances only): the level plans'
// quotas during step 1, the critical donors' splits, the scores and the choice, between steps 1
// and 2.  Shared definitions: plan_internal.cuh; the one-expert steps' rule: plan_split.cuh.
#pragma once
#include "plan_internal.cuh"
#include "plan_split.cuh"

namespace moonep_ep::plan {

// ---------------------------------------------------------------------------------------------
// Policy "cost" (planner.cost_plan, bit-identical): candidates are MoonEP's plan (step 1's
// quotas, which this kernel computes anyway) and kCostLevels "level" plans; each is scored by
// max_r load_r + replica_cost * max_r max(out_links_r, in_links_r), and the first minimum
// (MoonEP first, then the levels in order) becomes the plan: its quotas replace step 1's
// (donor_of, z_of, the receiver masks, the donor list) and steps 2-4 run on them unchanged.
// That is exact because step 2 is split_quotas("max") and every level plan, like MoonEP's,
// refills each receiver from one donor (level_quotas retires a receiver after its round), which
// is all steps 2-4 assume.
//
// The score from the quotas, without the alloc.  Each receiver has one donor, so:
//   load: a feasible level plan leaves donors at exactly L and everyone else at <= L, so
//         max load = min(L, max group); MoonEP's plan leaves every rank at its cap, so
//         max load = ceil(T/R).
//   links: a rank's out-links are its own split's pieces P_h (a (expert, receiver) pair is
//         picked at most once: each round empties the quota or the expert), its in-links come
//         from its donor's split alone, so at most that P_h: max links = max_h P_h.  (In
//         MoonEP's plan a donor may also receive: its "max" rule refills a whole deficit.)
//   P_h = nrecv_h + X_h, X_h the rounds that empty an expert and leave the quota positive:
//         0 <= X_h <= B-1 (a donor never sends more than its tokens, so the round that empties
//         its last expert also ends its last quota).
// So only the *critical* donors, nrecv_h + B - 1 >= max_h' nrecv_h', can hold the largest P_h,
// and only their splits run (zipf at R = 64: 1 of ~15 donors a candidate).
//
// Code: the kCost instances of plan_group_kernel (NJ <= 2) only, so policy "moonep"'s kernels
// are compiled as without it.
//
// Parallelism.  Level quotas: every level depends only on the group loads, so all run during
// step 1 (warp 0's MoonEP quotas), before its barrier: one level per candidate warp in the
// 1024-thread block (cost_warp: 16 warps, 4 a scheduler), two in the 512-thread one (8 warps);
// each candidate warp then lists its level's critical donors, and warp 0 lists MoonEP's after its
// quotas.  Splits: every (candidate, critical donor) pair is independent, so
// all warps take them, interleaved by candidate.  Warp 0 scores the candidates and picks the
// winner.  Two block barriers beyond step 1's, and the critical path beyond step 1 is one
// single-donor split (up to R-1+B rounds of 2 warp reductions each, MoonEP's step 2's greedy
// rounds with only its one-expert steps, cost_split_steps, and whole fills of a run of equal
// largest quotas, cost_equal_steps).  Level quotas: up to R-1 rounds of 3 reductions, two
// levels deep; level_quotas_warp shortens them: a single donor's rounds that find no fit go 32
// at a time, and with several donors such a round costs one reduction level.  A pair's split
// only counts its pieces; the winner's alloc comes from step 2.
//
// Every value is a count bounded by T < 2^31 (host: R*S*K < 2^31), so int32 is exact where the
// torch code uses int64; scores are int64 (replica_cost < 2^40, links < 2^15).  Argmax / argmin
// take the lowest index on ties as torch.argmax / argmin do: one reduction of a packed
// (value, index) key when the values leave room for the index bits, else two (value, then the
// lowest index holding it).
// ---------------------------------------------------------------------------------------------

// Candidate warps of a block of nwarps: 16 of the 1024-thread block, 8 of the 512-thread one,
// each taking kCostLevels / cost_cwarps levels.
__host__ __device__ constexpr int cost_cwarps(int nwarps) { return nwarps >= 32 ? 16 : 8; }

// Candidate warp c (0..cost_cwarps-1) of a block of nwarps: the top cost_cwarps warps, counting
// down from the last, so each of the 4 schedulers (warp % 4) holds a quarter of them: with
// several donors (zipf at R = 64) the 16 level loops are issue-bound (warps off warp 0's
// scheduler instead: docs/planner.md, "Design notes").  -1: not a candidate warp.
__device__ __forceinline__ int cost_warp(int warp, int nwarps) {
  const int c = nwarps - 1 - warp;
  return c < cost_cwarps(nwarps) ? c : -1;
}

// Warp first argmax: v this lane's best value (<= 0: none), i its lowest index (<= 2^ib - 1).
// Returns the warp's max (<= 0: none, I meaningless), I its lowest index.
__device__ __forceinline__ int warp_first_max(int v, int i, bool pk, int ib, int& I) {
  if (pk) {
    const unsigned M = (1u << ib) - 1u;
    const unsigned k = v > 0 ? (static_cast<unsigned>(v) << ib) | (M - static_cast<unsigned>(i))
                             : 0u;
    const unsigned K = __reduce_max_sync(kFull, k);
    I = static_cast<int>(M - (K & M));
    return static_cast<int>(K >> ib);
  }
  const int V = __reduce_max_sync(kFull, v);
  I = __reduce_min_sync(kFull, v == V ? i : INT_MAX);
  return V;
}

// Warp first argmin: v this lane's smallest value (INT_MAX: none), i its lowest index.
__device__ __forceinline__ int warp_first_min(int v, int i, bool pk, int ib, int& I) {
  if (pk) {
    const unsigned k = v != INT_MAX ? (static_cast<unsigned>(v) << ib) | static_cast<unsigned>(i)
                                    : 0xffffffffu;
    const unsigned K = __reduce_min_sync(kFull, k);
    I = static_cast<int>(K & ((1u << ib) - 1u));
    return K == 0xffffffffu ? INT_MAX : static_cast<int>(K >> ib);
  }
  const int V = __reduce_min_sync(kFull, v);
  I = __reduce_min_sync(kFull, v == V ? i : INT_MAX);
  return V;
}

// planner.level_quotas for one level L on one warp (slot j of lane: rank d = lane + 32 j, g its
// group load).  Out: dn[j] the receiver's donor (-1: none), zz[j] its quota.  Returns feasible
// (every donor's excess placed).  Same rounds as the torch loop: R-1 at most, and the loop stops
// only at a fixed point (no excess left, or no free receiver: every later round moves 0).
template <int NJ>
__device__ __forceinline__ bool level_quotas_warp(const int* g, int L, int R, bool pk, int ibR,
                                                  int* dn, int* zz, unsigned* sq) {
  const int lane = threadIdx.x & 31;
  int ex[NJ], sp[NJ];
  bool fr[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const bool in = lane + 32 * j < R;
    ex[j] = in ? max(g[j] - L, 0) : 0;               // donors' excess
    sp[j] = in ? max(L - g[j], 0) : 0;               // receivers' spare (fixed; free changes)
    fr[j] = sp[j] > 0;
    dn[j] = -1;
    zz[j] = 0;
  }
  // Steps (packed keys, R >= 16): while a single donor is left, its rounds that find no fit
  // take the free receivers in one fixed order, largest spare first (ties: lowest rank), each
  // filled whole; round i of a step (lane i, sorted position p + i) is the greedy's while its
  // spare is below the donor's excess less the spares before it (no free spare covers it).  A
  // receiver retired by a round-by-round round leaves a hole (key 0) in the order, which the
  // steps skip.  Why: one donor refilling ~60 receivers (one_group, hot at R = 64) ran ~60
  // dependent rounds of 3 reductions; a step covers 32 of them with one scan and one ballot.
  // Python model (diagnostics/models/level_steps.py): equal to level_quotas.
  const bool steps = pk && R >= 16;
  const unsigned MR = (1u << ibR) - 1u;
  int pos[NJ];                                       // this slot's sorted position (-1: none)
  int nq = 0, ndon = 0, p = 0;                       // positions < p: all retired
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    pos[j] = -1;
    ndon += __popc(__ballot_sync(kFull, ex[j] > 0));
  }
  if (steps) {
    unsigned ky[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const unsigned d = static_cast<unsigned>(lane + 32 * j);
      ky[j] = fr[j] ? (static_cast<unsigned>(sp[j]) << ibR) | (MR - d) : 0u;   // sp < 2^(31-ibR)
    }
    int rk[NJ];                                      // rank = free receivers with a larger key
    warp_key_ranks<NJ, true>(ky, rk);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      if (fr[j]) { pos[j] = rk[j]; sq[rk[j]] = ky[j]; }
      nq += __popc(__ballot_sync(kFull, fr[j]));
    }
  }
  for (int it = 0; it < R - 1; ++it) {
    // The window of the sorted order at p (keys; 0: retired or past the end), read before the
    // excess reduction so that both are in flight.
    unsigned kk = 0u;
    if (steps) {
      __syncwarp();                                  // the holes written by earlier rounds
      kk = p + lane < nq ? sq[p + lane] : 0u;
    }
    int hv = 0, hi = 0;                              // most excess, ties: lowest rank
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (ex[j] > hv) { hv = ex[j]; hi = lane + 32 * j; }
    int H;
    int EH = warp_first_max(hv, hi, pk, ibR, H);
    if (EH <= 0) break;
    bool fast = false;                               // a round that finds no fit, from kk
    int u = 0, m = 0;
    if (steps && ndon == 1 && p < nq) {
      const unsigned v = kk >> ibR;                  // 0: a hole (or past the end)
      unsigned P = v;                                // spares of the positions before this one
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned n = __shfl_up_sync(kFull, P, o);
        if (lane >= o) P += n;
      }
      P -= v;
      const unsigned eh = static_cast<unsigned>(EH);
      const bool ok = p + lane < nq && (kk == 0u || (P < eh && v < eh - P));
      const unsigned bad = ~__ballot_sync(kFull, ok);
      const int f = bad != 0u ? __ffs(bad) - 1 : 32;
      if (f > 0) {
        const int used = static_cast<int>(__shfl_sync(kFull, P + v, f - 1));
        const unsigned taken = __ballot_sync(kFull, ok && kk != 0u) &
                               (f == 32 ? kFull : (1u << f) - 1u);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int d = lane + 32 * j;
          if (d == H) ex[j] -= used;
          if (fr[j] && pos[j] >= p && pos[j] < p + f) { fr[j] = false; dn[j] = H; zz[j] = sp[j]; }
        }
        it += __popc(taken);
        p += f;
        EH -= used;
        if (it >= R - 1) break;
        if (f == 32) { --it; continue; }             // the loop's ++it: not a round
      }
    } else if (steps) {
      // Several donors: the largest free spare is the window's first key (every position
      // before p is retired).  When it is below EH no spare fits, and the round needs no
      // further reduction: u is that receiver, m its spare.  Else (a fit, or a window of
      // holes only) the round below.  Why: ~35 of zipf's ~49 rounds a level at R = 64 find no
      // fit, and this takes their second level of warp reductions off the chain.
      const unsigned nz = __ballot_sync(kFull, kk != 0u);
      if (nz != 0u) {
        const int f0 = __ffs(nz) - 1;
        const unsigned kf = __shfl_sync(kFull, kk, f0);
        p += f0;                                     // the holes before it
        if (static_cast<int>(kf >> ibR) < EH) {
          fast = true;
          u = static_cast<int>(MR - (kf & MR));
          m = static_cast<int>(kf >> ibR);
          p += 1;                                    // u retires now
        }
      } else {
        p = min(p + 32, nq);                         // holes only
      }
    }
    bool fit = false;
    if (!fast) {
      // smallest free spare covering EH (ties: lowest), else the largest free spare (ties:
      // lowest)
      int fv = INT_MAX, fi = 0, lv = 0, li = 0;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        if (fr[j]) {
          if (sp[j] >= EH && sp[j] < fv) { fv = sp[j]; fi = lane + 32 * j; }
          if (sp[j] > lv) { lv = sp[j]; li = lane + 32 * j; }
        }
      }
      int FI, LI;
      const int FV = warp_first_min(fv, fi, pk, ibR, FI);
      const int LV = warp_first_max(lv, li, pk, ibR, LI);
      if (LV <= 0) break;                            // no free receiver: stuck (m = 0 from now)
      fit = FV != INT_MAX;
      u = fit ? FI : LI;
      m = min(EH, fit ? FV : LV);
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = lane + 32 * j;
      if (d == H) ex[j] -= m;
      if (d == u) {                                  // u retires (m > 0)
        fr[j] = false; dn[j] = H; zz[j] = m;
        if (steps) sq[pos[j]] = 0u;                  // a hole in the sorted order
      }
    }
    ndon -= fit ? 1 : 0;                             // a fit places all of H's excess
  }
  int left = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) left |= ex[j];
  __syncwarp();                                      // sq's last reads before the caller's stores
  return __reduce_or_sync(kFull, static_cast<unsigned>(left)) == 0u;
}

// (slot j of lane: receiver d = lane + 32 j, dn[j] its donor or -1).  cnt: the warp's scratch
// row (>= R ints).  Writes the list (ascending) and its length.
template <int NJ>
__device__ __forceinline__ void cost_critical(const int* dn, int R, int B, int* cnt, int* list,
                                              int* ncrit) {
  const int lane = threadIdx.x & 31;
  __syncwarp();                                      // cnt's last readers are done
  for (int i = lane; i < R; i += 32) cnt[i] = 0;
  __syncwarp();
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (lane + 32 * j < R && dn[j] >= 0) atomicAdd(&cnt[dn[j]], 1);
  __syncwarp();
  int c[NJ], mx = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    c[j] = lane + 32 * j < R ? cnt[lane + 32 * j] : 0;
    mx = max(mx, c[j]);
  }
  const int N = static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(mx)));
  const unsigned lt = (1u << lane) - 1u;
  int n = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const bool cr = c[j] > 0 && c[j] + B - 1 >= N;
    const unsigned bl = __ballot_sync(kFull, cr);
    if (cr) list[n + __popc(bl & lt)] = lane + 32 * j;
    n += __popc(bl);
  }
  if (lane == 0) *ncrit = n;
}

// Policy "cost"'s MoonEP candidate, on warp 0 after step 1 (valid histogram): its critical
// donors (don: this lane's donors, step 1's) and its max load (every rank at its cap, cap_hi at
// most).  Warp 0's scratch row is free until step 1's barrier.
template <int NJ>
__device__ __forceinline__ void cost_moonep_candidate(const CostSmem& cs, const int* don, int R,
                                                      int B, int cap_hi) {
  const int lane = threadIdx.x & 31;
  cost_critical<NJ>(don, R, B, cs.wrem, cs.crit + kCostMoonRow * R, cs.ncrit + kCostMoonRow);
  if (lane == 0) {
    cs.feas[kCostMoonRow] = 1;
    cs.mload[kCostMoonRow] = cap_hi;
  }
}

// The first rounds of a cost split pair in steps for one expert serving many quotas (packed
// keys, tokens left in registers: B <= 64), split_one_expert_steps's rule on the pair's counts.
// Why: at R = 64 a hot expert's single donor refills ~60 receivers, and every greedy round pairs
// the largest quota left with that expert (two warp reductions a round, on the critical
// path).  The quotas are taken largest key first (sorted once into sq), and
// round i of a step (lane i) is the greedy's while the expert's leftover before it is positive
// and its key still beats every other expert's (KR2); a step ends after a partial fill (the
// expert is then empty) or short of 32 rounds.  Gate: >= 8 receivers and the largest expert
// still beats the second after filling the largest quota (one_group, whose expert changes every
// round, never steps).  Returns the rounds taken; the caller's round loop goes on from the same
// state.  Python model (diagnostics/models/cost_split_steps.py): equal to the greedy on 20k
// (candidate, donor) pairs of one_group / hot / zipf / uniform level plans and random quotas.
template <int NJ>
__device__ __forceinline__ int cost_split_steps(int* q, int* nin, int* tin, int& r0, int& r1,
                                                int& no, int& to, int B, int ibR, int ibB,
                                                unsigned* sq) {
  const int lane = threadIdx.x & 31;
  const unsigned MR = (1u << ibR) - 1u, MB = (1u << ibB) - 1u;
  unsigned kq[NJ];
  int nq = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    kq[j] = q[j] > 0 ? (static_cast<unsigned>(q[j]) << ibR) |
                           (MR - static_cast<unsigned>(lane + 32 * j))
                     : 0u;
    nq += __popc(__ballot_sync(kFull, kq[j] != 0u));
  }
  if (nq < 8) return 0;                              // a few receivers: the sort would not pay
  auto ekeys = [&](unsigned& k0, unsigned& k1) {
    k0 = lane < B ? expert_key(r0, lane, ibB, MB) : 0u;
    k1 = lane + 32 < B ? expert_key(r1, lane + 32, ibB, MB) : 0u;
  };
  unsigned kr0, kr1;
  ekeys(kr0, kr1);
  if (!one_expert_steps_pay<NJ>(kq, kr0, kr1, ibR, ibB, MB)) return 0;
  int rk[NJ];                                        // rank of this slot's quota key (0: largest)
  warp_key_ranks<NJ, true>(kq, rk);
  __syncwarp();                                      // the last pair's reads of sq are done
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (kq[j] != 0u) sq[rk[j]] = kq[j];
  __syncwarp();
  int rounds = 0;
  for (int p = 0; p < nq;) {
    OneExpertStep st;
    if (!one_expert_step(st, kr0, kr1, sq, p, nq, ibR, ibB, MB)) break;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {                   // the quotas' owners take their rounds
      const unsigned Pj = __shfl_sync(kFull, st.P, (rk[j] - p) & 31);
      if (kq[j] != 0u && rk[j] >= p && rk[j] < p + st.k) {
        const int t = static_cast<int>(min(kq[j] >> ibR, st.c - Pj));
        kq[j] -= static_cast<unsigned>(t) << ibR;
        q[j] -= t;
        ++nin[j];
        tin[j] += t;
      }
    }
    if (kr0 == st.KR) r0 -= static_cast<int>(st.used);
    if (kr1 == st.KR) r1 -= static_cast<int>(st.used);
    ekeys(kr0, kr1);
    no += st.k;
    to += static_cast<int>(st.used);
    rounds += st.k;
    p += st.k;
    if (st.k < 32 || st.partial) break;
  }
  __syncwarp();                                      // sq's reads before the next pair's stores
  return rounds;
}

// Equal-quota steps of a cost split pair (tokens left in registers: B <= 64), after its
// one-expert steps.  Why: one_group's level plans at R = 64 give 62 of 63 receivers the same
// quota L, and the single donor's 4 similar experts take turns (the one-expert steps never
// start), so the pair was ~62 dependent greedy rounds, twice on the critical path.  While the m
// largest quotas all equal Q and the expert picked holds >= Q, a greedy round fills one of them
// whole (lowest rank first), and the experts picked are the merge, by value (ties -> lowest
// expert), of the sequences r_e - k Q.  With r_e = a_e Q + b_e (0 <= b_e < Q), element r_e - k Q
// has level a_e - k, and the order is level first, then b descending, then expert ascending.
// n = min(m, sum_e a_e, rounds left) whole fills take from expert e
//   k_e = max(0, a_e - J) + [e among the first n - S(J + 1) experts of level J, by (b desc, e)]
// with S(j) = sum_e max(0, a_e - j + 1) and J the largest j with S(j) >= n: a binary search over
// [max(1, A - n + 1), A] (A = max a_e, which alone supplies n elements from A - n + 1 on, so
// every term is <= n: no overflow), one warp sum a probe.  The step repeats while the next
// largest quotas form a run of >= kCostEqualMin and the last one used the whole run; the
// caller's round loop finishes (partial fills, unequal quotas) from the same state.  Only the
// counts change (pieces and tokens per receiver and given), as the pair keeps no alloc.
// Returns the rounds taken.  Python model (diagnostics/models/equal_quota_steps.py): equal to
// the greedy on 24k (candidate, donor) pairs of one_group / hot / zipf / uniform level plans and
// random quotas with runs of equal values.
constexpr int kCostEqualMin = 4;
template <int NJ>
__device__ __forceinline__ int cost_equal_steps(int* q, int* nin, int* tin, int& r0, int& r1,
                                                int& no, int& to, int B, int R, int it0) {
  const int lane = threadIdx.x & 31;
  const int cap = R - 1 + B;
  int it = it0;
#pragma unroll 1
  while (it < cap) {
    int qm = 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) qm = max(qm, q[j]);
    const int QM = static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(qm)));
    if (QM <= 0) break;
    int m = 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) m += __popc(__ballot_sync(kFull, q[j] == QM));
    if (m < kCostEqualMin) break;
    // r0 / r1 are 0 on lanes past B: a = 0, never in a level >= 1.
    const int a0 = r0 / QM, a1 = r1 / QM;
    const int nsat = static_cast<int>(
        __reduce_add_sync(kFull, static_cast<unsigned>(min(a0, m) + min(a1, m))));
    const int n = min(min(m, nsat), cap - it);
    if (n <= 0) break;
    const int A = static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(max(a0, a1))));
    auto S = [&](int j) {                            // elements of level >= j (j >= A - n + 1)
      return static_cast<int>(__reduce_add_sync(
          kFull, static_cast<unsigned>(max(0, a0 - j + 1) + max(0, a1 - j + 1))));
    };
    int lo = max(1, A - n + 1), hi = A;              // S(lo) >= n
#pragma unroll 1
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (S(mid) >= n) lo = mid; else hi = mid - 1;
    }
    const int J = lo, need = n - S(J + 1);           // 1 <= need <= experts of level J
    // Rank of this lane's experts in level J by (b desc, expert asc); -1: not in the level.
    const int key0 = a0 >= J ? r0 - a0 * QM : -1, key1 = a1 >= J ? r1 - a1 * QM : -1;
    int rk0 = 0, rk1 = 0;
    const int B0 = min(B, 32);
#pragma unroll 1
    for (int l = 0; l < B0; ++l) {                   // experts 0..31
      const int v = __shfl_sync(kFull, key0, l);
      rk0 += (v > key0 || (v == key0 && l < lane)) ? 1 : 0;
      rk1 += v >= key1 ? 1 : 0;
    }
#pragma unroll 1
    for (int l = 0; l < B - 32; ++l) {               // experts 32..63
      const int v = __shfl_sync(kFull, key1, l);
      rk0 += v > key0 ? 1 : 0;
      rk1 += (v > key1 || (v == key1 && l < lane)) ? 1 : 0;
    }
    r0 -= (max(0, a0 - J) + (key0 >= 0 && rk0 < need ? 1 : 0)) * QM;
    r1 -= (max(0, a1 - J) + (key1 >= 0 && rk1 < need ? 1 : 0)) * QM;
    const unsigned below = (1u << lane) - 1u;
    int before = 0;                                  // run members of lower rank (d = lane + 32 j)
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const unsigned run = __ballot_sync(kFull, q[j] == QM);
      if (q[j] == QM && before + __popc(run & below) < n) {
        q[j] = 0;
        ++nin[j];
        tin[j] += QM;
      }
      before += __popc(run);
    }
    no += n;
    to += n * QM;
    it += n;
    if (n < m) break;                                // an expert fell below QM: partial fills
  }
  return it - it0;
}

// One (candidate, donor h) pair of planner.split_quotas_batched ("max") on one warp: the donor's
// greedy (rounds of first argmax quota, first argmax tokens left, t = min of both), counting
// its pieces (alloc entries > 0 off home: one a round) instead of storing the alloc.  dnr / zzr:
// the candidate's donor and quota per receiver.  Returns the pieces (0 when h gives nothing);
// the per-receiver counts the steps keep (nin, tin) are dead here and compiled away.
template <int NJ>
__device__ __forceinline__ int cost_split_pair(const int* dnr, const int* zzr, int h, int R,
                                               int B, const int* remE, int* wrem, bool pk,
                                               int ibR, int ibB) {
  const int lane = threadIdx.x & 31;
  int q[NJ], nin[NJ], tin[NJ];
  bool mine[NJ];
  unsigned any = 0u;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int d = lane + 32 * j;
    mine[j] = d < R && dnr[d] == h;
    q[j] = mine[j] ? zzr[d] : 0;
    nin[j] = 0;
    tin[j] = 0;
    any |= __ballot_sync(kFull, q[j] > 0);
  }
  if (any == 0u) return 0;                           // not a donor of this candidate
  int no = 0, to = 0;
  // One round: first argmax quota (D), first argmax tokens left (LE, from this lane's best rv at
  // ri), t = min of both, returned (0: no quota or no token left, nothing moves again; torch:
  // t = min(rem, q) if q > 0 else 0).  A (le, d) pair is chosen at most once.
  auto round = [&](int rv, int ri, int& LE) {
    int qv = 0, qi = 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (q[j] > qv) { qv = q[j]; qi = lane + 32 * j; }
    int D;
    const int QM = warp_first_max(qv, qi, pk, ibR, D);
    const int RM = warp_first_max(rv, ri, pk, ibB, LE);
    if (QM <= 0 || RM <= 0) return 0;
    const int t = min(QM, RM);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (lane + 32 * j == D) { q[j] -= t; ++nin[j]; tin[j] += t; }
    ++no;
    to += t;
    return t;
  };
  if (B <= 64) {
    // Tokens left in registers, experts lane and lane + 32 (no shared round trip per round).
    int r0 = lane < B ? remE[h * B + lane] : 0, r1 = lane + 32 < B ? remE[h * B + lane + 32] : 0;
    // wrem (max(B, R) ints a warp, unused by this path): the steps' sorted quota keys
    int it0 =
        pk ? cost_split_steps<NJ>(q, nin, tin, r0, r1, no, to, B, ibR, ibB,
                                  reinterpret_cast<unsigned*>(wrem))
           : 0;
    // then whole fills of a run of equal largest quotas (one_group)
    if (pk) it0 += cost_equal_steps<NJ>(q, nin, tin, r0, r1, no, to, B, R, it0);
    for (int it = it0; it < R - 1 + B; ++it) {
      const int rv = r1 > r0 ? r1 : r0, ri = r1 > r0 ? lane + 32 : lane;   // ties: lower le
      int LE;
      const int t = round(rv, ri, LE);
      if (t == 0) break;
      if (LE == lane) r0 -= t;
      if (LE == lane + 32) r1 -= t;
    }
  } else {
    __syncwarp();                                    // the last pair's reads of wrem are done
    for (int le = lane; le < B; le += 32) wrem[le] = remE[h * B + le];
    __syncwarp();
    for (int it = 0; it < R - 1 + B; ++it) {
      int rv = 0, ri = 0;
      for (int le = lane; le < B; le += 32) {
        const int x = wrem[le];
        if (x > rv) { rv = x; ri = le; }
      }
      int LE;
      const int t = round(rv, ri, LE);
      if (t == 0) break;
      __syncwarp();                                  // every lane has read wrem this round
      if (lane == (LE & 31)) wrem[LE] -= t;
      __syncwarp();
    }
  }
  return no;
}

// Every (candidate, critical donor) pair over all warps, interleaved by candidate (p = i * rows
// + row) so that the candidates' splits of one donor (one_group: rank 0 in every row) run on
// different warps.  Lane 0 stores each pair's pieces.
template <int NJ>
__device__ __forceinline__ void cost_split_all(const CostSmem& cs, const int* donor_of,
                                               const int* z_of, int R, int B, const int* remE,
                                               bool pk, int ibR, int ibB) {
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, lane = threadIdx.x & 31;
  int* wrem = cs.wrem + warp * max(B, R);           // B tokens left, or R sorted quota keys
  int cmax = 0;
  for (int r = 0; r < kCostRows; ++r) cmax = max(cmax, cs.feas[r] ? cs.ncrit[r] : 0);
  for (int p = warp; p < kCostRows * cmax; p += nwarps) {
    const int i = p / kCostRows, row = p - i * kCostRows;
    if (!cs.feas[row] || i >= cs.ncrit[row]) continue;   // infeasible: scored kInfeasible
    const int* dnr = row == kCostMoonRow ? donor_of : cs.qrow + row * 2 * R;
    const int* zzr = row == kCostMoonRow ? z_of : cs.qrow + row * 2 * R + R;
    const int np = cost_split_pair<NJ>(dnr, zzr, cs.crit[row * R + i], R, B, remE, wrem, pk,
                                       ibR, ibB);
    if (lane == 0) cs.pieces[row * R + i] = np;
  }
}

// Group loads of the ranks of this lane's slots (from the column sums cnt = remE).
template <int NJ>
__device__ __forceinline__ void cost_groups(const int* remE, int R, int B, int* g) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int d = lane + 32 * j;
    int x = 0;
    if (d < R) {
      const int* p = remE + d * B;
      for (int b = 0; b < B; ++b) x += p[b];
    }
    g[j] = x;
  }
}

// Policy "cost"'s level quotas on candidate warp cwarp of ncw (before step 1's barrier): its
// levels cwarp, cwarp + ncw, ... of the kCostLevels evenly over [ceil(T/R), hi], each one's
// quotas into its row, its feasibility, max load and critical donors.
template <int NJ>
__device__ __forceinline__ void cost_levels(CostSmem cs, const int* remE, int R, int B, int T1,
                                            int cwarp, int ncw, int slack_ppm, bool packing) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int cib = max(ceil_log2(R), ceil_log2(B));
  int g[NJ], dn[NJ], zz[NJ];
  cost_groups<NJ>(remE, R, B, g);
  int mg = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) mg = max(mg, g[j]);
  mg = static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(mg)));
  const long long even = (static_cast<long long>(T1) + R - 1) / R;
  const long long limit = slack_cap(even, slack_ppm);
  const long long hi = min(max(static_cast<long long>(mg), even), limit);   // clamp(even, U)
  // packed keys when the values (<= T) leave room for the index bits; diagnostics stop 199
  // forces the two-reduction path (packing false), as in the other greedy loops
  const bool pk = packing && T1 >= 0 && static_cast<long long>(T1) < (1ll << (31 - cib));
  int* scratch = cs.wrem + warp * max(B, R);        // this warp's alone until the barrier
  for (int c = cwarp; c < kCostLevels; c += ncw) {
    const int L = static_cast<int>(even + ((hi - even) * c + (kCostLevels - 2)) /
                                              (kCostLevels - 1));
    const bool ok = level_quotas_warp<NJ>(g, L, R, pk, ceil_log2(R), dn, zz,
                                          reinterpret_cast<unsigned*>(scratch));
    int* row = cs.qrow + c * 2 * R;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = lane + 32 * j;
      if (d < R) { row[d] = dn[j]; row[R + d] = zz[j]; }
    }
    cost_critical<NJ>(dn, R, B, scratch, cs.crit + c * R, cs.ncrit + c);
    if (lane == 0) {
      cs.feas[c] = ok ? 1 : 0;
      cs.mload[c] = min(L, mg);                      // donors at L, the rest at <= L
    }
  }
}

// Policy "cost" after step 1's barrier, on every thread of block 0 (valid histogram): the
// critical splits and the choice (see the section comment).  Rewrites donor_of, z_of, rmask,
// donors and misc[1] when a level plan wins.
template <int NJ>
__device__ __forceinline__ void cost_search(const GroupArgs& a, CostSmem cs, const int* remE,
                                            int* donor_of, int* z_of, unsigned* rmask,
                                            int* donors, int* misc, int R, int B, int T,
                                            long long rc, bool packing) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int RW = (R + 31) / 32;
  const int cib = max(ceil_log2(R), ceil_log2(B));
  const bool pk = packing && T >= 0 && static_cast<long long>(T) < (1ll << (31 - cib));
  const int ibR = ceil_log2(R), ibB = ceil_log2(B);
  cost_split_all<NJ>(cs, donor_of, z_of, R, B, remE, pk, ibR, ibB);
  wstamp<NJ>(a, 5);
  __syncthreads();
  if (warp == 0) {
    // Lane k scores candidate k (0 MoonEP, 1 + c level c): planner.plan_scores from the max
    // load and the critical donors' pieces; then the first minimum over the lanes.
    long long sc = LLONG_MAX;
    int best = lane;
    if (lane < kCostRows) {
      const int row = lane == 0 ? kCostMoonRow : lane - 1;
      int mp = 0;
      if (cs.feas[row]) {
        for (int i = 0; i < cs.ncrit[row]; ++i) mp = max(mp, cs.pieces[row * R + i]);
        sc = static_cast<long long>(cs.mload[row]) + rc * static_cast<long long>(mp);
      } else {
        sc = kInfeasible;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const long long os = __shfl_xor_sync(kFull, sc, o);
      const int ob = __shfl_xor_sync(kFull, best, o);
      if (os < sc || (os == sc && ob < best)) { sc = os; best = ob; }
    }
    if (best > 0) {                                  // a level plan: its quotas replace step 1's
      const int* row = cs.qrow + (best - 1) * 2 * R;
      for (int i = lane; i < R * RW; i += 32) rmask[i] = 0u;
      __syncwarp();
      unsigned lo = 0u, hi = 0u;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int d = lane + 32 * j;
        if (d < R) {
          const int h = row[d];
          donor_of[d] = h;
          z_of[d] = h >= 0 ? row[R + d] : 0;
          if (h >= 0) {
            atomicOr(&rmask[h * RW + (d >> 5)], 1u << (d & 31));
            if (h < 32) lo |= 1u << h; else hi |= 1u << (h - 32);
          }
        }
      }
      lo = __reduce_or_sync(kFull, lo);
      hi = __reduce_or_sync(kFull, hi);
      const unsigned lt = (1u << lane) - 1u;
      int nd = 0;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {             // the donor list, ascending (as step 1's)
        const int d = lane + 32 * j;
        const bool isd = d < R && (((j == 0 ? lo : hi) >> lane) & 1u);
        const unsigned bl = __ballot_sync(kFull, isd);
        if (isd) donors[nd + __popc(bl & lt)] = d;
        nd += __popc(bl);
      }
      if (lane == 0) misc[1] = nd;
    }
  }
  wstamp<NJ>(a, 6);
  __syncthreads();
}

}  // namespace moonep_ep::plan
