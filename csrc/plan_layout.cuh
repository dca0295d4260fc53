// The device planner's steps 3-4 (plan_group.cuh): the layout of every destination's receive
// buffer and the pieces table launch 2 assigns the slots from.  Shared definitions:
// plan_internal.cuh.
#pragma once
#include "plan_internal.cuh"

namespace moonep_ep::plan {

static __device__ int block_excl_scan(int* arr, int n, int* wsum) {
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = nthr >> 5;
  int carry = 0;
  for (int b0 = 0; b0 < n; b0 += nthr) {
    const int i = b0 + tid;
    const int v = i < n ? arr[i] : 0;
    const int incl = warp_incl_scan(v, lane);
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int w = lane < nwarps ? wsum[lane] : 0;
      const int wi = warp_incl_scan(w, lane);
      wsum[lane] = wi - w;
      if (lane == 31) wsum[32] = wi;
    }
    __syncthreads();
    if (i < n) arr[i] = carry + wsum[warp] + incl - v;
    carry += wsum[32];
    __syncthreads();
  }
  return carry;
}

// ---------------------------------------------------------------------------------------------
// Step 3, layout: one warp per destination (home segments, then the donor's experts with tokens
// in ascending id, padded to tp, scanned into cu_seqlens); expert offsets.
// ---------------------------------------------------------------------------------------------

// When R < 32 a spare warp (the last) scans the piece counts during step 3, so step 4 needs no
// block scan: pcnt becomes the CSR starts, misc[4] the total.  Each lane scans a contiguous run
// of experts in two passes unrolled by 4 (loads in flight together; a fully unrolled pass spills
// at 1024 threads), well within the layout's time.
__device__ __forceinline__ void scan_pieces_spare(const GroupSmem& sm, int E) {
  const int lane = threadIdx.x & 31;
  int* pcnt = sm.pcnt;
  const int* remE = sm.remE;
  const int per = (E + 31) / 32, i0 = min(E, lane * per), i1 = min(E, i0 + per);
  int sum = 0;
#pragma unroll
  for (int i = i0; i < i1; ++i) sum += pcnt[i] + (remE[i] > 0 ? 1 : 0);
  const int incl = warp_incl_scan(sum, lane);
  int run = incl - sum;
#pragma unroll
  for (int i = i0; i < i1; ++i) {
    const int n = pcnt[i] + (remE[i] > 0 ? 1 : 0);
    pcnt[i] = run;
    run += n;
  }
  if (lane == 31) sm.misc[4] = incl;
}

// Destination d's segments (spare: the piece counts are scanned by the spare warp, so the home
// piece is counted there); this rank's cu_seqlens and zero-fill ranges.  Flags a layout past
// nvs_s (impossible for a valid plan).
__device__ __forceinline__ void layout_destination(const GroupArgs& a, const GroupSmem& sm, int d,
                                                   bool spare, int nvs_s) {
  const int lane = threadIdx.x & 31;
  const int B = a.B, tp = a.tp, rank = a.rank, NvS = a.NvS;
  const unsigned lt_mask = (1u << lane) - 1u;
  const int* remE = sm.remE;
  const int* recv = sm.recv;
  int* offL = sm.offL;
  int* slotoff = sm.slotoff;
  int* pcnt = sm.pcnt;
  const int h = sm.donor_of[d];
  const bool mine = d == rank;
  int run = 0;
  // Two experts per lane and step (j = j0 + 2 lane, j + 1): one warp scan per 64 experts, not
  // per 32 (the scans are this stage's dependent chain).
  auto home = [&](int j, int c, int np, int start, int end) {
    if (j >= B) return;
    const int p = end - start;
    offL[d * B + j] = c > 0 ? start : -1;
    if (!spare) pcnt[d * B + j] = np + (c > 0 ? 1 : 0);   // slot pieces + the home piece
    if (mine) {
      a.cu[j] = clamp_i(end, 0, NvS);
      const bool pad = p > c;
      a.zf[2 * j] = pad ? clamp_i(start + c, 0, NvS) : 0;
      a.zf[2 * j + 1] = pad ? clamp_i(p - c, 0, NvS) : 0;
    }
  };
  for (int j0 = 0; j0 < B; j0 += 64) {             // home experts d*B + j
    const int ja = j0 + 2 * lane, jb = ja + 1;
    const int ca = ja < B ? remE[d * B + ja] : 0, cb = jb < B ? remE[d * B + jb] : 0;
    const int na = ja < B && !spare ? pcnt[d * B + ja] : 0;
    const int nb = jb < B && !spare ? pcnt[d * B + jb] : 0;
    const int pa = align_tp(ca, tp), pb = align_tp(cb, tp);
    const int incl = warp_incl_scan(pa + pb, lane);
    const int endb = run + incl, enda = endb - pb;
    home(ja, ca, na, enda - pa, enda);
    home(jb, cb, nb, enda, endb);
    run += __shfl_sync(kFull, incl, 31);
  }
  auto slot = [&](int b, int le, int t, int start, int end) {   // b < B: <= B experts per donor
    const int p = end - start;
    a.etc[d * B + b] = h * B + le;
    slotoff[d * B + le] = start;
    if (mine) {
      a.cu[B + b] = clamp_i(end, 0, NvS);
      const bool pad = p > t;
      a.zf[2 * (B + b)] = pad ? clamp_i(start + t, 0, NvS) : 0;
      a.zf[2 * (B + b) + 1] = pad ? clamp_i(p - t, 0, NvS) : 0;
    }
  };
  int ns = 0;
  for (int l0 = 0; l0 < B; l0 += 64) {             // donor's experts with tokens, ascending
    const int la = l0 + 2 * lane, lb = la + 1;
    const int ta = (h >= 0 && la < B) ? recv[d * B + la] : 0;
    const int tb = (h >= 0 && lb < B) ? recv[d * B + lb] : 0;
    const bool fa = ta > 0, fb = tb > 0;
    const unsigned bla = __ballot_sync(kFull, fa), blb = __ballot_sync(kFull, fb);
    const int ba = ns + __popc(bla & lt_mask) + __popc(blb & lt_mask), bb = ba + (fa ? 1 : 0);
    const int pa = fa ? align_tp(ta, tp) : 0, pb = fb ? align_tp(tb, tp) : 0;
    const int incl = warp_incl_scan(pa + pb, lane);
    const int endb = run + incl, enda = endb - pb;
    if (fa) slot(ba, la, ta, enda - pa, enda);
    if (fb) slot(bb, lb, tb, enda, endb);
    run += __shfl_sync(kFull, incl, 31);
    ns += __popc(bla) + __popc(blb);
  }
  for (int b = ns + lane; b < B; b += 32) {
    a.etc[d * B + b] = -1;
    if (mine) {
      a.cu[B + b] = clamp_i(run, 0, NvS);
      a.zf[2 * (B + b)] = 0;
      a.zf[2 * (B + b) + 1] = 0;
    }
  }
  if (lane == 0) {
    sm.nrem[d] = ns;
    if (h >= 0) atomicAdd(&sm.copies[h], ns);
    if (run > nvs_s) atomicOr(a.err, MOONEP_ERR_PLAN);      // impossible for a valid plan
  }
}

// ---------------------------------------------------------------------------------------------
// Step 4, per expert its "pieces" (destinations with tokens, in rank order) with cumulative ends,
// as a CSR table of <= 2E pieces for the slot assignment (launch 2's searchsorted becomes a
// binary search).  Pieces of e = h*B + le in rank order: the slot pieces on h's receivers below
// h, the home piece at d = h, the slot pieces on h's receivers above h.  Counts came from the
// split (moves) and the layout (home piece); the receiver lists from the last warp of step 2.
// ---------------------------------------------------------------------------------------------

// A thread per expert walks its donor's receivers in one unrolled chunk when they are few
// (<= kFewReceivers: every donor at R <= 9); a donor with more has a warp per expert
// (pieces_many_receivers).  Also this rank's before / upto counts of every expert.
constexpr int kFewReceivers = 8;

__device__ __forceinline__ void pieces_few_receivers(const GroupArgs& a, const GroupSmem& sm) {
  const int tid = threadIdx.x, nthr = blockDim.x;
  const int E = a.E, B = a.B;
  const int* remE = sm.remE;
  const int* beforeS = sm.beforeS;
  const int* ownS = sm.ownS;
  const int* recv = sm.recv;
  const int* offL = sm.offL;
  const int* slotoff = sm.slotoff;
  const int* pcnt = sm.pcnt;
  const int* rlist = sm.rlist;
  const int* rbeg = sm.rbeg;
  const int* rcnt = sm.rcnt;
  const int* hpos = sm.hpos;
  for (int e = tid; e < E; e += nthr) {
    const int h = e / B, le = e - h * B;
    const int n = rcnt[h];
    if (n <= kFewReceivers) {
      int k = pcnt[e], acc = 0;
      const int c = remE[e];
      const int* lst = rlist + rbeg[h];
      const int hp = hpos[h];
      for (int part = 0; part < 2; ++part) {
        const int i0 = part == 0 ? 0 : hp, i1 = part == 0 ? hp : n;
        if (part == 1 && c > 0) {
          a.pend[k] = acc + c; a.pdst[k] = h; a.pbase[k] = offL[e] - acc; ++k; acc += c;
        }
        if (i0 < i1) {                               // one chunk: i1 - i0 <= n
          int dd[kFewReceivers], tt[kFewReceivers], so[kFewReceivers];
#pragma unroll
          for (int u = 0; u < kFewReceivers; ++u) dd[u] = i0 + u < i1 ? lst[i0 + u] : 0;
#pragma unroll
          for (int u = 0; u < kFewReceivers; ++u) {
            tt[u] = i0 + u < i1 ? recv[dd[u] * B + le] : 0;
            so[u] = i0 + u < i1 ? slotoff[dd[u] * B + le] : 0;
          }
#pragma unroll
          for (int u = 0; u < kFewReceivers; ++u) {
            if (tt[u] > 0) {
              a.pend[k] = acc + tt[u]; a.pdst[k] = dd[u]; a.pbase[k] = so[u] - acc;
              ++k; acc += tt[u];
            }
          }
        }
      }
    }
    a.pstart[e] = pcnt[e];
    a.before[e] = beforeS[e];
    a.upto[e] = beforeS[e] + ownS[e];
  }
}

// A donor with many receivers: a warp per expert, lanes over the n receivers and the home
// piece (position hp of n + 1), the row offsets by a warp scan.  One thread walking the hot
// expert's 59 receivers is the kernel's last warp at R = 64 hot (~10k cycles; warp stamps); a
// warp per expert for every donor: docs/planner.md, "Design notes".
// The donors with many receivers are found 32 at a time by a ballot (at R = 64 zipf, walking
// all 17 donors' 272 experts to skip most of them cost ~3k cycles).
__device__ __forceinline__ void pieces_many_receivers(const GroupArgs& a, const GroupSmem& sm,
                                                      int ndon) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int R = a.R, B = a.B;
  const unsigned lt_mask = (1u << lane) - 1u;
  const int* remE = sm.remE;
  const int* recv = sm.recv;
  const int* offL = sm.offL;
  const int* slotoff = sm.slotoff;
  const int* pcnt = sm.pcnt;
  const int* donors = sm.donors;
  const int* rlist = sm.rlist;
  const int* rbeg = sm.rbeg;
  const int* rcnt = sm.rcnt;
  const int* hpos = sm.hpos;
  for (int d0 = 0; R > kFewReceivers + 1 && d0 < ndon; d0 += 32) {
    const int hl = d0 + lane < ndon ? donors[d0 + lane] : -1;
    const unsigned big = __ballot_sync(kFull, hl >= 0 && rcnt[hl] > kFewReceivers);
    for (int j = warp; j < __popc(big) * B; j += nwarps) {
      const int bi = j / B, le = j - bi * B;
      unsigned m = big;                              // its bi-th set bit
      for (int t = 0; t < bi; ++t) m &= m - 1u;
      const int h = __shfl_sync(kFull, hl, __ffs(m) - 1), n = rcnt[h];
      const int e = h * B + le, c = remE[e];
      const int* lst = rlist + rbeg[h];
      const int hp = hpos[h];
      int k = pcnt[e], acc = 0;
      for (int v0 = 0; v0 <= n; v0 += 32) {
        const int v = v0 + lane;
        int t = 0, dst = h, base = 0;
        if (v == hp) {
          t = c;
          base = offL[e];
        } else if (v <= n) {
          dst = lst[v < hp ? v : v - 1];
          t = recv[dst * B + le];
          base = slotoff[dst * B + le];
        }
        const bool has = t > 0;
        const unsigned bm = __ballot_sync(kFull, has);
        const int incl = warp_incl_scan(t, lane);
        if (has) {
          const int kk = k + __popc(bm & lt_mask);
          a.pend[kk] = acc + incl; a.pdst[kk] = dst; a.pbase[kk] = base - (acc + incl - t);
        }
        k += __popc(bm);
        acc += __shfl_sync(kFull, incl, 31);
      }
    }
  }
}

}  // namespace moonep_ep::plan
