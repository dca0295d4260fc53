// The device planner's step 2 (plan_group.cuh): split_quotas, each donor's quotas split into
// chunks of its experts, one warp per donor.  Shared definitions: plan_internal.cuh.
#pragma once
#include "plan_internal.cuh"

namespace moonep_ep::plan {

// ---------------------------------------------------------------------------------------------
// Step 2 in batches (a donor with <= 8 receivers, <= 64 experts, packed keys, R <= 24: a
// sorting warp per rank outside warp 0's scheduler).
//
// Why: the greedy's rounds are sequential (~180 cycles each, two warp reductions), and a donor
// refilling 7 ranks runs ~40 of them (one_group).  The greedy takes the donor's untouched
// experts in one fixed order (most tokens first; their keys are sorted once, during step 1, by
// warps idle then), so consecutive rounds i = 0, 1, ... pair the i-th largest quota with the
// i-th next expert of that order for as long as (a) each quota beats every quota the batch has
// already reduced and (b) no partly used expert has more left than the round's expert (keys are
// unique, so both comparisons are exact).  One batch checks that for <= 8 rounds at once: the
// batch length k is the first round whose quota is below the largest reduced quota, whose
// expert is below the largest leftover, or whose quota or expert is zero.  When a leftover is
// the largest expert, the packed loop takes over from the same state.  R = 8 one_group: 42
// rounds -> 6 batches.  Every choice is the greedy's, so the plan is bit-identical (tests;
// diagnostics stop 198 forces the round-by-round loop; docs/planner.md).
// ---------------------------------------------------------------------------------------------

// An expert's packed key: tokens left, then the lower local index first (MB - le).  The batched
// split reads the sorted keys against the packed loop's, so both must come from here.
__device__ __forceinline__ unsigned expert_key(int rem_le, int le, int ibB, unsigned MB) {
  return (static_cast<unsigned>(rem_le) << ibB) | (MB - static_cast<unsigned>(le));
}

// keys[j] = expert_key(rem[j], j), j < B, sorted descending into sk[0, B): rank by counting.
__device__ __forceinline__ void sort_expert_keys(const int* rem, int B, int ibB, unsigned MB,
                                                 unsigned* sk) {
  const int lane = threadIdx.x & 31;
  const unsigned k0 = lane < B ? expert_key(rem[lane], lane, ibB, MB) : 0u;
  const unsigned k1 = lane + 32 < B ? expert_key(rem[lane + 32], lane + 32, ibB, MB) : 0u;
  int r0 = 0, r1 = 0;
#pragma unroll 8
  for (int j = 0; j < B; ++j) {                      // broadcast reads
    const unsigned kj = expert_key(rem[j], j, ibB, MB);
    r0 += kj > k0 ? 1 : 0;
    r1 += kj > k1 ? 1 : 0;
  }
  if (lane < B) sk[r0] = k0;
  if (lane + 32 < B) sk[r1] = k1;
}

// Donor h's batches.  kq: this lane's quota key (lane = receiver d; 0 if not h's), act: h's
// receivers (<= 8), sk: h's expert keys sorted descending.  Updates kq, and for every expert it
// takes: rem (tokens left), pcnt (1 piece) and recv.  Returns true when every quota is filled
// (the split of h is complete), else with the packed loop's state.
// Lanes 0..7 hold the quota keys in any order with their rank r (0 = largest); round r of a
// batch is the lane of rank r, so nothing is permuted.
__device__ __forceinline__ bool split_batches(unsigned& kq, unsigned act, const unsigned* sk,
                                              int* rem, int* pcnt_h, int* recv, int B, int ibR,
                                              int ibB, unsigned MR, unsigned MB) {
  const int lane = threadIdx.x & 31;
  // Lanes 0..7 take the receivers' keys (already there when R <= 8); the others hold 0, below
  // every live key.
  const bool moved = (act >> 8) != 0u;
  unsigned Q = lane < 8 ? kq : 0u;
  if (moved) {
    unsigned mm = act;
    Q = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned v = __shfl_sync(kFull, kq, mm ? __ffs(mm) - 1 : 0);
      if (lane == i && mm) Q = v;
      mm &= mm - 1u;
    }
  }
  // Ranks by counting (keys are unique; the zero keys of lanes without a quota share a rank
  // above every live one).
  auto rank8 = [&](unsigned x) {
    int n = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) n += __shfl_sync(kFull, x, i) > x ? 1 : 0;
    return n;
  };
  int r = rank8(Q);
  int p = 0;
  bool done = false;
  unsigned Lm = 0u;                                  // this receiver's partly used expert's key
  for (int guard = 0; guard < B; ++guard) {           // every batch takes >= 1 expert
    const unsigned C = (lane < 8 && p + r < B) ? sk[p + r] : 0u;
    const unsigned qv = Q >> ibR, cv = C >> ibB;
    const unsigned t = min(qv, cv);
    const unsigned Qp = Q - (t << ibR);
    const bool zero = qv == 0u || cv == 0u;
    // A partly used expert keeps its tokens left (key Lc) and becomes the greedy's pick once
    // the stream falls below it.
    const unsigned Lc = (qv < cv && !zero) ? C - (t << ibB) : Lm;
    // Round r is the greedy's while its quota beats every reduced quota of the batch and its
    // expert beats every leftover.  A reduced quota Q'_j never beats a round j' <= j (Q'_j <
    // Q_j <= Q_j'), so the maxima over all lanes decide: one reduction each, both in flight.
    // (Shuffle butterflies instead: docs/planner.md, "Design notes".)
    const unsigned QpMax = __reduce_max_sync(kFull, lane < 8 ? Qp : 0u);
    const unsigned LMax = __reduce_max_sync(kFull, lane < 8 ? Lc : 0u);
    const bool fail = zero || Q < QpMax || C < LMax;
    const int k = static_cast<int>(
        __reduce_min_sync(kFull, lane < 8 && fail ? static_cast<unsigned>(r) : 8u));
    if (lane < 8 && r < k) {
      const int d = static_cast<int>(MR - (Q & MR)), le = static_cast<int>(MB - (C & MB));
      recv[d * B + le] = static_cast<int>(t);         // d's single donor is h: no other writer
      rem[le] = static_cast<int>(cv - t);
      pcnt_h[le] = 1;
      Q = Qp;
      Lm = Lc;
    }
    p += k;
    // Every live quota had its round in this batch and all are now filled: done (saves a batch
    // that would only find k == 0, and the loop's closing round).
    done = k == __popc(__ballot_sync(kFull, lane < 8 && qv != 0u)) && (QpMax >> ibR) == 0u;
    // k == 0: every quota spent, or a leftover is the largest expert (the loop goes on).
    if (done || k == 0 || p >= B) break;
    r = rank8(Q);
  }
  if (!moved) {
    if (lane < 8 && ((act >> lane) & 1u)) kq = Q;
  } else {
    // Back to lane = receiver: h's receiver d gets the key carrying its index (0 if none does:
    // only a spent quota of d = MR has key 0).
    unsigned nk = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned ki = __shfl_sync(kFull, Q, i);
      if (static_cast<int>(MR - (ki & MR)) == lane && ki != 0u) nk = ki;
    }
    if ((act >> lane) & 1u) kq = nk;
  }
  __syncwarp();
  return done;
}

// One round of step 1's greedy over packed keys kb[j] = (balance + T) << ibR (slot j: rank
// lane + 32 j): kx / kn are each slot's argmax / argmin key (ties -> the lowest rank), KX / KN

// Step 1's idle warps (outside warp 0's scheduler: warp % 4 != 0, warps 1, 2, 3, 5, ... for
// h = 0, 1, 2, 3, ..., so warp 0's dependent chain does not share issue slots with them): rank
// h's expert keys sorted for split_batches, into slotoff's row h (scratch until step 3 writes
// it).  Only a donor's keys are read: a rank whose group exceeds T1 / R (its cap is >= that); the
// other sorting warps leave the schedulers to the donors' (-110 cycles at R = 8; the check is a
// multiply, as a division it would cost more than it saves).  An invalid histogram: no donor
// uses them.
__device__ __forceinline__ void sort_donor_keys(const GroupSmem& sm, int h, int R, int B, int ibB,
                                                unsigned MB, int T1) {
  const int lane = threadIdx.x & 31;
  const int* rh = sm.remE + h * B;
  const unsigned g2 = (lane < B ? rh[lane] : 0) + (lane + 32 < B ? rh[lane + 32] : 0);
  const long long g = static_cast<long long>(__reduce_add_sync(kFull, g2));
  if (g * R > T1)
    sort_expert_keys(rh, B, ibB, MB, reinterpret_cast<unsigned*>(sm.slotoff) + h * B);
}

// ---------------------------------------------------------------------------------------------
// Step 2 in steps for one expert serving many quotas (packed keys, NJ <= 2).
//
// Why: at R = 64 with one hot expert its donor refills ~60 receivers, and every one of the
// greedy's rounds pairs the largest quota left with that expert (~190 cycles a round: 11k).  The
// quotas are taken in one order (largest key first: sorted once), and round i of a step (lane i)
// is the greedy's while the expert's leftover before it (tokens minus the quotas of rounds
// 0..i-1, all filled whole) is positive and its key still beats every other expert's (KR2).
// The step ends after a round that fills its quota only partly (the expert is then empty), or
// when it is short of 32 rounds; the round-by-round loop goes on from the same state.  Gate: the
// largest expert still beats the second after filling the largest quota (one_group, where the
// expert changes every round, never steps), and >= 8 receivers.  Python model
// (diagnostics/models/split_steps.py): equal to the greedy on 30k cases.  R = 64 hot: split
// stage 5.8k instead of 11.1k cycles, group kernel median 25.1 instead of 30.0 us
// (docs/benchmarks.md).
// ---------------------------------------------------------------------------------------------

// The one-expert steps' gate (split_one_expert_steps, cost_split_steps): the largest expert (key KR over the
// lanes' kr0 / kr1) still beats the second (KR2) after filling the largest quota (key KQ of kq)
// whole.
template <int NJ>
__device__ __forceinline__ bool one_expert_steps_pay(const unsigned* kq, unsigned kr0,
                                                     unsigned kr1, int ibR, int ibB,
                                                     unsigned MB) {
  unsigned aq = kq[0];
#pragma unroll
  for (int j = 1; j < NJ; ++j) aq = max(aq, kq[j]);
  const unsigned KQ = __reduce_max_sync(kFull, aq);
  const unsigned KR = __reduce_max_sync(kFull, max(kr0, kr1));
  const unsigned KR2 = __reduce_max_sync(kFull, max(kr0 == KR ? 0u : kr0, kr1 == KR ? 0u : kr1));
  const unsigned QM = KQ >> ibR, RM = KR >> ibB;
  return !(QM == 0u || RM <= QM || ((((RM - QM) << ibB) | (KR & MB)) <= KR2));
}

// One step of the largest expert (key KR) over the quotas sorted largest key first (sq[0, nq)),
// from position p: round i (lane i) is the greedy's while the expert's leftover before it is
// positive and its key still beats every other expert's (KR2).  Returns false when no round is
// (the caller's round loop goes on).
struct OneExpertStep {
  unsigned KR;       // the expert's key
  unsigned c;        // its tokens before the step
  unsigned qk, qv;   // this lane's quota key and quota (round p + lane)
  unsigned P;        // the quotas of the rounds before this lane's
  unsigned used;     // the tokens the step takes from the expert
  int k;             // rounds taken
  bool partial;      // the last round fills its quota partly (the expert is then empty)
};

__device__ __forceinline__ bool one_expert_step(OneExpertStep& st, unsigned kr0, unsigned kr1,
                                                const unsigned* sq, int p, int nq, int ibR,
                                                int ibB, unsigned MB) {
  const int lane = threadIdx.x & 31;
  st.KR = __reduce_max_sync(kFull, max(kr0, kr1));
  const unsigned KR2 =
      __reduce_max_sync(kFull, max(kr0 == st.KR ? 0u : kr0, kr1 == st.KR ? 0u : kr1));
  st.c = st.KR >> ibB;
  if (st.c == 0u) return false;
  st.qk = p + lane < nq ? sq[p + lane] : 0u;
  st.qv = st.qk >> ibR;
  st.P = static_cast<unsigned>(warp_incl_scan(static_cast<int>(st.qv), lane)) - st.qv;
  const bool ok =
      st.qv > 0u && st.P < st.c && ((((st.c - st.P) << ibB) | (st.KR & MB)) > KR2);
  const unsigned bad = ~__ballot_sync(kFull, ok);
  st.k = bad != 0u ? __ffs(bad) - 1 : 32;
  if (st.k == 0) return false;
  const unsigned Pl = __shfl_sync(kFull, st.P, st.k - 1), ql = __shfl_sync(kFull, st.qv, st.k - 1);
  st.partial = ql > st.c - Pl;
  st.used = st.partial ? st.c : Pl + ql;
  return true;
}

// The one-expert steps of the packed split (split_donor); sq: scratch of R words for the sorted
// quota keys.
template <int NJ>
__device__ __forceinline__ void split_one_expert_steps(unsigned* kq, unsigned& kr0, unsigned& kr1,
                                                       int& n0, int& n1, int* recv, int B,
                                                       int ibR, int ibB, unsigned MR, unsigned MB,
                                                       unsigned* sq) {
  const int lane = threadIdx.x & 31;
  int nq = 0;                                        // a few receivers: the sort would not pay
#pragma unroll
  for (int j = 0; j < NJ; ++j) nq += __popc(__ballot_sync(kFull, kq[j] != 0u));
  if (nq < 8 || !one_expert_steps_pay<NJ>(kq, kr0, kr1, ibR, ibB, MB)) return;
  int rk[NJ];                                        // rank of this slot's quota key (0: largest)
  warp_key_ranks<NJ, true>(kq, rk);
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (kq[j] != 0u) sq[rk[j]] = kq[j];
  __syncwarp();
  for (int p = 0; p < nq;) {
    OneExpertStep st;
    if (!one_expert_step(st, kr0, kr1, sq, p, nq, ibR, ibB, MB)) break;
    const int le = static_cast<int>(MB - (st.KR & MB));
    const int d = static_cast<int>(MR - (st.qk & MR));
    if (lane < st.k)                                 // d's single donor is this warp's: no race
      recv[d * B + le] = static_cast<int>(min(st.qv, st.c - st.P));
#pragma unroll
    for (int j = 0; j < NJ; ++j) {                   // the quotas' owners take their rounds
      const unsigned Pj = __shfl_sync(kFull, st.P, (rk[j] - p) & 31);
      if (kq[j] != 0u && rk[j] >= p && rk[j] < p + st.k)
        kq[j] -= min(kq[j] >> ibR, st.c - Pj) << ibR;
    }
    if (kr0 == st.KR) { kr0 -= st.used << ibB; n0 += st.k; }
    if (kr1 == st.KR) { kr1 -= st.used << ibB; n1 += st.k; }
    p += st.k;
    if (st.k < 32 || st.partial) break;
  }
  __syncwarp();
}

// Step 2's last warp, while the others split: the receivers grouped by donor in ascending rank
// (rbeg[h], rcnt[h]; rlist), and hpos[h], the number of h's receivers below h (where its home
// piece goes among its experts' pieces).
__device__ __forceinline__ void list_receivers(const GroupSmem& sm, int R) {
  const int lane = threadIdx.x & 31, RW = (R + 31) / 32;
  const unsigned* rmask = sm.rmask;
  const int* donor_of = sm.donor_of;
  int* rbeg = sm.rbeg;
  int* rcnt = sm.rcnt;
  int* hpos = sm.hpos;
  int* rlist = sm.rlist;
  int carry = 0;
  for (int h0 = 0; h0 < R; h0 += 32) {
    const int h = h0 + lane;
    int n = 0;
    if (h < R) for (int w = 0; w < RW; ++w) n += __popc(rmask[h * RW + w]);
    const int incl = warp_incl_scan(n, lane);
    if (h < R) { rbeg[h] = carry + incl - n; rcnt[h] = n; }
    carry += __shfl_sync(kFull, incl, 31);
  }
  __syncwarp();
  for (int u = lane; u < R; u += 32) {
    const unsigned below = (1u << (u & 31)) - 1u;
    {
      const unsigned* mk = rmask + u * RW;
      int p = __popc(mk[u >> 5] & below);
      for (int w = 0; w < (u >> 5); ++w) p += __popc(mk[w]);
      hpos[u] = p;
    }
    const int h = donor_of[u];
    if (h >= 0) {
      const unsigned* mk = rmask + h * RW;
      int p = __popc(mk[u >> 5] & below);
      for (int w = 0; w < (u >> 5); ++w) p += __popc(mk[w]);
      rlist[rbeg[h] + p] = u;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Step 2, split_quotas ("max"), for the k-th donor h on one warp: <= R-1+B rounds of (argmax
// quota, argmax expert left) with quotas and counts in registers; every destination has one
// donor, so the moved counts fit a dense [R, B] table recv[d, le] (tokens of donor(d)'s local
// expert le computed on d).  packed2: packed keys (B <= 64 and room for the index bits), with the
// batched split (batch_ok: a donor with <= 8 receivers) and the one-expert steps; else the
// two-reduction rounds.  Writes recv, h's tokens left at home (remE) and its pieces per expert
// (pcnt).
// ---------------------------------------------------------------------------------------------

template <int NJ>
__device__ __forceinline__ void split_donor(const GroupSmem& sm, int k, int h, int R, int B,
                                            int ibR, int ibB, unsigned MR, unsigned MB,
                                            bool packed2, bool batch_ok, bool shortcuts) {
  const int lane = threadIdx.x & 31;
  const int* donor_of = sm.donor_of;
  const int* z_of = sm.z_of;
  int* recv = sm.recv;
  int* pcnt = sm.pcnt;
  int* rem = sm.remE + h * B;                         // lane-owned entries le = lane + 32 i
  const int rounds = R - 1 + B;
  if (packed2) {
    // Quotas and counts in registers as packed keys; the winner is the slot whose key equals
    // the reduced key.  Each round zeroes a quota or a count, so a (d, le) pair is chosen at
    // most once: recv[d, le] is stored, not accumulated, and the move count of le is the
    // number of slot pieces of expert h*B+le.
    unsigned kq[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = lane + 32 * j;
      kq[j] = (d < R && donor_of[d] == h)
                  ? (static_cast<unsigned>(z_of[d]) << ibR) | (MR - static_cast<unsigned>(d)) : 0u;
    }
    int n0 = 0, n1 = 0;
    if (batch_ok) {                                // NJ == 1 here
      // Worth it only when the largest quota takes the largest expert whole (else the first
      // round already uses an expert partly: one hot expert, nothing to batch).
      const unsigned act = __ballot_sync(kFull, lane < R && donor_of[lane] == h);
      const unsigned* sk = reinterpret_cast<const unsigned*>(sm.slotoff) + h * B;
      if (__popc(act) <= 8 && (__reduce_max_sync(kFull, kq[0]) >> ibR) >= (sk[0] >> ibB)) {
        if (split_batches(kq[0], act, sk, rem, pcnt + h * B, recv, B, ibR, ibB, MR, MB))
          return;                                  // every quota filled: rem, pcnt are final
        if (lane < B) n0 = pcnt[h * B + lane];
        if (lane + 32 < B) n1 = pcnt[h * B + lane + 32];
      }
    }
    unsigned kr0 = lane < B ? expert_key(rem[lane], lane, ibB, MB) : 0u;
    unsigned kr1 = lane + 32 < B ? expert_key(rem[lane + 32], lane + 32, ibB, MB) : 0u;
    // One expert serving many quotas (hot at R = 64); scratch: offL, overwritten by step 3.
    if (NJ <= 2 && k < B && shortcuts)
      split_one_expert_steps<NJ>(kq, kr0, kr1, n0, n1, recv, B, ibR, ibB, MR, MB,
                                 reinterpret_cast<unsigned*>(sm.offL) + k * R);
    for (int it = 0; it < rounds; ++it) {
      unsigned aq = kq[0];
#pragma unroll
      for (int j = 1; j < NJ; ++j) aq = max(aq, kq[j]);
      const unsigned KQ = __reduce_max_sync(kFull, aq);
      const unsigned KR = __reduce_max_sync(kFull, max(kr0, kr1));
      const unsigned QM = KQ >> ibR, RM = KR >> ibB;
      if (QM == 0u || RM == 0u) break;             // see the general path
      const unsigned t = min(QM, RM);
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if (kq[j] == KQ) kq[j] -= t << ibR;
      if (kr0 == KR) { kr0 -= t << ibB; ++n0; }
      if (kr1 == KR) { kr1 -= t << ibB; ++n1; }
      if (lane == 0) {                             // d's single donor is h: no other writer
        const int d = static_cast<int>(MR - (KQ & MR)), le = static_cast<int>(MB - (KR & MB));
        recv[d * B + le] = static_cast<int>(t);
      }
    }
    if (lane < B) { rem[lane] = static_cast<int>(kr0 >> ibB); pcnt[h * B + lane] = n0; }
    if (lane + 32 < B) {
      rem[lane + 32] = static_cast<int>(kr1 >> ibB);
      pcnt[h * B + lane + 32] = n1;
    }
    return;
  }
  int q[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int d = lane + 32 * j;
    q[j] = (d < R && donor_of[d] == h) ? z_of[d] : 0;
  }
  for (int it = 0; it < rounds; ++it) {
    int qv = INT_MIN, qi = INT_MAX;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = lane + 32 * j;
      if (d < R && q[j] > qv) { qv = q[j]; qi = d; }
    }
    int rv = INT_MIN, ri = INT_MAX;
    for (int le = lane; le < B; le += 32) {
      const int x = rem[le];
      if (x > rv) { rv = x; ri = le; }
    }
    const int QM = __reduce_max_sync(kFull, qv);
    const int RM = __reduce_max_sync(kFull, rv);
    // torch: t = min(rem[le], q[d]) if q[d] > 0 else 0.  Max quota <= 0, or no tokens left
    // (rem >= 0 for a valid histogram): every later round moves nothing.
    if (QM <= 0 || RM <= 0) break;
    const int d = __reduce_min_sync(kFull, qv == QM ? qi : INT_MAX);
    const int le = __reduce_min_sync(kFull, rv == RM ? ri : INT_MAX);
    const int t = min(RM, QM);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (lane + 32 * j == d) q[j] -= t;
    if (lane == (le & 31)) rem[le] -= t;
    if (lane == 0) {                               // d's single donor is h: no other writer
      recv[d * B + le] += t;
      pcnt[h * B + le] += 1;
    }
    __syncwarp();
  }
}

}  // namespace moonep_ep::plan
