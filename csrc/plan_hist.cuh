// The device planner's launch 1 (plan_group.cuh): the counting blocks (blocks >= 1: this rank's
// top-k ids per chunk) and block 0's stage 0, the load and validation of the gathered [R, E+3]
// histogram rows.  Shared definitions: plan_internal.cuh.
#pragma once
#include "plan_internal.cuh"

namespace moonep_ep::plan {

// ---------------------------------------------------------------------------------------------
// Launch 1, blocks >= 1: expert histogram of one chunk of topk (clamped ids, like launch 2)
// ---------------------------------------------------------------------------------------------

template <int NP>
__device__ void count_chunk(const GroupArgs& a, int* h) {
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31;
  const int c = blockIdx.x - 1;
  const int start = c * a.C;
  const int end = min(a.N, start + a.C);
  grid_dep_wait();                                   // see plan_group_kernel
  grid_dep_launch();
  int ids[kAssignJ * NP];                            // C <= 32*32*J <= nthr*J*NP: all loads first
#pragma unroll
  for (int j = 0; j < kAssignJ * NP; ++j) {
    const int i = start + j * nthr + tid;
    ids[j] = i < end ? clamp_i(__ldcg(a.topk + i), 0, a.E - 1) : -1;
  }
  for (int e = tid; e < a.E; e += nthr) h[e] = 0;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kAssignJ * NP; ++j) {
    if (start + j * nthr >= end) break;              // uniform
    const int e = ids[j];
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0 && lane == __ffs(peers) - 1) atomicAdd(&h[e], __popc(peers));
  }
  __syncthreads();
  for (int e = tid; e < a.E; e += nthr) a.chunkcnt[static_cast<size_t>(c) * a.E + e] = h[e];
}

// ---------------------------------------------------------------------------------------------
// Launch 1, block 0, stage 0: the histogram load.  Warp tiles of NR rows x 32*NC columns (lane l
// owns columns cb + l + 32k, k < NC: every load instruction is coalesced); RU = 16/NC rows per
// batch, all 16 loads of a batch in flight before any is used, or RU = 1 when a tile is one row
// (R <= 8 at E = 384: the predicated-off loads of rows that do not exist still issued, and the
// stage is issue-bound: 32 warps on 4 schedulers).  Per element: one add into the
// lane's column partial, one into the row partial, one unsigned max (the range check: a negative
// count is a huge unsigned).  Per row one warp reduction + one shared atomic; per tile and column
// one shared atomic (column sums), the before-rank prefix at the row == rank boundary and this
// rank's own row stored directly.  Row sums in one 32-bit word when E*(S*K+1) < 2^32 (exact
// whenever every count is in range, and a count out of range is flagged anyway), else as 16-bit
// halves (kWide).  Returns this thread's error bits.
// ---------------------------------------------------------------------------------------------

template <int NC, int RU, bool kWide>
__device__ __forceinline__ int load_hist_tiles(const int32_t* __restrict__ hist, int R, int E,
                                            int rank, int vmax, int ncb, unsigned ncb_mul, int NR,
                                            int ntiles, int* remE, int* beforeS, int* ownS,
                                            unsigned* rowlo, unsigned* rowhi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int X = E + 3;                               // R * X < 2^22 (R <= 1024, E in smem)
  unsigned mx = 0u;
  for (int tile = warp; tile < ntiles; tile += nwarps) {
    // tile / ncb by the host's multiplier (exact for tile, ncb <= 1024; a division is ~38
    // instructions per warp here)
    const int rb = static_cast<int>(__umulhi(2u * static_cast<unsigned>(tile), ncb_mul));
    const int cbk = tile - rb * ncb;
    const int c0 = cbk * 32 * NC + lane;
    const int r0 = rb * NR, r1 = min(R, r0 + NR);
    unsigned col[NC];
#pragma unroll
    for (int k = 0; k < NC; ++k) col[k] = 0u;
    // The stage is issue-bound (32 warps on 4 schedulers): one 32-bit offset per row, the
    // columns as immediate offsets (per-load 64-bit index arithmetic would be 11k of the
    // block's 33k warp instructions).
    int off = r0 * X + c0;
    for (int rr = r0; rr < r1; rr += RU, off += RU * X) {
      int x[RU][NC];
#pragma unroll
      for (int u = 0; u < RU; ++u) {
        const int32_t* pu = hist + (off + u * X);
#pragma unroll
        for (int k = 0; k < NC; ++k)
          x[u][k] = (rr + u < r1 && c0 + 32 * k < E) ? __ldcg(pu + 32 * k) : 0;
      }
#pragma unroll
      for (int u = 0; u < RU; ++u) {
        const int r = rr + u;
        if (r >= r1) break;                          // uniform over the warp
        if (r == rank) {                             // uniform: the tile holding this rank's row
#pragma unroll
          for (int k = 0; k < NC; ++k) {
            if (c0 + 32 * k < E) {
              atomicAdd(&beforeS[c0 + 32 * k], static_cast<int>(col[k]));   // rows [r0, rank)
              ownS[c0 + 32 * k] = x[u][k];
            }
          }
        }
        unsigned rs = 0u, rh = 0u;
#pragma unroll
        for (int k = 0; k < NC; ++k) {
          const unsigned xu = static_cast<unsigned>(x[u][k]);
          mx = max(mx, xu);
          col[k] += xu;
          if (kWide) { rs += xu & 0xffffu; rh += xu >> 16; } else { rs += xu; }
        }
        rs = __reduce_add_sync(kFull, rs);
        if (kWide) rh = __reduce_add_sync(kFull, rh);
        if (lane == 0) {
          atomicAdd(&rowlo[r], rs);
          if (kWide) atomicAdd(&rowhi[r], rh);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < NC; ++k) {
      if (c0 + 32 * k < E) {
        atomicAdd(&remE[c0 + 32 * k], static_cast<int>(col[k]));
        if (r1 <= rank) atomicAdd(&beforeS[c0 + 32 * k], static_cast<int>(col[k]));   // tile before
      }
    }
  }
  return mx > static_cast<unsigned>(vmax) ? MOONEP_ERR_HIST : 0;
}

template <int NC, int RU>
__device__ __forceinline__ int load_hist_ru(bool wide, const GroupArgs& a, int vmax,
                                            const GroupSmem& sm) {
  return wide ? load_hist_tiles<NC, RU, true>(a.hist, a.R, a.E, a.rank, vmax, a.ld_ncb,
                                              a.ld_ncb_mul, a.ld_NR, a.ld_ntiles, sm.remE,
                                              sm.beforeS, sm.ownS, sm.rowlo, sm.rowhi)
              : load_hist_tiles<NC, RU, false>(a.hist, a.R, a.E, a.rank, vmax, a.ld_ncb,
                                               a.ld_ncb_mul, a.ld_NR, a.ld_ntiles, sm.remE,
                                               sm.beforeS, sm.ownS, sm.rowlo, sm.rowhi);
}

template <int NC, bool kRU2>
__device__ __forceinline__ int load_hist_nc(bool wide, const GroupArgs& a, int vmax,
                                            const GroupSmem& sm) {
  if (a.ld_NR == 1) return load_hist_ru<NC, 1>(wide, a, vmax, sm);
  if constexpr (kRU2 && NC < 8) {                    // not instantiated in the 1024-thread kernels
    if (a.ld_NR == 2) return load_hist_ru<NC, 2>(wide, a, vmax, sm);
  }
  return load_hist_ru<NC, 16 / NC>(wide, a, vmax, sm);
}

// Stage 0 on block 0, every thread: the histogram's column sums (remE), this rank's prefix over
// the source ranks (beforeS) and its own row (ownS), the row sums, and the checks of the rows'
// metadata (m_*: this thread's row, loaded before the kernel's first barrier); the error bits go
// to misc[0].  The two-row tiles (NT < kGroupThreads, the small block at E = 384) load two rows,
// not 16 / NC with the rest predicated off (R = 8 load + quotas: 4.8k instead of 5.9k cycles);
// only there: in the 1024-thread kernels the extra instances raise the spills.
template <int NT>
__device__ __forceinline__ void load_validate(const GroupArgs& a, const GroupSmem& sm, int vmax,
                                              bool one_word, int total0, int m_bad, int m_sr,
                                              int m_tr) {
  const int tid = threadIdx.x, R = a.R, rank = a.rank;
  int myerr;
  {
    const int nc = a.ld_nc;                          // load tiling: host (load_tiling)
    const bool w = !one_word;
    constexpr bool ru2 = NT != kGroupThreads;
    if (nc == 8) myerr = load_hist_nc<8, ru2>(w, a, vmax, sm);
    else if (nc == 4) myerr = load_hist_nc<4, ru2>(w, a, vmax, sm);
    else if (nc == 2) myerr = load_hist_nc<2, ru2>(w, a, vmax, sm);
    else myerr = load_hist_nc<1, ru2>(w, a, vmax, sm);
  }
  if (tid < R) {
    sm.srow[tid] = m_sr;
    if (m_bad != 0) myerr |= MOONEP_ERR_BAD_IDS;
    if (m_sr < 1 || m_sr > a.S) myerr |= MOONEP_ERR_HIST;
    if (tid == rank && m_sr != a.s) myerr |= MOONEP_ERR_HIST;
    if (total0 == -1) {
      if (m_tr != -1 || m_sr != a.s) myerr |= MOONEP_ERR_HIST;
    } else {
      if (m_tr != total0) myerr |= MOONEP_ERR_HIST;
      atomicAdd(&sm.misc[2], clamp_i(m_sr, 0, a.S));  // <= R*S < 2^31
    }
  }
  if (myerr) atomicOr(&sm.misc[0], myerr);
}

}  // namespace moonep_ep::plan
