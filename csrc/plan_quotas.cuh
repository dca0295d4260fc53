// The device planner's step 1 (plan_group.cuh): rank_quotas, the donor and quota of every rank
// in deficit, on warp 0 of the group kernel's block 0.  Shared definitions: plan_internal.cuh.
#pragma once
#include "plan_internal.cuh"

namespace moonep_ep::plan {

template <int NJ>
__device__ __forceinline__ void quota_keys(const unsigned* kb, int R, unsigned MR, unsigned* kx,
                                           unsigned* kn, unsigned& KX, unsigned& KN) {
  const int lane = threadIdx.x & 31;
  unsigned KXl = 0u, KNl = 0xffffffffu;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int d = lane + 32 * j;
    kx[j] = d < R ? (kb[j] | (MR - static_cast<unsigned>(d))) : 0u;
    kn[j] = d < R ? (kb[j] | static_cast<unsigned>(d)) : 0xffffffffu;
    KXl = max(KXl, kx[j]);
    KNl = min(KNl, kn[j]);
  }
  KX = __reduce_max_sync(kFull, KXl);
  KN = __reduce_min_sync(kFull, KNl);
}

// The round's transfer: donor h (key KX) refills the receiver of key KN with its deficit m.
template <int NJ>
__device__ __forceinline__ void quota_round(unsigned* kb, const unsigned* kx, const unsigned* kn,
                                            unsigned KX, unsigned KN, int h, int m, int ibR,
                                            int* don, int* z, unsigned& dmask, int& qerr) {
  const unsigned mm = static_cast<unsigned>(m) << ibR;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (kx[j] == KX) { kb[j] -= mm; dmask |= 1u << j; }
    if (kn[j] == KN) {
      if (don[j] >= 0 && don[j] != h) qerr |= MOONEP_ERR_PLAN;   // impossible
      don[j] = h;
      z[j] += m;
      kb[j] += mm;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Step 1 in batches (rank_quotas, packed keys, R <= 64).
//
// Why: the greedy's rounds are sequential (~190 cycles each, two warp reductions) and R = 64
// runs up to 63 of them (one hot rank refilling every other: 12k cycles).  A receiver's balance
// changes only when it is refilled (to 0), so the receivers are refilled in one fixed order:
// ascending min-key (balance, then rank).  Only a donor that overshoots into deficit enters
// later, outside that order; the batch test bounds the order by the smallest such deficit.
// Python model (diagnostics/models/rank_quotas_batch.py): equal to the round-by-round greedy on
// 40k cases, 23k of them with a donor that also receives (docs/planner.md).
//
// rank_quotas_order: the order (pos[j]: slot j's place, -1 if not in deficit), lkey[i] the
// i-th receiver's min-key, lpre[i] the deficits before it (lpre[nl] = all).  Returns nl.
// ---------------------------------------------------------------------------------------------

template <int NJ>
__device__ __forceinline__ int rank_quotas_order(const unsigned* kb, unsigned TT, int R, int ibR,
                                                 int* pos, unsigned* lkey, int* lpre) {
  const int lane = threadIdx.x & 31;
  unsigned ky[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int d = lane + 32 * j;
    ky[j] = d < R && kb[j] < (TT << ibR) ? (kb[j] | static_cast<unsigned>(d)) : 0xffffffffu;
  }
  int rk[NJ];                  // rank = deficits with a smaller key (keys of d >= R: ~0u, never)
  warp_key_ranks<NJ, false>(ky, rk);
  int nl = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const bool in = ky[j] != 0xffffffffu;
    pos[j] = in ? rk[j] : -1;
    if (in) {
      lkey[rk[j]] = ky[j];
      lpre[rk[j]] = static_cast<int>(TT - (kb[j] >> ibR));   // the deficit
    }
    nl += __popc(__ballot_sync(kFull, in));
  }
  __syncwarp();
  int carry = 0;                                     // exclusive prefix over the order
  for (int i0 = 0; i0 < nl; i0 += 32) {
    const int v = i0 + lane < nl ? lpre[i0 + lane] : 0;
    const int incl = warp_incl_scan(v, lane);
    if (i0 + lane < nl) lpre[i0 + lane] = carry + incl - v;
    carry += __shfl_sync(kFull, incl, 31);
  }
  if (lane == 0) lpre[nl] = carry;
  __syncwarp();
  return nl;
}

// ---------------------------------------------------------------------------------------------
// Step 1 on warp 0, no block barrier: the rows' validity (row sums == s_r * K, the total), the
// group loads and rank_quotas, <= R-1 rounds of (argmax, argmin) over the balances (warp
// reductions; ties -> lowest rank) with balances, donors and quotas in registers.  A receiver is
// refilled by a single donor, so z is kept as don[u], z[u] (slot j of a lane: rank lane + 32 j).
// Writes donor_of, z_of, the receiver masks, the donor list and misc[1] (donors), misc[3]
// (valid); returns the validity, with don (this lane's donors) and cap_hi (the largest cap).
// ---------------------------------------------------------------------------------------------

template <int NJ>
__device__ __forceinline__ bool rank_quotas_warp(const GroupArgs& a, const GroupSmem& sm,
                                                 int total0, bool one_word, bool shortcuts,
                                                 int* don, int& cap_hi) {
  const int lane = threadIdx.x & 31;
  const int R = a.R, E = a.E, B = a.B, RW = (R + 31) / 32;
  const int ibR = ceil_log2(R);
  const unsigned MR = (1u << ibR) - 1u;
  int* remE = sm.remE;
  int* beforeS = sm.beforeS;
  int* ownS = sm.ownS;
  const unsigned* rowlo = sm.rowlo;
  const unsigned* rowhi = sm.rowhi;
  unsigned* rmask = sm.rmask;
  const int* srow = sm.srow;
  int* misc = sm.misc;
  int* donor_of = sm.donor_of;
  int* z_of = sm.z_of;
  int* donors = sm.donors;
  int* rlist = sm.rlist;
  int* hpos = sm.hpos;
  int ev = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {                   // row sums == s_r * K
    const int d = lane + 32 * j;
    if (d < R) {
      const int sr = srow[d];
      if (sr >= 1 && sr <= a.S) {
        const unsigned long long rs = one_word ? rowlo[d]
            : (static_cast<unsigned long long>(rowhi[d]) << 16) + rowlo[d];
        if (rs != static_cast<unsigned long long>(sr) * static_cast<unsigned long long>(a.K))
          ev |= MOONEP_ERR_HIST;
      }
    }
  }
  if (lane == 0 && total0 != -1 && (total0 < 1 || misc[2] != total0)) ev |= MOONEP_ERR_HIST;
  ev = static_cast<int>(__reduce_or_sync(kFull, static_cast<unsigned>(ev))) | misc[0];
  const bool vq = ev == 0;
  const int T = group_copies(a, total0, vq);
  const int cap_base = T / R, cap_extra = T % R;
  if (!vq) {
    for (int i = lane; i < E; i += 32) { remE[i] = 0; beforeS[i] = 0; ownS[i] = 0; }
  }
  int z[NJ];
  unsigned dmask = 0u;                             // bit j: slot j donated in some round
  int qerr = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) { don[j] = -1; z[j] = 0; }
  int bal[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {                   // group[d] = sum of its experts' counts
    const int d = lane + 32 * j;
    int g = 0;
    if (vq && d < R) {
      const int* p = remE + d * B;
#pragma unroll 8
      for (int b = 0; b < B; ++b) g += p[b];
    }
    bal[j] = d < R ? g - (cap_base + (d < cap_extra ? 1 : 0)) : 0;
  }
  const bool packed = plan_stop(a) != 199 && 2ll * T < (1ll << (31 - ibR));
  // One rank with a surplus (one hot rank: one_group, hot): every round's donor is that rank
  // (the others' balances are <= 0 and its own stays >= 0, since the balances sum to 0), and
  // every rank in deficit is refilled by it with its whole deficit, so the R-1 rounds of two
  // warp reductions (~190 cycles each: ~1.3k cycles at R = 8, ~12k at R = 64) reduce to
  // ballots.  Diagnostics stops 198 / 199 (tests) keep the loops.
  int npos = 0, D = -1;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const unsigned bm = __ballot_sync(kFull, lane + 32 * j < R && bal[j] > 0);
    npos += __popc(bm);
    if (D < 0 && bm != 0u) D = 32 * j + __ffs(bm) - 1;
  }
  if (npos == 1 && shortcuts) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = lane + 32 * j;
      if (d < R && bal[j] < 0) { don[j] = D; z[j] = -bal[j]; }
      if (d == D) dmask |= 1u << j;
    }
  } else if (packed) {
    // State per slot: kb = (bal + T) << ibR; the keys add the index part.  The winning slot is
    // the one whose key equals the reduced key (keys are unique).
    const unsigned TT = static_cast<unsigned>(T);
    unsigned kb[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      kb[j] = lane + 32 * j < R ? static_cast<unsigned>(bal[j] + T) << ibR : 0u;
    // Batched rounds (rank_quotas_batch; 16 < R <= 64): the receivers' order is fixed, so
    // while the largest surplus stays the largest (and positive) it refills the next
    // receivers of that order, k rounds in one step.  R = 64 hot: 63 rounds -> a few steps.
    // Worth it when one surplus dominates (hot: 99 % of all surplus; zipf at R = 64: 43 %, where
    // the donor changes nearly every round and the order's set-up would not pay back).
    bool qbatch = vq && NJ <= 2 && R > 16 && plan_stop(a) != 197 && shortcuts;
    if (qbatch) {
      unsigned pm = 0u, ps = 0u;                   // largest surplus, all surplus (<= T)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if (lane + 32 * j < R && bal[j] > 0) {
          pm = max(pm, static_cast<unsigned>(bal[j]));
          ps += static_cast<unsigned>(bal[j]);
        }
      qbatch = 2ull * __reduce_max_sync(kFull, pm) >= __reduce_add_sync(kFull, ps);
    }
    if (qbatch) {
      int pos[NJ];
      unsigned* lkey = reinterpret_cast<unsigned*>(rlist);   // [R] scratch until step 2
      int* lpre = hpos;                                      // [nl + 1 <= R] scratch until step 2
      const int nl = rank_quotas_order<NJ>(kb, TT, R, ibR, pos, lkey, lpre);
      int p = 0;                                     // receivers [0, p) of the order are refilled
      // A step is tried at once, then again after a step of k > 1 or once a donor has won two
      // rounds in a row: where the donor changes every round, a step (two more reductions)
      // costs more than the round it replaces.
      bool tryb = true;
      int hprev = -1;
      for (int it = 0; it < R - 1;) {
        unsigned kx[NJ], kn[NJ], KX, KN, KUl = 0xffffffffu;
        quota_keys<NJ>(kb, R, MR, kx, kn, KX, KN);
#pragma unroll
        for (int j = 0; j < NJ; ++j)               // a deficit outside the order (an overshoot)
          if (lane + 32 * j < R && pos[j] < 0 && kb[j] < (TT << ibR)) KUl = min(KUl, kn[j]);
        const unsigned vx = KX >> ibR, vn = KN >> ibR;
        // torch: m = need if bal[h] > 0 else 0; once max <= 0 every later round is a no-op,
        // and with sum(bal) == 0 a positive max implies a negative min.
        if (vx <= TT || vn >= TT) break;             // MX <= 0 || MN >= 0
        const int h = static_cast<int>(MR - (KX & MR));
        const bool head = p < nl && lkey[p] == KN;   // the order's next receiver
        if (head && tryb) {
          // Round i of the step (lane i) refills receiver p + i of the order; it is the greedy's
          // round while, before it, the donor's balance is positive and above every other
          // rank's (KX2: the refilled receivers are at 0 < that balance) and the receiver's
          // key is below every deficit outside the order (KU).  Round 0 always is (k >= 1).
          unsigned KX2l = 0u;
#pragma unroll
          for (int j = 0; j < NJ; ++j) KX2l = max(KX2l, kx[j] == KX ? 0u : kx[j]);
          const unsigned KX2 = __reduce_max_sync(kFull, KX2l);
          const unsigned KU = __reduce_min_sync(kFull, KUl);
          const int idx = p + lane, base = lpre[p];
          bool ok = false;
          if (idx < nl && lane < R - 1 - it) {
            const int bh = static_cast<int>(vx - TT) - (lpre[idx] - base);
            ok = bh > 0 && (((static_cast<unsigned>(bh) + TT) << ibR) | (MR - h)) > KX2 &&
                 lkey[idx] < KU;
          }
          const unsigned bad = ~__ballot_sync(kFull, ok);
          const int k = bad != 0u ? __ffs(bad) - 1 : 32;
          const int moved = lpre[p + k] - base;
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            if (kx[j] == KX) { kb[j] -= static_cast<unsigned>(moved) << ibR; dmask |= 1u << j; }
            if (pos[j] >= p && pos[j] < p + k) {
              if (don[j] >= 0 && don[j] != h) qerr |= MOONEP_ERR_PLAN;   // impossible
              don[j] = h;
              z[j] += static_cast<int>(TT - (kb[j] >> ibR));
              kb[j] = TT << ibR;
            }
          }
          p += k;
          it += k;
          tryb = k > 1;
          hprev = h;
          continue;
        }
        quota_round<NJ>(kb, kx, kn, KX, KN, h, static_cast<int>(TT - vn), ibR, don, z, dmask,
                        qerr);
        if (head) ++p;
        tryb = h == hprev;
        hprev = h;
        ++it;
      }
    } else {
      for (int it = 0; it < R - 1; ++it) {
        unsigned kx[NJ], kn[NJ], KX, KN;
        quota_keys<NJ>(kb, R, MR, kx, kn, KX, KN);
        const unsigned vx = KX >> ibR, vn = KN >> ibR;
        if (vx <= TT || vn >= TT) break;             // as above
        quota_round<NJ>(kb, kx, kn, KX, KN, static_cast<int>(MR - (KX & MR)),
                        static_cast<int>(TT - vn), ibR, don, z, dmask, qerr);
      }
    }
  } else {
    for (int it = 0; it < R - 1; ++it) {
      int mxv = INT_MIN, mxi = INT_MAX, mnv = INT_MAX, mni = INT_MAX;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int d = lane + 32 * j;
        if (d < R) {
          if (bal[j] > mxv) { mxv = bal[j]; mxi = d; }
          if (bal[j] < mnv) { mnv = bal[j]; mni = d; }
        }
      }
      const int MX = __reduce_max_sync(kFull, mxv);
      const int MN = __reduce_min_sync(kFull, mnv);
      if (MX <= 0 || MN >= 0) break;
      const int h = __reduce_min_sync(kFull, mxv == MX ? mxi : INT_MAX);   // first argmax
      const int u = __reduce_min_sync(kFull, mnv == MN ? mni : INT_MAX);   // first argmin
      const int m = -MN;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int d = lane + 32 * j;
        if (d == h) { bal[j] -= m; dmask |= 1u << j; }
        if (d == u) {
          bal[j] += m;
          if (don[j] >= 0 && don[j] != h) qerr |= MOONEP_ERR_PLAN;   // impossible
          don[j] = h;
          z[j] += m;
        }
      }
    }
  }
  // Outputs of step 1: donor_of, z_of, the receiver masks, the donor list (ascending).
  const unsigned lt = (1u << lane) - 1u;
  int nd = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int d = lane + 32 * j;
    if (d < R) {
      donor_of[d] = don[j];
      z_of[d] = z[j];
      if (don[j] >= 0) atomicOr(&rmask[don[j] * RW + (d >> 5)], 1u << (d & 31));
    }
    const bool isd = (dmask >> j) & 1u;
    const unsigned bl = __ballot_sync(kFull, isd);
    if (isd) donors[nd + __popc(bl & lt)] = d;
    nd += __popc(bl);
  }
  qerr = static_cast<int>(__reduce_or_sync(kFull, static_cast<unsigned>(qerr)));
  if (lane == 0) {
    if (ev | qerr) atomicOr(a.err, ev | qerr);
    misc[1] = nd;
    misc[3] = vq ? 1 : 0;
  }
  cap_hi = cap_base + (cap_extra > 0 ? 1 : 0);
  return vq;
}

}  // namespace moonep_ep::plan
