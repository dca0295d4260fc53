// Internal to the device planner (not part of libmoonep_ep.so's ABI): the constants, sizes,
// argument structs, shared-memory layouts and device helpers that its files share.  The files,
// one job each (the algorithm: docs/planner.md):
//   plan_kernels.cu       the C ABI (moonep_plan*, moonep_ep.h): argument checks, the workspace,
//                         which instances run;
//   plan_group.cuh        launch 1, plan_group_kernel: the whole group's plan, stage by stage;
//   plan_hist.cuh         its stage 0 (histogram load and validation) and its counting blocks;
//   plan_quotas.cuh       step 1, the rank quotas;
//   plan_split.cuh        step 2, the split of each donor's quotas into expert chunks;
//   plan_cost.cuh         policy "cost": the level plans, their scores and the choice;
//   plan_layout.cuh       steps 3-4, the layout and the pieces table;
//   plan_group_moonep.cu, plan_group_cost.cu   the group kernel's instances of each policy;
//   plan_assign.cu        launch 2, plan_assign_kernel: every entry's slot.
//
// Integer widths: the torch planner computes in int64; every value here is bounded by the total
// number of entries T <= R*S*K < 2^31 (host-checked, and R*NvS < 2^31), or by a row offset
// < NvS, so int32 is exact for every histogram that passes validation.  Validation row sums are
// exact whenever every count is in [0, S*K] (32-bit when E*(S*K+1) < 2^32, else 16-bit halves),
// and a count outside that range is flagged by itself, so garbage cannot alias a valid histogram.
// Shape letters: docs/architecture.md, "Shape legend"; the local scalars of these files differ:
// T is the group's token copies (the legend's T*K), C a chunk's entries and P a pieces-table size.
#pragma once
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "ep_internal.h"
#include "pdl.cuh"

namespace moonep_ep::plan {

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

// The group kernel's shared memory (GroupSmem below: 7E + 1 + 10R + R*RW + 42 ints) without
// policy "cost"'s area (a 16-byte multiple: that area starts right after it).
__host__ __device__ inline size_t group_smem_base(int R, int E) {
  const size_t RW = (R + 31) / 32;
  return (4 * (7 * static_cast<size_t>(E) + 1 + 10 * static_cast<size_t>(R) +
               static_cast<size_t>(R) * RW + 48) + 15) & ~static_cast<size_t>(15);
}

// The group kernel's own shared memory, carved by group_smem (group_smem_base bytes).
struct GroupSmem {
  int* remE;        // [E]  cnt, then tokens left at home
  int* beforeS;     // [E]  sum_{r < rank} hist[r, e]
  int* ownS;        // [E]  hist[rank, e]
  int* recv;        // [R, B] tokens of donor(d)'s expert on d
  int* offL;        // [E]  home segment start of e (-1: empty)
  int* slotoff;     // [R, B] slot segment start on d
  int* pcnt;        // [E+1] pieces per expert -> CSR starts
  unsigned* rowlo;  // [R] row sums (low part)
  unsigned* rowhi;  // [R] row sums (high part)
  unsigned* rmask;  // [R, RW] receivers of each donor
  int* donor_of;    // [R]
  int* z_of;        // [R]
  int* srow;        // [R]  s_r of each row
  int* nrem;        // [R]
  int* copies;      // [R]
  int* donors;      // [R]
  int* hpos;        // [R]  receivers of h below h
  int* rlist;       // [R]  receivers grouped by donor, ascending
  int* wsum;        // [34]
  int* misc;        // [8]: err bits, ndonors, sum of s_r, valid, pieces total (spare-warp scan),
                    //      nvs_s if valid, nvs_s if not
  int* rbeg;        // [R]  after validation (rowlo's words): start in rlist
  int* rcnt;        // [R]  after validation (rowhi's words): receivers of h
};

__device__ __forceinline__ GroupSmem group_smem(unsigned char* smem_raw, int R, int E) {
  const int RW = (R + 31) / 32;
  GroupSmem g;   // one chain of offsets (a carving helper's pointer added spills: 0 -> 40 B, NJ 2)
  g.remE = reinterpret_cast<int*>(smem_raw);  g.beforeS = g.remE + E;  g.ownS = g.beforeS + E;
  g.recv = g.ownS + E;  g.offL = g.recv + E;  g.slotoff = g.offL + E;  g.pcnt = g.slotoff + E;
  g.rowlo = reinterpret_cast<unsigned*>(g.pcnt + E + 1);  g.rowhi = g.rowlo + R;
  g.rmask = g.rowhi + R;  g.donor_of = reinterpret_cast<int*>(g.rmask + R * RW);
  g.z_of = g.donor_of + R;  g.srow = g.z_of + R;  g.nrem = g.srow + R;  g.copies = g.nrem + R;
  g.donors = g.copies + R;  g.hpos = g.donors + R;  g.rlist = g.hpos + R;  g.wsum = g.rlist + R;
  g.misc = g.wsum + 34;
  g.rbeg = reinterpret_cast<int*>(g.rowlo);
  g.rcnt = reinterpret_cast<int*>(g.rowhi);
  return g;
}

// Every entry of the group kernel's own shared memory at its initial value (before the
// histogram is read: this overlaps the previous kernel under PDL).
__device__ __forceinline__ void clear_group_smem(const GroupSmem& sm, int R, int E) {
  const int tid = threadIdx.x, nthr = blockDim.x, RW = (R + 31) / 32;
  for (int i = tid; i < E; i += nthr) {
    sm.remE[i] = 0; sm.beforeS[i] = 0; sm.ownS[i] = 0; sm.recv[i] = 0; sm.offL[i] = -1;
    sm.slotoff[i] = 0; sm.pcnt[i] = 0;
  }
  for (int i = tid; i < R; i += nthr) {
    sm.rowlo[i] = 0; sm.rowhi[i] = 0; sm.donor_of[i] = -1; sm.z_of[i] = 0; sm.nrem[i] = 0;
    sm.copies[i] = 0; sm.hpos[i] = 0;
  }
  for (int i = tid; i < R * RW; i += nthr) sm.rmask[i] = 0u;
  if (tid < 8) sm.misc[tid] = 0;
  if (tid == 0) sm.pcnt[E] = 0;
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

// The group's token copies T (< 2^31: host R*S*K < 2^31) from the gathered total (total0, -1:
// uniform s).  An invalid histogram (valid false) plans as an empty one of uniform s.
__device__ __forceinline__ int group_copies(const GroupArgs& a, int total0, bool valid) {
  const long long Tll = (valid && total0 != -1) ? static_cast<long long>(total0) * a.K
                                                : static_cast<long long>(a.R) * a.s * a.K;
  return static_cast<int>(Tll);
}

__device__ __forceinline__ int warp_incl_scan(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// Ranks of this lane's NJ keys among the warp's 32 * NJ: rk[j] = the number of keys larger
// (kDesc) or smaller than ky[j] (unique keys: a sorted position).  Unrolled: the shuffles are
// independent, so their latency overlaps (a rolled loop paid it per key: 5.1k cycles at R = 64,
// measured).
template <int NJ, bool kDesc>
__device__ __forceinline__ void warp_key_ranks(const unsigned* ky, int* rk) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) rk[j] = 0;
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const unsigned v = __shfl_sync(kFull, ky[jj], l);
#pragma unroll
      for (int j = 0; j < NJ; ++j) rk[j] += (kDesc ? v > ky[j] : v < ky[j]) ? 1 : 0;
    }
  }
}

__device__ __forceinline__ int ceil_log2(int x) { return x <= 1 ? 0 : 32 - __clz(x - 1); }

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
// Host side: the launchers of the kernel files
// ---------------------------------------------------------------------------------------------

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

// ensure_smem's slot of each group kernel instance (the assign kernel has kAssignSlot)
constexpr int kAssignSlot = 6;
template <int NJ, int NT, bool kCost>
constexpr int group_slot() {
  return (kCost ? 8 : 0) + (NT != kGroupThreads ? 7
         : NJ == 1 ? 0 : NJ == 2 ? 1 : NJ == 4 ? 2 : NJ == 8 ? 3 : NJ == 16 ? 4 : 5);
}

// plan_group_moonep.cu, plan_group_cost.cu: launch the group kernel instance of the policy that
// fits R (policy cost: R <= kCostMaxR), or raise every instance's shared-memory limit to
// bytes' opt-in maximum.
int launch_group_moonep(GroupArgs ga, int grid, size_t smem, cudaStream_t stream);
int launch_group_cost(GroupArgs ga, int grid, size_t smem, cudaStream_t stream);
cudaError_t prepare_group_moonep(size_t bytes);
cudaError_t prepare_group_cost(size_t bytes);
// plan_assign.cu: launch 2 over the chunks of ch, or raise its shared-memory limit.
int launch_assign(const AssignArgs& aa, const Chunking& ch, cudaStream_t stream);
cudaError_t prepare_assign(size_t bytes);

#ifdef MOONEP_DIAGNOSTICS
extern int g_pdl;   // moonep_plan_debug_pdl: the group kernel with PDL (A/B); plan_kernels.cu
#endif

}  // namespace moonep_ep::plan
