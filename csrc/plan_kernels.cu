// The MoonEP planner on the device (policies "moonep" and "cost"), bit-exact with moonep::plan
// (moonep_ops/planner/: plan_group with floor/ceil caps, rank_quotas "max", split_quotas
// "max", layout, assign_slots, _rank_outputs; policy "cost": cost_plan, in the section "Policy
// cost" below, between steps 1 and 2).  docs/planner.md has the algorithm.  Shape letters:
// docs/architecture.md, "Shape legend"; the local scalars of this file differ: T is the group's
// token copies (the legend's T*K), C a chunk's entries and P a pieces-table size.
//
// Launch 1, plan_group_kernel, grid 1 + nchunks, 1024 threads (R <= 12: 512, kSmallGroupThreads):
//   block 0   steps 1-3 for the whole group from the [R, E+3] histogram (validation included):
//     0. load + validate the histogram (column sums cnt[e], this rank's prefix over source ranks,
//        row sums, s_r, total, bad flags) in warp tiles of rows x 32*NC columns (coalesced
//        loads, 16 in flight per lane, per-lane column and row partials, one warp reduction per
//        tile row); an invalid histogram is replaced by an empty one (nothing moves), so the
//        outputs stay in range whatever the input;
//     1. warp 0 alone, no block barrier in between: the row-sum checks (validity), the group
//        loads, and rank_quotas: <= R-1 rounds of (argmin, argmax) over the balances (warp
//        reductions; ties -> lowest rank) with balances, donor_of and z in registers.  A
//        receiver is refilled by a single donor, so z is kept as donor_of[u], z_of[u];
//     2. split_quotas: one warp per donor, <= R-1+B rounds of (argmax quota, argmax expert left)
//        with quotas and counts in registers; every destination has one donor, so the moved
//        counts fit a dense [R, B] table recv[d, le] (tokens of donor(d)'s local expert le
//        computed on d).  A donor with <= 8 receivers runs rounds in batches of up to 8 where
//        the greedy's choices follow its sorted experts (split_batches).  Meanwhile
//        the last warp lists every donor's receivers in rank order;
//     3. layout: one warp per destination (home segments, then the donor's experts with tokens in
//        ascending id, padded to tp, scanned into cu_seqlens); expert offsets;
//     4. per expert, its "pieces" (destinations with tokens, in rank order) with cumulative ends,
//        as a CSR table of <= 2E pieces: the searchsorted of step 4 becomes a binary search.
//        Piece counts come from steps 2 (one per move) and 3 (the home piece).
//     The greedy loops use one warp reduction per argmax/argmin on packed (value, index) keys
//     when the values leave room for the index bits (2T < 2^(31 - log2 R)), else two.
//     When R < 32 a spare warp scans the piece counts during step 3 (no block scan in step 4),
//     and errors go straight to the error word (no end-of-kernel barrier).
//     The split is a chain of dependent greedy rounds (~40 for a donor refilling 7 ranks), so
//     what pays is fewer sequential steps: split_batches checks up to 8 rounds at once
//     (one_group at R = 8: split 10.2k -> 4.9k cycles).  The alternatives measured and rejected
//     (per-lane donors, register argmaxes, predicated scalar recurrences, ...) are listed once,
//     with their measured reasons, in docs/planner.md, "Design notes".
//   Programmatic dependent launch: launch and shared-memory set-up overlap the previous kernel
//     (the histogram barrier triggers its dependents at its start); see grid_dep_wait.
//   blocks 1.. per chunk of C = tpc*K entries of topk: the expert histogram of the chunk.
// Launch 2, plan_assign_kernel, one block per chunk (the pieces table in shared memory): the
//   stable rank of every entry among this rank's entries of its expert (ordered by flat
//   index) = before-rank prefix + earlier chunks
//   + earlier warps (per-warp counters) + earlier lanes (match_any); then the destination piece,
//   the slot, and the duplicate marking within the token.
//
// Integer widths: the torch planner computes in int64; every value here is bounded by the total
// number of entries T <= R*S*K < 2^31 (host-checked, and R*NvS < 2^31), or by a row offset
// < NvS, so int32 is exact for every histogram that passes validation.  Validation row sums are
// exact whenever every count is in [0, S*K] (32-bit when E*(S*K+1) < 2^32, else 16-bit halves),
// and a count outside that range is flagged by itself, so garbage cannot alias a valid histogram.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#include "ep_internal.h"
#include "pdl.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kGroupThreads = 1024;
// The group kernel for small groups runs half the block.  At R = 8, E = 384 (A/B) the block
// alone takes 0.3-0.4 us off every routing's median (the block's launch, set-up and barriers
// cost less, and with 128 registers a thread instead of 64 it has no spills); with the two-row
// histogram tiles it allows (load_hist_nc) one_group takes 9.3-9.5 instead of 10.0-10.1 us,
// 14.5k instead of 15.5k warm cycles.  It is used while it still has a sorting warp per rank
// outside warp 0's scheduler (batch_ok: R + (R-1)/3 < 16, i.e. R <= 12), which the batched split
// needs; larger groups keep 1024 threads.
constexpr int kSmallGroupThreads = 512;
static_assert(kGroupThreads % kSmallGroupThreads == 0, "count_chunk covers a chunk in NP passes");

// Step 1 sorts each rank's expert keys on its own warp outside warp 0's scheduler (warp % 4 != 0:
// warps 1, 2, 3, 5, ... for ranks 0, 1, 2, 3, ...); the batched split needs them all.
__host__ __device__ constexpr bool sorting_warps_fit(int R, int nwarps) {
  return R + (R - 1) / 3 < nwarps;
}
constexpr int kAssignJ = 8;          // entries per lane in the assign kernel (and chunk sizing)
constexpr int kMaxR = 1024;
constexpr int kMaxK = 127;

inline size_t align16(size_t x) { return (x + 15) & ~size_t(15); }

// ---------------------------------------------------------------------------------------------
// Sizes shared by host and device
// ---------------------------------------------------------------------------------------------

struct Chunking {
  int W;        // warps of the assign kernel
  int tpc;      // tokens per chunk
  int C;        // entries per chunk (tpc * K)
  int nchunks;
};

inline Chunking chunking(int E, int s, int K) {
  Chunking c;
  c.W = 32;   // per-warp expert counters: W*E ints of shared memory, keep them <= 64 KiB
  while (c.W > 4 && static_cast<size_t>(c.W) * E * 4 > 64 * 1024) c.W >>= 1;
  const int cap = c.W * 32 * kAssignJ;
  c.tpc = cap / K;
  if (c.tpc < 1) c.tpc = 1;
  c.C = c.tpc * K;
  c.nchunks = (s + c.tpc - 1) / c.tpc;
  return c;
}

struct WsLayout {
  size_t pend, pdst, pbase, pstart, before, upto, scalars, chunkcnt, total;
};

// Pieces (destinations of an expert's tokens, in rank order) in CSR form: at most one home
// piece per expert and one slot piece per (destination, slot), so <= 2E pieces in all.
inline WsLayout ws_layout(int R, int E, int s, int K) {
  (void)R;
  WsLayout L;
  size_t o = 0;
  const size_t P = 2 * static_cast<size_t>(E);
  L.pend = o;     o = align16(o + P * 4);
  L.pdst = o;     o = align16(o + P * 4);
  L.pbase = o;    o = align16(o + P * 4);
  L.pstart = o;   o = align16(o + (static_cast<size_t>(E) + 1) * 4);
  L.before = o;   o = align16(o + static_cast<size_t>(E) * 4);
  L.upto = o;     o = align16(o + static_cast<size_t>(E) * 4);
  L.scalars = o;  o = align16(o + 16);
  const Chunking c = chunking(E, s, K);
  L.chunkcnt = o; o = align16(o + static_cast<size_t>(c.nchunks) * E * 4);
  L.total = o;
  return L;
}

// The group kernel's shared memory without policy "cost"'s area (a 16-byte multiple: that
// area starts right after it).
__host__ __device__ inline size_t group_smem_base(int R, int E) {
  const size_t RW = (R + 31) / 32;
  return (4 * (7 * static_cast<size_t>(E) + 1 + 10 * static_cast<size_t>(R) +
               static_cast<size_t>(R) * RW + 48) + 15) & ~static_cast<size_t>(15);
}

// Policy "cost" (docs/planner.md, planner.cost_plan): MoonEP's plan + kCostLevels level plans.
// Its shared area (CostSmem, after the group kernel's own): per candidate its quotas, its
// critical donors and their split's pieces, one row of max(B, R) ints per warp.  Limits
// (host-checked, planner/device.py mirrors them): R <= kCostMaxR (two register slots a lane: the
// candidate warps keep every per-rank value in registers) and B <= kCostMaxB (the per-warp rows
// stay <= 32 KiB; R <= 64 < B's 256).
constexpr int kCostLevels = 16;                      // planner.COST_LEVELS
constexpr int kCostMaxR = 64;
constexpr int kCostMaxB = 256;
constexpr int kCostWarps = 32;                       // scratch rows: the largest block's warps
constexpr long long kInfeasible = 1ll << 62;         // planner._INFEASIBLE
constexpr long long kPPM = 1000000;                  // geometry.PPM

// geometry.slack_cap: ceil(c * (1 + ppm / 1e6)) in integers (c < 2^31: no overflow in int64).
__host__ __device__ inline long long slack_cap(long long c, int ppm) {
  return (c * (kPPM + ppm) + kPPM - 1) / kPPM;
}

inline size_t assign_smem_bytes(int E, int W) {
  return 4 * (2 * static_cast<size_t>(E) + static_cast<size_t>(W) * E +
              static_cast<size_t>(W) * 32 * kAssignJ + static_cast<size_t>(E) + 1 +
              6 * static_cast<size_t>(E)) + 16;
}

struct GroupArgs {
  const int32_t* hist;
  const int32_t* topk;
  int s, K, rank, R, E, B, S, tp, NvS;
  int32_t* cu;
  int32_t* etc;
  int32_t* zf;
  int32_t* stats;
  int32_t* pend;
  int32_t* pdst;
  int32_t* pbase;
  int32_t* pstart;
  int32_t* before;
  int32_t* upto;
  int32_t* scalars;
  int32_t* chunkcnt;
  int C, N;
  int ld_nc, ld_ncb, ld_NR, ld_ntiles;   // histogram load tiling (load_tiling)
  unsigned ld_ncb_mul;                  // ceil(2^31 / ld_ncb): tile / ncb as one __umulhi
#ifdef MOONEP_DIAGNOSTICS
  int stop;            // block 0 returns after this stage (99: full plan; moonep_plan_debug_stop)
  long long* stamps;   // null: off.  Block 0's clock64 at the stage boundaries
  long long* wstamps;  // null: off.  [5, 32] each warp's clock64 at stage ends; [7, 32]
                       // with policy cost (5, 6: its search's stages, cost_search)
#endif
  int nvs_uni;         // nvs_s of T = R*s*K (uniform s, or an invalid histogram): host-computed
  int slack_ppm;       // policy "cost"'s cap slack (0: MoonEP, exact caps)
  int cost;            // host: 1 launches the kCost kernels (the level search), 0 MoonEP
  long long replica_cost;   // policy "cost": one replica's cost in token copies, [0, 2^40)
  int32_t* err;
};

struct AssignArgs {
  const int32_t* topk;
  int N, K, R, E, B, NvS, C;
  const int32_t* pend;
  const int32_t* pdst;
  const int32_t* pbase;
  const int32_t* pstart;
  const int32_t* before;
  const int32_t* upto;
  const int32_t* scalars;
  const int32_t* chunkcnt;
  int32_t* dst;
  int32_t* err;
};

__device__ __forceinline__ int clamp_i(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }
// token_padding is usually a power of two: then a mask, not a ~20-instruction integer division on
// the layout's dependent chain (the test on tp is loop-invariant).
__device__ __forceinline__ int align_tp(int c, int tp) {
  if (c <= 0) return 0;
  return (tp & (tp - 1)) == 0 ? (c + tp - 1) & -tp : (c + tp - 1) / tp * tp;
}

// nvs_s of TT token copies (docs/planner.md): align_up(ceil(TT/R) + (tp-1)*2B, tp), at most NvS.
// For the host (T = R*s*K) and the kernel (per-rank s) alike, in 32 bits: TT < 2^31 and per <
// 2^32 (R*NvS < 2^31, checked on the host), and on the device 64-bit divisions are subroutine
// calls (four of them made the last warp the last to reach step 1's barrier).
// With a slack (policy "cost", ppm > 0) ceil(TT/R) becomes slack_cap(ceil(TT/R)) (Geometry.nvs_s),
// in 64 bits (one call per kernel, off the critical path).
__host__ __device__ inline int nvs_of(unsigned TT, int R, int tp, int B, int NvS, int ppm = 0) {
  if (ppm > 0) {
    const long long even = (static_cast<long long>(TT) + R - 1) / R;
    const long long per = slack_cap(even, ppm) + static_cast<long long>(tp - 1) * 2 * B;
    const long long v = (per + tp - 1) / tp * tp;
    return v < NvS ? static_cast<int>(v) : NvS;
  }
  const unsigned per = (TT + static_cast<unsigned>(R) - 1u) / static_cast<unsigned>(R)
                       + static_cast<unsigned>(tp - 1) * 2u * static_cast<unsigned>(B);
  const unsigned tpu = static_cast<unsigned>(tp), q = per / tpu;
  const unsigned long long v = static_cast<unsigned long long>(q + (per - q * tpu != 0u)) * tpu;
  return v < static_cast<unsigned long long>(NvS) ? static_cast<int>(v) : NvS;
}

__device__ __forceinline__ int warp_incl_scan(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// Programmatic dependent launch (the group kernel is launched with programmatic stream
// serialization): the launch and the shared-memory set-up overlap the previous kernel, and
// griddepcontrol.wait blocks until that kernel has completed and flushed its writes.  Nothing
// global is read or written before the wait; the reads after it bypass L1 (ld.global.cg), since
// this block may have become resident while the previous kernel still ran.  The trigger right
// after the wait lets a PDL-launched successor do the same (grid_dep_*: pdl.cuh).

// Diagnostics hooks (moonep_ep.h, MOONEP_DIAGNOSTICS builds only).  In the production build
// plan_stop() is the constant 99 (the full plan, every shortcut on: each test on it folds away
// at compile time) and the stamps are empty, so the kernels carry no trace of them.
//   plan_stop(a): the stage after which block 0 returns (99: none), or 197-199 (slow paths).
//   stamp(a, i): thread 0 of block 0 records clock64 at stage boundary i.  Right after a
//     __syncthreads() (BAR.SYNC.DEFER_BLOCKING) the read comes before the barrier completes, so
//     these stamps are warp 0's arrivals (diagnostics/clock_barrier_probe.cu); the last warp's
//     view is wstamp's (diagnostics/plan_warp_stamps.py).
//   wstamp<NJ>(a, i): every warp's lane 0 records clock64 as it reaches the end of stage i
//     (before the barrier), to tell which warp each stage waits for.  Only in the R <= 64
//     kernels (NJ <= 2): in the larger ones it raises the spills (NJ = 16: 808 instead of 324
//     bytes, in the rank quotas loop).
#ifdef MOONEP_DIAGNOSTICS
__device__ __forceinline__ int plan_stop(const GroupArgs& a) { return a.stop; }
__device__ __forceinline__ void stamp(const GroupArgs& a, int i) {
  if (a.stamps != nullptr && threadIdx.x == 0) a.stamps[i] = clock64();
}
template <int NJ>
__device__ __forceinline__ void wstamp(const GroupArgs& a, int i) {
  if constexpr (NJ <= 2) {
    if (a.wstamps != nullptr && (threadIdx.x & 31) == 0)
      a.wstamps[i * 32 + (threadIdx.x >> 5)] = clock64();
  }
}
#else
__device__ __forceinline__ constexpr int plan_stop(const GroupArgs&) { return 99; }
__device__ __forceinline__ void stamp(const GroupArgs&, int) {}
template <int NJ>
__device__ __forceinline__ void wstamp(const GroupArgs&, int) {}
#endif

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

// Exclusive scan of arr[0, n) in place by the whole block; returns the total.  wsum: [34] ints.
__device__ int block_excl_scan(int* arr, int n, int* wsum) {
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

__device__ __forceinline__ int ceil_log2(int x) { return x <= 1 ? 0 : 32 - __clz(x - 1); }

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
__device__ __forceinline__ int load_hist_ru(bool wide, const GroupArgs& a, int vmax, int* remE,
                                            int* beforeS, int* ownS, unsigned* rowlo,
                                            unsigned* rowhi) {
  return wide ? load_hist_tiles<NC, RU, true>(a.hist, a.R, a.E, a.rank, vmax, a.ld_ncb,
                                              a.ld_ncb_mul, a.ld_NR, a.ld_ntiles, remE, beforeS,
                                              ownS, rowlo, rowhi)
              : load_hist_tiles<NC, RU, false>(a.hist, a.R, a.E, a.rank, vmax, a.ld_ncb,
                                               a.ld_ncb_mul, a.ld_NR, a.ld_ntiles, remE, beforeS,
                                               ownS, rowlo, rowhi);
}

template <int NC, bool kRU2>
__device__ __forceinline__ int load_hist_nc(bool wide, const GroupArgs& a, int vmax, int* remE,
                                            int* beforeS, int* ownS, unsigned* rowlo,
                                            unsigned* rowhi) {
  if (a.ld_NR == 1) return load_hist_ru<NC, 1>(wide, a, vmax, remE, beforeS, ownS, rowlo, rowhi);
  if constexpr (kRU2 && NC < 8) {                    // not instantiated in the 1024-thread kernels
    if (a.ld_NR == 2) return load_hist_ru<NC, 2>(wide, a, vmax, remE, beforeS, ownS, rowlo, rowhi);
  }
  return load_hist_ru<NC, 16 / NC>(wide, a, vmax, remE, beforeS, ownS, rowlo, rowhi);
}

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
    // (8-lane shuffle butterflies instead of the three reductions measured slower: 4.8k
    // against 3.8k cycles for R = 8 one_group's 6 batches.)
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
// their warp maxima / minima.
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
// sq: scratch of R words for the sorted quota keys.
// ---------------------------------------------------------------------------------------------

template <int NJ>
__device__ __forceinline__ void split_one_expert_steps(unsigned* kq, unsigned& kr0, unsigned& kr1,
                                                       int& n0, int& n1, int* recv, int B,
                                                       int ibR, int ibB, unsigned MR, unsigned MB,
                                                       unsigned* sq) {
  const int lane = threadIdx.x & 31;
  {
    int nrecv = 0;                                   // a few receivers: the sort would not pay
#pragma unroll
    for (int j = 0; j < NJ; ++j) nrecv += __popc(__ballot_sync(kFull, kq[j] != 0u));
    if (nrecv < 8) return;
    unsigned aq = kq[0];
#pragma unroll
    for (int j = 1; j < NJ; ++j) aq = max(aq, kq[j]);
    const unsigned KQ = __reduce_max_sync(kFull, aq);
    const unsigned KR = __reduce_max_sync(kFull, max(kr0, kr1));
    const unsigned KR2 =
        __reduce_max_sync(kFull, max(kr0 == KR ? 0u : kr0, kr1 == KR ? 0u : kr1));
    const unsigned QM = KQ >> ibR, RM = KR >> ibB;
    if (QM == 0u || RM <= QM || ((((RM - QM) << ibB) | (KR & MB)) <= KR2)) return;
  }
  int rk[NJ];                                        // rank of this slot's quota key (0: largest)
#pragma unroll
  for (int j = 0; j < NJ; ++j) rk[j] = 0;
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const unsigned v = __shfl_sync(kFull, kq[jj], l);
#pragma unroll
      for (int j = 0; j < NJ; ++j) rk[j] += v > kq[j] ? 1 : 0;
    }
  }
  int nq = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (kq[j] != 0u) sq[rk[j]] = kq[j];
    nq += __popc(__ballot_sync(kFull, kq[j] != 0u));
  }
  __syncwarp();
  for (int p = 0; p < nq;) {
    const unsigned KR = __reduce_max_sync(kFull, max(kr0, kr1));
    const unsigned KR2 =
        __reduce_max_sync(kFull, max(kr0 == KR ? 0u : kr0, kr1 == KR ? 0u : kr1));
    const unsigned c = KR >> ibB;
    if (c == 0u) break;
    const unsigned qk = p + lane < nq ? sq[p + lane] : 0u, qv = qk >> ibR;
    const unsigned P = static_cast<unsigned>(warp_incl_scan(static_cast<int>(qv), lane)) - qv;
    const bool ok = qv > 0u && P < c && ((((c - P) << ibB) | (KR & MB)) > KR2);
    const unsigned bad = ~__ballot_sync(kFull, ok);
    const int k = bad != 0u ? __ffs(bad) - 1 : 32;
    if (k == 0) break;
    const unsigned Pl = __shfl_sync(kFull, P, k - 1), ql = __shfl_sync(kFull, qv, k - 1);
    const bool partial = ql > c - Pl;                // the last round empties the expert
    const unsigned used = partial ? c : Pl + ql;
    const int le = static_cast<int>(MB - (KR & MB));
    if (lane < k)                                    // d's single donor is this warp's: no race
      recv[static_cast<int>(MR - (qk & MR)) * B + le] = static_cast<int>(min(qv, c - P));
#pragma unroll
    for (int j = 0; j < NJ; ++j) {                   // the quotas' owners take their rounds
      const unsigned Pj = __shfl_sync(kFull, P, (rk[j] - p) & 31);
      if (kq[j] != 0u && rk[j] >= p && rk[j] < p + k) kq[j] -= min(kq[j] >> ibR, c - Pj) << ibR;
    }
    if (kr0 == KR) { kr0 -= used << ibB; n0 += k; }
    if (kr1 == KR) { kr1 -= used << ibB; n1 += k; }
    p += k;
    if (k < 32 || partial) break;
  }
  __syncwarp();
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
  int rk[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int d = lane + 32 * j;
    ky[j] = d < R && kb[j] < (TT << ibR) ? (kb[j] | static_cast<unsigned>(d)) : 0xffffffffu;
    rk[j] = 0;
  }
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) {                  // rank = deficits with a smaller key
    // Unrolled: the shuffles are independent, so their latency overlaps (a rolled loop paid
    // it per key: 5.1k cycles at R = 64, measured).  Keys of d >= R are ~0u: never smaller.
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const unsigned v = __shfl_sync(kFull, ky[jj], l);
#pragma unroll
      for (int j = 0; j < NJ; ++j) rk[j] += v < ky[j] ? 1 : 0;
    }
  }
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
// 1024-thread block (cost_warp: 16 warps, 4 a scheduler), two in the 512-thread one (8 warps); each candidate warp then lists its level's critical donors, and warp 0 lists
// MoonEP's after its quotas.  Splits: every (candidate, critical donor) pair is independent, so
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
// down from the last, so each of the 4 schedulers (warp % 4) holds a quarter of them.  Why:
// with several donors (zipf at R = 64) the 16 level loops are issue-bound, and skipping warp
// 0's scheduler put 6 of them on one scheduler, which ended step 1 at 45.8k cycles (warp 0's
// own quotas: 16.7k).  -1: not a candidate warp.
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
    int rk[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const unsigned d = static_cast<unsigned>(lane + 32 * j);
      ky[j] = fr[j] ? (static_cast<unsigned>(sp[j]) << ibR) | (MR - d) : 0u;   // sp < 2^(31-ibR)
      rk[j] = 0;
    }
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {                // rank = free receivers with a larger key
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        const unsigned v = __shfl_sync(kFull, ky[jj], l);
#pragma unroll
        for (int j = 0; j < NJ; ++j) rk[j] += v > ky[j] ? 1 : 0;
      }
    }
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

// Policy "cost"'s shared area (cost_smem_ints ints): per candidate row (0..kCostLevels-1 the
// levels, kCostMoonRow MoonEP) its (donor, quota) per receiver (the levels only: MoonEP's are
// step 1's donor_of / z_of), its critical donors and their splits' pieces, its feasibility,
// critical-donor count and max load; one row of max(B, R) ints per warp (during step 1 a
// candidate warp's sorted receivers and donor counts, then a split's tokens left or its sorted
// quota keys).
constexpr int kCostRows = kCostLevels + 1;
constexpr int kCostMoonRow = kCostLevels;
struct CostSmem {
  int* qrow;           // [kCostLevels][2][R]
  int* crit;           // [kCostRows][R] critical donors, ascending
  int* pieces;         // [kCostRows][R] their splits' pieces
  int* feas;           // [kCostRows]
  int* ncrit;          // [kCostRows]
  int* mload;          // [kCostRows]
  int* wrem;           // [kCostWarps][max(B, R)]
};

__host__ __device__ inline size_t cost_smem_ints(int R, int E) {
  return static_cast<size_t>(kCostLevels * 2 + kCostRows * 2) * R + 3 * kCostRows + 1 +
         static_cast<size_t>(kCostWarps) * (E / R > R ? E / R : R);
}

__device__ __forceinline__ CostSmem cost_smem(unsigned char* base, int R) {
  CostSmem c;
  c.qrow = reinterpret_cast<int*>(base);
  c.crit = c.qrow + kCostLevels * 2 * R;
  c.pieces = c.crit + kCostRows * R;
  c.feas = c.pieces + kCostRows * R;
  c.ncrit = c.feas + kCostRows;
  c.mload = c.ncrit + kCostRows;
  c.wrem = c.mload + kCostRows + 1;
  return c;
}

inline size_t group_smem_bytes(int R, int E, bool cost) {
  return group_smem_base(R, E) + (cost ? 4 * cost_smem_ints(R, E) : 0);
}

// A candidate's critical donors (see the section comment) from its quota row, on one warp
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
  {
    unsigned aq = kq[0];
#pragma unroll
    for (int j = 1; j < NJ; ++j) aq = max(aq, kq[j]);
    const unsigned KQ = __reduce_max_sync(kFull, aq);
    const unsigned KR = __reduce_max_sync(kFull, max(kr0, kr1));
    const unsigned KR2 =
        __reduce_max_sync(kFull, max(kr0 == KR ? 0u : kr0, kr1 == KR ? 0u : kr1));
    const unsigned QM = KQ >> ibR, RM = KR >> ibB;
    if (QM == 0u || RM <= QM || ((((RM - QM) << ibB) | (KR & MB)) <= KR2)) return 0;
  }
  int rk[NJ];                                        // rank of this slot's quota key (0: largest)
#pragma unroll
  for (int j = 0; j < NJ; ++j) rk[j] = 0;
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const unsigned v = __shfl_sync(kFull, kq[jj], l);
#pragma unroll
      for (int j = 0; j < NJ; ++j) rk[j] += v > kq[j] ? 1 : 0;
    }
  }
  __syncwarp();                                      // the last pair's reads of sq are done
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (kq[j] != 0u) sq[rk[j]] = kq[j];
  __syncwarp();
  int rounds = 0;
  for (int p = 0; p < nq;) {
    const unsigned KR = __reduce_max_sync(kFull, max(kr0, kr1));
    const unsigned KR2 =
        __reduce_max_sync(kFull, max(kr0 == KR ? 0u : kr0, kr1 == KR ? 0u : kr1));
    const unsigned c = KR >> ibB;
    if (c == 0u) break;
    const unsigned qk = p + lane < nq ? sq[p + lane] : 0u, qv = qk >> ibR;
    const unsigned P = static_cast<unsigned>(warp_incl_scan(static_cast<int>(qv), lane)) - qv;
    const bool ok = qv > 0u && P < c && ((((c - P) << ibB) | (KR & MB)) > KR2);
    const unsigned bad = ~__ballot_sync(kFull, ok);
    const int k = bad != 0u ? __ffs(bad) - 1 : 32;
    if (k == 0) break;
    const unsigned Pl = __shfl_sync(kFull, P, k - 1), ql = __shfl_sync(kFull, qv, k - 1);
    const bool partial = ql > c - Pl;                // the last round empties the expert
    const unsigned used = partial ? c : Pl + ql;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {                   // the quotas' owners take their rounds
      const unsigned Pj = __shfl_sync(kFull, P, (rk[j] - p) & 31);
      if (kq[j] != 0u && rk[j] >= p && rk[j] < p + k) {
        const int t = static_cast<int>(min(kq[j] >> ibR, c - Pj));
        kq[j] -= static_cast<unsigned>(t) << ibR;
        q[j] -= t;
        ++nin[j];
        tin[j] += t;
      }
    }
    if (kr0 == KR) r0 -= static_cast<int>(used);
    if (kr1 == KR) r1 -= static_cast<int>(used);
    ekeys(kr0, kr1);
    no += k;
    to += static_cast<int>(used);
    rounds += k;
    p += k;
    if (k < 32 || partial) break;
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
  // One round: first argmax quota (d), first argmax tokens left (le), t = min of both.
  // torch: t = min(rem, q) if q > 0 else 0; no quota or no token left: nothing moves again.
  auto quota_max = [&](int& D) {
    int qv = 0, qi = 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (q[j] > qv) { qv = q[j]; qi = lane + 32 * j; }
    return warp_first_max(qv, qi, pk, ibR, D);
  };
  auto take = [&](int D, int t) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (lane + 32 * j == D) { q[j] -= t; ++nin[j]; tin[j] += t; }
    ++no;                                            // a (le, d) pair is chosen at most once
    to += t;
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
      int D, LE;
      const int QM = quota_max(D);
      const int RM = warp_first_max(rv, ri, pk, ibB, LE);
      if (QM <= 0 || RM <= 0) break;
      const int t = min(QM, RM);
      take(D, t);
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
      int D, LE;
      const int QM = quota_max(D);
      const int RM = warp_first_max(rv, ri, pk, ibB, LE);
      if (QM <= 0 || RM <= 0) break;
      const int t = min(QM, RM);
      take(D, t);
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

// ---------------------------------------------------------------------------------------------
// Launch 1, block 0: steps 1-3.  NJ = ceil(R/32) rounded up to a power of two (register slots of
// the per-rank values each lane holds in the warp-level greedy loops).  kCost: policy "cost"'s
// search between steps 1 and 2 (its own instances, NJ <= 2: the policy "moonep" kernels carry
// none of its code or registers).
// ---------------------------------------------------------------------------------------------

template <int NJ, int NT, bool kCost = false>
__global__ void __launch_bounds__(NT, 1) plan_group_kernel(GroupArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (blockIdx.x > 0) {
    count_chunk<kGroupThreads / NT>(a, reinterpret_cast<int*>(smem_raw));
    return;
  }
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = nthr >> 5;
  const int R = a.R, E = a.E, B = a.B, rank = a.rank, X = E + 3, RW = (R + 31) / 32;
  const int tp = a.tp;
  stamp(a, 0);

  int* remE = reinterpret_cast<int*>(smem_raw);      // [E]  cnt, then tokens left at home
  int* beforeS = remE + E;                           // [E]  sum_{r < rank} hist[r, e]
  int* ownS = beforeS + E;                           // [E]  hist[rank, e]
  int* recv = ownS + E;                              // [R, B] tokens of donor(d)'s expert on d
  int* offL = recv + E;                              // [E]  home segment start of e (-1: empty)
  int* slotoff = offL + E;                           // [R, B] slot segment start on d
  int* pcnt = slotoff + E;                           // [E+1] pieces per expert -> CSR starts
  unsigned* rowlo = reinterpret_cast<unsigned*>(pcnt + E + 1);   // [R] row sums (low part)
  unsigned* rowhi = rowlo + R;                       // [R] row sums (high part)
  unsigned* rmask = rowhi + R;                       // [R, RW] receivers of each donor
  int* donor_of = reinterpret_cast<int*>(rmask + R * RW);   // [R]
  int* z_of = donor_of + R;                          // [R]
  int* srow = z_of + R;                              // [R]  s_r of each row
  int* nrem = srow + R;                              // [R]
  int* copies = nrem + R;                            // [R]
  int* donors = copies + R;                          // [R]
  int* hpos = donors + R;                            // [R]  receivers of h below h
  int* rlist = hpos + R;                             // [R]  receivers grouped by donor, ascending
  int* wsum = rlist + R;                             // [34]
  int* misc = wsum + 34;                             // [8]: err bits, ndonors, sum of s_r, valid,
                                                     //      pieces total (spare-warp scan),
                                                     //      nvs_s if valid, nvs_s if not
  int* rbeg = reinterpret_cast<int*>(rowlo);         // [R]  after validation: start in rlist
  int* rcnt = reinterpret_cast<int*>(rowhi);         // [R]  after validation: receivers of h

  for (int i = tid; i < E; i += nthr) {
    remE[i] = 0; beforeS[i] = 0; ownS[i] = 0; recv[i] = 0; offL[i] = -1; slotoff[i] = 0;
    pcnt[i] = 0;
  }
  for (int i = tid; i < R; i += nthr) {
    rowlo[i] = 0; rowhi[i] = 0; donor_of[i] = -1; z_of[i] = 0; nrem[i] = 0; copies[i] = 0;
    hpos[i] = 0;
  }
  for (int i = tid; i < R * RW; i += nthr) rmask[i] = 0u;
  if (tid < 8) misc[tid] = 0;
  if (tid == 0) pcnt[E] = 0;
  grid_dep_wait();                                   // the histogram is the last kernel's output
  grid_dep_launch();
  stamp(a, 1);
  // This thread's metadata row (R <= 1024 = blockDim) and the total: in flight over the barrier.
  const int total0 = __ldcg(a.hist + static_cast<size_t>(rank) * X + E + 2);
  int m_bad = 0, m_sr = 0, m_tr = 0;
  if (tid < R) {
    m_bad = __ldcg(a.hist + static_cast<size_t>(tid) * X + E);
    m_sr = __ldcg(a.hist + static_cast<size_t>(tid) * X + E + 1);
    m_tr = __ldcg(a.hist + static_cast<size_t>(tid) * X + E + 2);
  }
  __syncthreads();
  if (plan_stop(a) == 0) return;

  // ---- 0. load and validate ------------------------------------------------------------------
  const int vmax = a.S * a.K;        // a count above S*K is invalid (host: R*S*K < 2^31)
  const bool one_word = static_cast<unsigned long long>(E) * (static_cast<unsigned>(vmax) + 1ull)
                        < (1ull << 32);
  int myerr;
  {
    const int nc = a.ld_nc;                          // load tiling: host (load_tiling)
    const bool w = !one_word;
    // Two-row tiles (the small block at E = 384) load two rows, not 16 / NC with the rest
    // predicated off (R = 8 load + quotas: 4.8k instead of 5.9k cycles with the small block).
    // Only there: in the 1024-thread kernels the extra instances raise the spills.
    constexpr bool ru2 = NT != kGroupThreads;
    if (nc == 8) myerr = load_hist_nc<8, ru2>(w, a, vmax, remE, beforeS, ownS, rowlo, rowhi);
    else if (nc == 4) myerr = load_hist_nc<4, ru2>(w, a, vmax, remE, beforeS, ownS, rowlo, rowhi);
    else if (nc == 2) myerr = load_hist_nc<2, ru2>(w, a, vmax, remE, beforeS, ownS, rowlo, rowhi);
    else myerr = load_hist_nc<1, ru2>(w, a, vmax, remE, beforeS, ownS, rowlo, rowhi);
  }
  if (tid < R) {
    srow[tid] = m_sr;
    if (m_bad != 0) myerr |= MOONEP_ERR_BAD_IDS;
    if (m_sr < 1 || m_sr > a.S) myerr |= MOONEP_ERR_HIST;
    if (tid == rank && m_sr != a.s) myerr |= MOONEP_ERR_HIST;
    if (total0 == -1) {
      if (m_tr != -1 || m_sr != a.s) myerr |= MOONEP_ERR_HIST;
    } else {
      if (m_tr != total0) myerr |= MOONEP_ERR_HIST;
      atomicAdd(&misc[2], clamp_i(m_sr, 0, a.S));    // <= R*S < 2^31
    }
  }
  if (myerr) atomicOr(&misc[0], myerr);
  wstamp<NJ>(a, 0);
  __syncthreads();                                   // sums, row sums, error bits complete
  stamp(a, 2);
  if (plan_stop(a) == 1) return;

  // Caps: an invalid histogram plans as an empty one (nothing moves, every count 0).
  auto total_T = [&](bool valid_) -> int {           // < 2^31 (host: R*S*K < 2^31)
    const long long Tll = (valid_ && total0 != -1) ? static_cast<long long>(total0) * a.K
                                                   : static_cast<long long>(R) * a.s * a.K;
    return static_cast<int>(Tll);
  };

  // Packed keys: value << ib | index-part in one u32, so one warp reduction gives the first
  // argmax / argmin.  Valid whenever the values (balances + T, quotas, counts: all in [0, 2T])
  // leave room for the index bits; else the two-reduction paths.
  const int ibR = ceil_log2(R), ibB = ceil_log2(B);
  const unsigned MR = (1u << ibR) - 1u, MB = (1u << ibB) - 1u;
  // The batched split (split_batches) needs a warp per rank to sort during step 1, one quota
  // key per lane (R <= 32) and B <= 64.
  // Scratch for the sorted keys: slotoff, [R, B], written by the layout (step 3) before
  // anything reads it there.
  // Diagnostics stops 198 and 199 (tests, benchmarks) turn every shortcut off: greedy loops
  // round by round.  Always on in the production build (plan_stop: 99).
  const bool shortcuts = plan_stop(a) != 198 && plan_stop(a) != 199;
  const bool batch_ok = shortcuts && NJ == 1 && B <= 64 &&
                        sorting_warps_fit(R, nwarps);

  const CostSmem cs = cost_smem(smem_raw + group_smem_base(R, E), R);   // policy "cost" only
  // ---- 1. validity, group loads, rank_quotas: all in warp 0, no block barrier -----------------
  if (warp == 0) {
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
    const int T = total_T(vq);
    const int cap_base = T / R, cap_extra = T % R;
    if (!vq) {
      for (int i = lane; i < E; i += 32) { remE[i] = 0; beforeS[i] = 0; ownS[i] = 0; }
    }
    int don[NJ], z[NJ];
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
    if constexpr (NJ <= 2 && kCost) {
      // Policy "cost"'s MoonEP candidate: its critical donors, and its max load (every rank at
      // its cap).  Warp 0's scratch row is free until the barrier.
      if (vq) {
        cost_critical<NJ>(don, R, B, cs.wrem, cs.crit + kCostMoonRow * R,
                          cs.ncrit + kCostMoonRow);
        if (lane == 0) {
          cs.feas[kCostMoonRow] = 1;
          cs.mload[kCostMoonRow] = cap_base + (cap_extra > 0 ? 1 : 0);
        }
      }
    }
  } else if (batch_ok && (warp & 3) != 0 && warp - 1 - (warp >> 2) < R) {
    // Idle during step 1: sort rank h's expert keys, on warps outside warp 0's scheduler
    // (warp % 4 != 0: warps 1, 2, 3, 5, ... for h = 0, 1, 2, 3, ...), so warp 0's dependent
    // chain does not share issue slots with them.  An invalid histogram: no donor uses them.
    const int h = warp - 1 - (warp >> 2);
    // Only a donor's keys are read: a rank whose group exceeds T / R (its cap is >= that).
    // The other sorting warps leave the schedulers to the donors' (-110 cycles at R = 8; the
    // check is a multiply, as a division it would cost more than it saves).
    const int* rh = remE + h * B;
    const unsigned g2 = (lane < B ? rh[lane] : 0) + (lane + 32 < B ? rh[lane + 32] : 0);
    const long long g = static_cast<long long>(__reduce_add_sync(kFull, g2));
    if (g * R > total_T(true))
      sort_expert_keys(rh, B, ibB, MB, reinterpret_cast<unsigned*>(slotoff) + h * B);
  }
  // Policy "cost", the level quotas (see cost_warp): the kCostLevels levels even .. hi evenly
  // on the candidate warps, during step 1.  On an invalid histogram (warp 0 may be zeroing remE
  // meanwhile) the results are garbage and unused: the search is skipped after the barrier.
  if constexpr (NJ <= 2 && kCost) {
    const int cwarp = cost_warp(warp, nwarps);
    if (cwarp >= 0)
      cost_levels<NJ>(cs, remE, R, B, total_T(true), cwarp, cost_cwarps(nwarps), a.slack_ppm,
                      plan_stop(a) != 199);
  }
  if (warp == nwarps - 1 && lane == 0) {
    // nvs_s for either validity.  T = R*s*K (uniform s, or an invalid histogram) is the host's;
    // only per-rank s needs it here.
    int nv = a.nvs_uni;
    if (total0 != -1)
      nv = nvs_of(static_cast<unsigned>(total_T(true)), R, tp, B, a.NvS, a.slack_ppm);
    misc[5] = nv;
    misc[6] = a.nvs_uni;
  }
  wstamp<NJ>(a, 1);
  __syncthreads();
  stamp(a, 3);
  const bool valid = misc[3] != 0;
  const int T = total_T(valid);
  const int nvs_s = valid ? misc[5] : misc[6];
  if (plan_stop(a) == 2) return;

  // Policy "cost", the splits and the choice.  All warps split the (candidate, critical donor)
  // pairs of the levels and of MoonEP's plan (step 1's quotas); warp 0 scores the candidates,
  // picks the first minimum, and its quotas replace step 1's outputs, so steps 2-4 below plan
  // it.  An invalid histogram
  // plans as MoonEP's plan of the empty one (as without the policy).
  if constexpr (NJ <= 2 && kCost) {
    if (valid)
      cost_search<NJ>(a, cs, remE, donor_of, z_of, rmask, donors, misc, R, B, T, a.replica_cost,
                      plan_stop(a) != 199);
  }

  // ---- 2. split_quotas (one warp per donor; the last warp lists the receivers meanwhile) -------
  const int ndon = misc[1];
  const int ib2 = max(ibR, ibB);
  const bool packed2 =
      plan_stop(a) != 199 && B <= 64 && static_cast<long long>(T) < (1ll << (31 - ib2));
  const int nsplit = nwarps > 1 ? nwarps - 1 : 1;
  if (warp == nwarps - 1 && nwarps > 1) {
    // Receivers grouped by donor in ascending rank (rbeg[h], rcnt[h]), and hpos[h], the number
    // of h's receivers below h (where its home piece goes among its experts' pieces).
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
  for (int k = warp; k < ndon && warp < nsplit; k += nsplit) {
    const int h = donors[k];
    int* rem = remE + h * B;                         // lane-owned entries le = lane + 32 i
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
        const unsigned* sk = reinterpret_cast<const unsigned*>(slotoff) + h * B;
        if (__popc(act) <= 8 && (__reduce_max_sync(kFull, kq[0]) >> ibR) >= (sk[0] >> ibB)) {
          if (split_batches(kq[0], act, sk, rem, pcnt + h * B, recv, B, ibR, ibB, MR, MB))
            continue;                                // every quota filled: rem, pcnt are final
          if (lane < B) n0 = pcnt[h * B + lane];
          if (lane + 32 < B) n1 = pcnt[h * B + lane + 32];
        }
      }
      unsigned kr0 = lane < B ? expert_key(rem[lane], lane, ibB, MB) : 0u;
      unsigned kr1 = lane + 32 < B ? expert_key(rem[lane + 32], lane + 32, ibB, MB) : 0u;
      // One expert serving many quotas (hot at R = 64); scratch: offL, overwritten by step 3.
      if (NJ <= 2 && k < B && shortcuts)
        split_one_expert_steps<NJ>(kq, kr0, kr1, n0, n1, recv, B, ibR, ibB, MR, MB,
                                   reinterpret_cast<unsigned*>(offL) + k * R);
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
        if (lane == 0)                               // d's single donor is h: no other writer
          recv[static_cast<int>(MR - (KQ & MR)) * B + static_cast<int>(MB - (KR & MB))] = static_cast<int>(t);
      }
      if (lane < B) { rem[lane] = static_cast<int>(kr0 >> ibB); pcnt[h * B + lane] = n0; }
      if (lane + 32 < B) { rem[lane + 32] = static_cast<int>(kr1 >> ibB); pcnt[h * B + lane + 32] = n1; }
      continue;
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
  wstamp<NJ>(a, 2);
  __syncthreads();
  stamp(a, 4);
  if (plan_stop(a) == 3) return;

  // ---- 3. layout (one warp per destination) ---------------------------------------------------
  const unsigned lt_mask = (1u << lane) - 1u;
  const int NvS = a.NvS;
  // Each lane scans a contiguous run of experts in two passes unrolled by 4 (loads in flight
  // together; a fully unrolled pass spills at 1024 threads), well within the layout's time.
  const bool spare = R < nwarps;
  if (spare && warp == nwarps - 1) {
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
    if (lane == 31) misc[4] = incl;
  }
  for (int d = warp; d < R; d += nwarps) {
    const int h = donor_of[d];
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
      nrem[d] = ns;
      if (h >= 0) atomicAdd(&copies[h], ns);
      if (run > nvs_s) atomicOr(a.err, MOONEP_ERR_PLAN);      // impossible for a valid plan
    }
  }
  wstamp<NJ>(a, 3);
  __syncthreads();
  stamp(a, 5);
  if (plan_stop(a) == 4) return;

  // ---- 4. per-expert pieces (CSR) for the slot assignment -------------------------------------
  // Pieces of e = h*B + le in rank order: the slot pieces on h's receivers below h, the home
  // piece at d = h, the slot pieces on h's receivers above h.  Counts came from the split (moves)
  // and the layout (home piece); the receiver lists from the last warp of step 2.
  const int npieces_total = spare ? misc[4] : block_excl_scan(pcnt, E, wsum);   // <= 2E
  // A thread per expert walks its donor's receivers in one unrolled chunk when they are few
  // (<= kFewReceivers: every donor at R <= 9); a donor with more has a warp per expert (below).
  constexpr int kFewReceivers = 8;
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
  // A donor with many receivers: a warp per expert, lanes over the n receivers and the home
  // piece (position hp of n + 1), the row offsets by a warp scan.  One thread walking the hot
  // expert's 59 receivers is the kernel's last warp at R = 64 hot (~10k cycles; warp stamps);
  // a warp per expert for every donor costs more than it saves at R = 8.
  // The donors with many receivers are found 32 at a time by a ballot (at R = 64 zipf, walking
  // all 17 donors' 272 experts to skip most of them cost ~3k cycles).
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
  if (tid == 0) {
    a.pstart[E] = npieces_total;
    a.stats[0] = min(nrem[rank], B);
    a.stats[1] = copies[rank];
    a.scalars[0] = nvs_s;
    a.scalars[1] = valid ? 1 : 0;
  }
  stamp(a, 6);
  wstamp<NJ>(a, 4);
}

// ---------------------------------------------------------------------------------------------
// Launch 2: slots of one chunk of this rank's entries
// ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(1024) plan_assign_kernel(AssignArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int W = nthr >> 5;
  const int E = a.E;
  int* base = reinterpret_cast<int*>(smem_raw);      // [E] rank of the chunk's first entry of e
  int* uptoS = base + E;                             // [E]
  int* cntw = uptoS + E;                             // [W, E] per-warp counts, then prefixes
  int* sdest = cntw + W * E;                         // [W*32*J] destination of each entry
  int* pstart = sdest + W * 32 * kAssignJ;           // [E+1]
  int* pend = pstart + E + 1;                        // [2E]
  int* pdst = pend + 2 * E;                          // [2E]
  int* pbase = pdst + 2 * E;                         // [2E]
  int* s_err = pbase + 2 * E;
  const int b = blockIdx.x;
  const int c0 = b * a.C;
  const int Cb = min(a.C, a.N - c0);

  int myerr = 0;
  int er[kAssignJ];
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {               // this lane's entries, loads first
    const int p = (warp * kAssignJ + j) * 32 + lane;
    er[j] = p < Cb ? __ldg(a.topk + c0 + p) : -1;
  }
  if (tid == 0) *s_err = 0;
  for (int e = tid; e < E; e += nthr) {
    int acc = a.before[e];
    int c = 0;
    for (; c + 8 <= b; c += 8) {
      int x[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) x[u] = a.chunkcnt[static_cast<size_t>(c + u) * E + e];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc += x[u];
    }
    for (; c < b; ++c) acc += a.chunkcnt[static_cast<size_t>(c) * E + e];
    base[e] = acc;
    uptoS[e] = a.upto[e];
  }
  const int np_total = min(a.pstart[E], 2 * E);
  for (int i = tid; i <= E; i += nthr) pstart[i] = min(a.pstart[i], np_total);
  for (int i = tid; i < np_total; i += nthr) { pend[i] = a.pend[i]; pdst[i] = a.pdst[i]; pbase[i] = a.pbase[i]; }
  for (int i = tid; i < W * E; i += nthr) cntw[i] = 0;
  __syncthreads();

  int rk[kAssignJ];
  int* myc = cntw + warp * E;
  const unsigned lt_mask = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {               // in flat-index order within the warp
    const int p = (warp * kAssignJ + j) * 32 + lane;
    const bool act = p < Cb;
    int e = -1;
    if (act) {
      const int x = er[j];
      if (x < 0 || x >= E) myerr |= MOONEP_ERR_BAD_IDS;
      e = clamp_i(x, 0, E - 1);
    }
    const unsigned peers = __match_any_sync(kFull, e);
    const int cur = act ? myc[e] : 0;
    __syncwarp();
    if (act && lane == 31 - __clz(peers)) myc[e] = cur + __popc(peers);
    __syncwarp();
    er[j] = e;
    rk[j] = cur + __popc(peers & lt_mask);
  }
  __syncthreads();
  for (int e = tid; e < E; e += nthr) {              // exclusive prefix over warps + base
    int run = base[e];
    for (int w = 0; w < W; ++w) {
      const int t = cntw[w * E + e];
      cntw[w * E + e] = run;
      run += t;
    }
  }
  __syncthreads();

  const int nvs_s = a.scalars[0];
  const int R = a.R, NvS = a.NvS;
  int dv[kAssignJ], dd[kAssignJ];
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {
    const int p = (warp * kAssignJ + j) * 32 + lane;
    dv[j] = 0;
    dd[j] = 0;
    if (p < Cb) {
      const int e = er[j];
      const int gr = myc[e] + rk[j];                 // global rank: (source rank, flat index)
      if (gr >= uptoS[e]) myerr |= MOONEP_ERR_HIST;  // hist[rank] is not bincount(topk)
      const int first = pstart[e], last = max(first, pstart[e + 1]);
      int lo = first, hi = last;                     // first piece with end > gr
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (pend[mid] > gr) hi = mid; else lo = mid + 1;
      }
      int d, loff;
      if (lo < last) {
        d = pdst[lo];
        loff = pbase[lo] + gr;
      } else {                                       // only for invalid input
        myerr |= MOONEP_ERR_PLAN;
        d = last > first ? pdst[last - 1] : e / a.B;
        loff = 0;
      }
      if (loff < 0 || loff >= nvs_s) { myerr |= MOONEP_ERR_PLAN; loff = clamp_i(loff, 0, nvs_s - 1); }
      d = clamp_i(d, 0, R - 1);
      sdest[p] = d;
      dd[j] = d;
      dv[j] = d * NvS + loff;
    }
  }
  __syncthreads();
  const int K = a.K;
#pragma unroll
  for (int j = 0; j < kAssignJ; ++j) {
    const int p = (warp * kAssignJ + j) * 32 + lane;
    if (p < Cb) {
      const int k = p % K;                           // chunks start at token boundaries
      bool dup = false;
      for (int q = 1; q <= k; ++q) dup |= sdest[p - q] == dd[j];
      a.dst[c0 + p] = dup ? -dv[j] - 1 : dv[j];
    }
  }
  if (myerr) atomicOr(s_err, myerr);
  __syncthreads();
  if (tid == 0 && *s_err) atomicOr(a.err, *s_err);
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

thread_local char g_where[256];
// The histogram load's warp tiles (load_hist_tiles): NC columns per lane (E >= 1024: 8, >= 256:
// 4, >= 64: 2, else 1), column blocks of 32*NC, rows split so the tiles cover about one per warp.
// On the host: four dependent integer divisions the kernel's critical path no longer pays.
void load_tiling(int R, int E, int nwarps, GroupArgs& ga) {
  const int nc = E >= 1024 ? 8 : E >= 256 ? 4 : E >= 64 ? 2 : 1;
  const int ncb = (E + 32 * nc - 1) / (32 * nc);
  int nrb = std::max(1, std::min(R, nwarps / ncb));
  const int NR = (R + nrb - 1) / nrb;
  nrb = (R + NR - 1) / NR;
  ga.ld_nc = nc; ga.ld_ncb = ncb; ga.ld_NR = NR; ga.ld_ntiles = ncb * nrb;
  // __umulhi(2 t, ceil(2^31 / ncb)) == t / ncb for t, ncb <= 1024 (checked exhaustively)
  ga.ld_ncb_mul = static_cast<unsigned>(((1ull << 31) + ncb - 1) / ncb);
}

#ifdef MOONEP_DIAGNOSTICS
int g_debug_stop = 99;           // moonep_plan_debug_stop
long long* g_stamps = nullptr;   // moonep_plan_debug_stamps
long long* g_wstamps = nullptr;  // moonep_plan_debug_warp_stamps
int g_pdl = 1;                   // moonep_plan_debug_pdl: the group kernel with PDL (A/B)
#endif

int bad_arg(const char* fmt, int v0, int v1 = 0) {
  std::snprintf(g_where, sizeof(g_where), fmt, v0, v1);
  return moonep_ep::fail(cudaErrorInvalidValue, g_where);
}

// Raise a kernel's dynamic shared memory limit once per device (no stream work: capture-safe).
template <typename Kern>
cudaError_t ensure_smem(Kern kern, int slot, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  static int done[16][64] = {};                      // [kernel slot][device]: bytes set so far
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 64 && done[slot][dev] >= static_cast<int>(bytes)) return cudaSuccess;
  int optin = 0;
  e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  if (bytes > static_cast<size_t>(optin)) return cudaErrorInvalidValue;
  e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
  if (e == cudaSuccess && dev < 64) done[slot][dev] = optin;
  return e;
}

int check_sizes(int s, int K, int rank, int R, int E, int S, int tp, int NvS, int ppm,
                long long rc) {
  if (R < 1 || R > kMaxR) return bad_arg("moonep_plan: R=%d outside [1, 1024]", R);
  if (E < R || E % R) return bad_arg("moonep_plan: E=%d must be a positive multiple of R=%d", E, R);
  if (K < 1 || K > kMaxK) return bad_arg("moonep_plan: K=%d outside [1, 127]", K);
  if (S < 1 || s < 1 || s > S) return bad_arg("moonep_plan: s=%d outside [1, S=%d]", s, S);
  if (rank < 0 || rank >= R) return bad_arg("moonep_plan: rank=%d outside [0, R=%d)", rank, R);
  if (tp < 1) return bad_arg("moonep_plan: token_padding=%d < 1", tp);
  if (static_cast<long long>(R) * S * K >= (1ll << 31))
    return bad_arg("moonep_plan: R*S*K >= 2^31 (R=%d, S=%d)", R, S);
  if (ppm < 0 || ppm > kPPM) return bad_arg("moonep_plan: slack_ppm=%d outside [0, 10^6]", ppm);
  if (rc < 0) return bad_arg("moonep_plan: replica_cost < 0%.0d", 0);
  if (rc >= (1ll << 40)) return bad_arg("moonep_plan: replica_cost >= 2^40 token copies%.0d", 0);
  if (ppm > 0 && (R > kCostMaxR || E / R > kCostMaxB))
    return bad_arg("moonep_plan: policy cost on the device needs R <= 64 and E/R <= 256 "
                   "(R=%d, E/R=%d)", R, E / R);
  const long long G = 2ll * (E / R);
  // With a slack a rank receives up to slack_cap(S*K) copies (Geometry.NvS).
  const long long SK = ppm > 0 ? slack_cap(static_cast<long long>(S) * K, ppm)
                               : static_cast<long long>(S) * K;
  const long long need = (SK + (tp - 1) * G + tp - 1) / tp * tp;
  if (NvS < need || static_cast<long long>(R) * NvS >= (1ll << 31))
    return bad_arg("moonep_plan: NvS=%d below the geometry's NvS or R*NvS >= 2^31 (R=%d)", NvS, R);
  return 0;
}

// ensure_smem's slot of each group kernel instance (the assign kernel has kAssignSlot)
constexpr int kAssignSlot = 6;
template <int NJ, int NT, bool kCost>
constexpr int group_slot() {
  return (kCost ? 8 : 0) + (NT != kGroupThreads ? 7
         : NJ == 1 ? 0 : NJ == 2 ? 1 : NJ == 4 ? 2 : NJ == 8 ? 3 : NJ == 16 ? 4 : 5);
}

template <int NJ, int NT, bool kCost>
cudaError_t ensure_group_smem(size_t bytes) {
  return ensure_smem(plan_group_kernel<NJ, NT, kCost>, group_slot<NJ, NT, kCost>(), bytes);
}

template <int NJ, int NT = kGroupThreads, bool kCost = false>
int launch_group(GroupArgs ga, int grid, size_t smem, cudaStream_t stream) {
  load_tiling(ga.R, ga.E, NT / 32, ga);
  cudaError_t e = ensure_group_smem<NJ, NT, kCost>(smem);
  if (e != cudaSuccess) return moonep_ep::fail(e, "moonep_plan: shared memory for the group kernel");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(NT);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
#ifdef MOONEP_DIAGNOSTICS
  cfg.numAttrs = g_pdl ? 1 : 0;
#else
  cfg.numAttrs = 1;
#endif
  e = cudaLaunchKernelEx(&cfg, plan_group_kernel<NJ, NT, kCost>, ga);
  if (e != cudaSuccess) return moonep_ep::fail(e, "moonep_plan: group kernel launch");
  return moonep_ep::fail(cudaGetLastError(), "moonep_plan: group kernel launch");
}

int run_plan(const int32_t* hist, const int32_t* topk, int s, int K, int rank, int R, int E, int S,
             int tp, int NvS, int ppm, long long rcost, int32_t* dst, int32_t* cu, int32_t* etc,
             int32_t* zf, int32_t* stats, void* ws, size_t ws_bytes, int32_t* err,
             cudaStream_t stream, bool assign) {
  if (int bad = check_sizes(s, K, rank, R, E, S, tp, NvS, ppm, rcost)) return bad;
  if (!hist || !cu || !etc || !zf || !stats || !ws || !err || (assign && (!topk || !dst)))
    return bad_arg("moonep_plan: null pointer argument (%d)", 0);
  const WsLayout L = ws_layout(R, E, s, K);
  if (ws_bytes < L.total)
    return bad_arg("moonep_plan: workspace of %d bytes is too small (need %d)",
                   static_cast<int>(ws_bytes > INT_MAX ? INT_MAX : ws_bytes),
                   static_cast<int>(L.total > INT_MAX ? INT_MAX : L.total));
  char* w = static_cast<char*>(ws);
  const Chunking ch = chunking(E, s, K);
  GroupArgs ga;
  ga.hist = hist; ga.topk = topk;
  ga.s = s; ga.K = K; ga.rank = rank; ga.R = R; ga.E = E; ga.B = E / R; ga.S = S; ga.tp = tp;
  ga.NvS = NvS;
  ga.cu = cu; ga.etc = etc; ga.zf = zf; ga.stats = stats;
  ga.pend = reinterpret_cast<int32_t*>(w + L.pend);
  ga.pdst = reinterpret_cast<int32_t*>(w + L.pdst);
  ga.pbase = reinterpret_cast<int32_t*>(w + L.pbase);
  ga.pstart = reinterpret_cast<int32_t*>(w + L.pstart);
  ga.before = reinterpret_cast<int32_t*>(w + L.before);
  ga.upto = reinterpret_cast<int32_t*>(w + L.upto);
  ga.scalars = reinterpret_cast<int32_t*>(w + L.scalars);
  ga.chunkcnt = reinterpret_cast<int32_t*>(w + L.chunkcnt);
  ga.C = ch.C; ga.N = s * K;
  // nvs_s of T = R*s*K (< 2^31: check_sizes); the kernel computes it only for per-rank s
  ga.nvs_uni = nvs_of(static_cast<unsigned>(R * s * K), R, tp, E / R, NvS, ppm);
  // slack_ppm = 0 is policy "cost" without slack, i.e. MoonEP (planner.plan_group): no search.
  ga.slack_ppm = ppm;
  // replica_cost = 0: the score is the max load, and MoonEP's, ceil(T/R), is the least any plan
  // has, so MoonEP wins or ties and wins the tie (docs/planner.md, "Reductions"): the search
  // would always pick it, so it is skipped (only the slack's NvS / nvs_s remain).
  ga.cost = ppm > 0 && rcost > 0 ? 1 : 0;
  ga.replica_cost = rcost;
  ga.err = err;
#ifdef MOONEP_DIAGNOSTICS
  ga.stop = g_debug_stop;
  ga.stamps = g_stamps;
  ga.wstamps = g_wstamps;
  const bool full = g_debug_stop >= 99;   // a stage stop launches no slot assignment
#else
  constexpr bool full = true;
#endif
  const size_t gsmem_g = group_smem_bytes(R, E, ga.cost != 0);
  const size_t gsmem_c = static_cast<size_t>(E) * 4;
  const size_t gsmem = gsmem_g > gsmem_c ? gsmem_g : gsmem_c;
  const int grid = assign && full ? 1 + ch.nchunks : 1;
  const int nj = (R + 31) / 32;
  int rc;
  if (ga.cost) {                                         // R <= 64: check_sizes
    if (sorting_warps_fit(R, kSmallGroupThreads / 32))
      rc = launch_group<1, kSmallGroupThreads, true>(ga, grid, gsmem, stream);
    else if (nj <= 1) rc = launch_group<1, kGroupThreads, true>(ga, grid, gsmem, stream);
    else rc = launch_group<2, kGroupThreads, true>(ga, grid, gsmem, stream);
  } else if (sorting_warps_fit(R, kSmallGroupThreads / 32))      // R <= 12
    rc = launch_group<1, kSmallGroupThreads>(ga, grid, gsmem, stream);
  else if (nj <= 1) rc = launch_group<1>(ga, grid, gsmem, stream);
  else if (nj <= 2) rc = launch_group<2>(ga, grid, gsmem, stream);
  else if (nj <= 4) rc = launch_group<4>(ga, grid, gsmem, stream);
  else if (nj <= 8) rc = launch_group<8>(ga, grid, gsmem, stream);
  else if (nj <= 16) rc = launch_group<16>(ga, grid, gsmem, stream);
  else rc = launch_group<32>(ga, grid, gsmem, stream);
  if (rc || !assign || !full) return rc;

  AssignArgs aa;
  aa.topk = topk; aa.N = s * K; aa.K = K; aa.R = R; aa.E = E; aa.B = E / R; aa.NvS = NvS;
  aa.C = ch.C;
  aa.pend = ga.pend; aa.pdst = ga.pdst; aa.pbase = ga.pbase; aa.pstart = ga.pstart;
  aa.before = ga.before; aa.upto = ga.upto;
  aa.scalars = ga.scalars; aa.chunkcnt = ga.chunkcnt;
  aa.dst = dst; aa.err = err;
  const size_t asmem = assign_smem_bytes(E, ch.W);
  cudaError_t e = ensure_smem(plan_assign_kernel, kAssignSlot, asmem);
  if (e != cudaSuccess) return moonep_ep::fail(e, "moonep_plan: shared memory for the assign kernel");
  plan_assign_kernel<<<ch.nchunks, ch.W * 32, asmem, stream>>>(aa);
  return moonep_ep::fail(cudaGetLastError(), "moonep_plan: assign kernel launch");
}

}  // namespace

// Every planner kernel's shared-memory limit raised now, on the current device, so a Buffer's
// first dispatch makes no cudaFuncSetAttribute call.  SymmBackend calls this when a Buffer is
// built.  (It was written against the fresh-process virtual-rank timeouts of docs/multi_gpu.md;
// measured on the H200, it does not remove them.)
MOONEP_EXPORT int moonep_plan_prepare() {
  constexpr size_t kAbove = 48 * 1024 + 1;   // any size above the default: sets the opt-in max
  cudaError_t e = cudaSuccess;
  // every instance launch_group / run_plan can launch
  for (cudaError_t r : {ensure_group_smem<1, kGroupThreads, false>(kAbove),
                        ensure_group_smem<2, kGroupThreads, false>(kAbove),
                        ensure_group_smem<4, kGroupThreads, false>(kAbove),
                        ensure_group_smem<8, kGroupThreads, false>(kAbove),
                        ensure_group_smem<16, kGroupThreads, false>(kAbove),
                        ensure_group_smem<32, kGroupThreads, false>(kAbove),
                        ensure_group_smem<1, kSmallGroupThreads, false>(kAbove),
                        ensure_group_smem<1, kGroupThreads, true>(kAbove),
                        ensure_group_smem<2, kGroupThreads, true>(kAbove),
                        ensure_group_smem<1, kSmallGroupThreads, true>(kAbove),
                        ensure_smem(plan_assign_kernel, kAssignSlot, kAbove)})
    if (e == cudaSuccess) e = r;
  return moonep_ep::fail(e, "moonep_plan_prepare");
}

MOONEP_EXPORT size_t moonep_plan_workspace_bytes(int R, int E, int s, int K) {
  if (R < 1 || E < R || E % R || s < 1 || K < 1 || K > kMaxK) return 0;
  return ws_layout(R, E, s, K).total;
}

MOONEP_EXPORT int moonep_plan(const int32_t* hist_RX, const int32_t* topk_sK, int s, int K,
                              int rank, int R, int E, int S, int token_padding, int NvS,
                              int slack_ppm, int64_t replica_cost, int32_t* dst_N,
                              int32_t* cu_G, int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
                              void* workspace, size_t workspace_bytes, int32_t* err,
                              cudaStream_t stream) {
  return run_plan(hist_RX, topk_sK, s, K, rank, R, E, S, token_padding, NvS, slack_ppm,
                  replica_cost, dst_N, cu_G, etc_RB, zf_G2, stats_2, workspace, workspace_bytes,
                  err, stream, true);
}

MOONEP_EXPORT int moonep_plan_group(const int32_t* hist_RX, int s, int K, int rank, int R, int E,
                                    int S, int token_padding, int NvS, int slack_ppm,
                                    int64_t replica_cost, int32_t* cu_G,
                                    int32_t* etc_RB, int32_t* zf_G2, int32_t* stats_2,
                                    void* workspace, size_t workspace_bytes, int32_t* err,
                                    cudaStream_t stream) {
  return run_plan(hist_RX, nullptr, s, K, rank, R, E, S, token_padding, NvS, slack_ppm,
                  replica_cost, nullptr, cu_G, etc_RB, zf_G2, stats_2, workspace, workspace_bytes,
                  err, stream, false);
}

#ifdef MOONEP_DIAGNOSTICS
// Diagnostics hooks (moonep_ep.h): process-wide, read by the next launches.
MOONEP_EXPORT void moonep_plan_debug_stop(int stop) { g_debug_stop = stop; }

MOONEP_EXPORT void moonep_plan_debug_pdl(int on) { g_pdl = on != 0; }

MOONEP_EXPORT void moonep_plan_debug_stamps(void* dev_int64x8) {
  g_stamps = static_cast<long long*>(dev_int64x8);
}

MOONEP_EXPORT void moonep_plan_debug_warp_stamps(void* dev_int64x160) {
  g_wstamps = static_cast<long long*>(dev_int64x160);
}
#endif  // MOONEP_DIAGNOSTICS
