// Host entry points of libmoonep_gemm.so and the one small "prep" kernel that runs before the
// CUTLASS grouped GEMM.  The prep kernel reads cu_seqlens on the device, so no group size ever
// reaches the host (no sync; the whole call can be captured in a CUDA graph).  It
//   1. turns cu_seqlens into per-group (start, count), clamped to [0, M] so that bad offsets can
//      never make the GEMM read or write out of bounds;
//   2. for wgrad, orders the groups largest first (LPT: a wgrad tile costs ~M_g, and the static
//      round-robin scheduler then balances better);
//   3. evaluates the cost model (same formulas as moonep_ops/gemm/cost_model.py) for every
//      candidate config at once, each on its share of block 0's threads, and picks the
//      cheapest (see prep_kernel for the parallel forms of the model and of the LPT sort);
//   4. writes the problem-shape / pointer / stride arrays, which do not depend on the config (in
//      block 1, beside block 0's choice; for wgrad it sorts the groups too); the fused kernel of
//      the call's family (gemm_kernel.cuh; configs.h: the configs of one cluster shape) then runs
//      the chosen config's branch, in one launch;
//   5. (blocks >= 2, at most 32) zeroes the output rows past cu_seqlens[G-1] for fwd and dgrad,
//      and the dW of empty groups for wgrad_lp.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>
#include <cstring>

#include "configs.h"
#include "moonep_gemm.h"
#include "selector.cuh"

namespace moonep {

extern const KindEntry kind_entry_fwd, kind_entry_dgrad, kind_entry_wgrad, kind_entry_wgrad_lp;
extern const KindEntry kind_entry_fwd_2x1, kind_entry_dgrad_2x1, kind_entry_wgrad_lp_2x1;

namespace {

thread_local char g_err[512] = "";

constexpr int kMaxGroups = 1024;
constexpr int kPrepThreads = 1024;  // block 0: one thread per group (G <= 1024)
constexpr int kWarps = kPrepThreads / 32;
// G <= 256 runs blocks of 256 threads (A/B against 1024: the prep kernel with the model on is
// 0.25-1.2 us shorter in 5 of 6 benchmark cases, e.g. fwd G = 64 at 512 rows 5.2 instead of 5.55
// us and wgrad_lp 4.55 instead of 5.7 us, and 0.15 us longer for wgrad_lp at G = 256; the choice
// takes 2.6-3.7k instead of 3.7-4.6k SM cycles: fewer warps to launch and to pass the barriers,
// and up to 255 registers a thread instead of 64).  Every phase works for any block that holds
// a thread per group and a warp per candidate.
constexpr int kSmallPrepThreads = 256;
static_assert(kPrepThreads % kSmallPrepThreads == 0 && kSmallPrepThreads >= 256,
              "the block holds a thread per group and >= one warp per candidate");
constexpr int kMaxSms = 1024;       // P <= 1024 (checked on the host)

// MOONEP_DIAG(statement): the statement in a diagnostics build (MOONEP_DIAGNOSTICS: the prep
// kernel's clock64 stamps, moonep_gemm.h), nothing in the production build.
#ifdef MOONEP_DIAGNOSTICS
#define MOONEP_DIAG(...) __VA_ARGS__
#else
#define MOONEP_DIAG(...)
#endif
constexpr size_t kAlign = 256;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Configs per kind: names and geometry from configs.h, kernels from the fused entries of the
// kind's families (family f's configs are [first[f], first[f] + n) of the kind); the two must
// agree config by config (checked once, reported by every call if not).
struct Registry {
  const KindEntry* fam[kNumKinds][kMaxFamilies] = {{&kind_entry_fwd, &kind_entry_fwd_2x1},
                                                   {&kind_entry_dgrad, &kind_entry_dgrad_2x1},
                                                   {&kind_entry_wgrad, nullptr},
                                                   {&kind_entry_wgrad_lp, &kind_entry_wgrad_lp_2x1}};
  int nfam[kNumKinds] = {};
  int first[kNumKinds][kMaxFamilies] = {};
  int famof[kNumKinds][kMaxConfigs] = {};  // family of config c
  const char* name[kNumKinds][kMaxConfigs] = {};
  ConfigGeom geom[kNumKinds][kMaxConfigs] = {};
  int n[kNumKinds] = {};
  unsigned swapmask[kNumKinds] = {};  // bit c: config c is swap-AB (nonzero: a second set of
                                      // strides)
  char mismatch[200] = "";
  Registry() {
#define MOONEP_REGISTER(KIND, NAME, ...) add(#KIND, #NAME, ConfigGeom{__VA_ARGS__});
    MOONEP_GEMM_CONFIGS(MOONEP_REGISTER)
    for (int k = 0; k < kNumKinds; ++k) {
      int total = 0;
      bool ok = true;
      for (int f = 0; f < kMaxFamilies && fam[k][f]; ++f) {
        first[k][f] = total;
        nfam[k] = f + 1;
        const KindEntry* e = fam[k][f];
        for (int c = 0; ok && c < e->n; ++c) {
          ok = total + c < n[k] && memcmp(&e->geoms[c], &geom[k][total + c], sizeof(ConfigGeom)) == 0;
          if (ok) famof[k][total + c] = f;
        }
        total += e->n;
      }
      ok = ok && total == n[k];
      // the configs of one swap class share one set of strides (prep writes one per class)
      for (int c = 0; ok && c < n[k]; ++c) {
        int c0 = 0;
        while (geom[k][c0].swap != geom[k][c].swap) ++c0;
        StrideBytes a{}, b{};
        strides(k, c0, 64, 128, 256, &a);
        strides(k, c, 64, 128, 256, &b);
        ok = memcmp(&a, &b, sizeof(a)) == 0;
      }
      if (!ok && !mismatch[0])
        snprintf(mismatch, sizeof(mismatch),
                 "kernel_*.cu and configs.h disagree on the configs of kind %d (rebuild)", k);
    }
  }
  const KindEntry* entry(int k, int c) const { return fam[k][famof[k][c]]; }
  int local(int k, int c) const { return c - first[k][famof[k][c]]; }
  size_t workspace_bytes(int k, int c, int G, int sm) const {
    return entry(k, c)->workspace_bytes(local(k, c), G, sm);
  }
  void strides(int k, int c, int M, int N, int K, StrideBytes* out) const {
    entry(k, c)->strides(local(k, c), M, N, K, out);
  }
  void add(const char* kind_name, const char* config, ConfigGeom g) {
    int k = strcmp(kind_name, "fwd") == 0     ? 0
            : strcmp(kind_name, "dgrad") == 0 ? 1
            : strcmp(kind_name, "wgrad") == 0 ? 2
                                              : 3;
    if (g.swap) swapmask[k] |= 1u << n[k];
    name[k][n[k]] = config;
    geom[k][n[k]++] = g;
  }
};

const Registry& registry() {
  static Registry r;
  return r;
}

struct Layout {  // byte offsets inside the call's workspace (stride[1]: swap-AB configs' strides)
  size_t chosen, shapes[kMaxConfigs], ptr[4], stride[2][4], cutlass[kMaxConfigs], total;
};

Layout layout(int kind, int G, int sm_count) {
  const Registry& reg = registry();
  Layout L{};
  size_t off = 0;
  L.chosen = off;
  off += kAlign;
  for (int c = 0; c < reg.n[kind]; ++c) {
    L.shapes[c] = off;
    off = align_up(off + (size_t)G * 3 * sizeof(int));
  }
  for (int i = 0; i < 4; ++i) {
    L.ptr[i] = off;
    off = align_up(off + (size_t)G * sizeof(void*));
  }
  for (int o = 0; o < (reg.swapmask[kind] ? 2 : 1); ++o)
    for (int i = 0; i < 4; ++i) {
      L.stride[o][i] = off;
      off = align_up(off + (size_t)G * 32);
    }
  for (int c = 0; c < reg.n[kind]; ++c) {
    L.cutlass[c] = off;
    off = align_up(off + reg.workspace_bytes(kind, c, G, sm_count));
  }
  L.total = off;
  return L;
}

// One candidate config of the device cost model: the config-dependent constants of
// cost_model.py's formulas, computed on the host (in double, rounded to float once).
struct Cand {
  int cfg;                    // config index
  // fwd/dgrad: rows per row tile, its log2 (-1: not a power of two), tiles per row tile.  The
  // row tiles of a group round up to the cluster's extent along the rows, so a row tile is a
  // whole cluster: plain bm = BM * CM rows, nt = CM * roundup(ceil(n_out / BN), CN); swap-AB
  // (tokens along N) bm = BN * CN, nt = CN * roundup(ceil(n_out / BM), CM)
  // (roundup(ceil(c/BN), CN) = CN * ceil(c/(BN*CN))).
  int bm, bm_shift, nt;
  int base, rem, d, Q, S, log2S;  // wgrad: t_w / P, t_w % P, gcd(rem, P), P / d, lanes per class
  unsigned magic_d;           // wgrad: udiv_small magic of d; fwd/dgrad: of bm (0: divide)
  float tau_sw, tau0;
  float tau, inv_bw;          // fwd/dgrad: tile time (us), us per byte
  float ca, cb, ma, mb;       // wgrad: a tile of a group of m rows costs max(m*ca + cb, m*ma + mb)
  float vol;                  // tie-break key (cost_model.mma_volume): fwd/dgrad BM*BN, to be
                              // multiplied by the tile count; wgrad t_w*BM*BN
};

struct PrepParams {  // the fields block 0 reads first come first (one or two constant-cache lines)
  int kind, G, M, P, ncand;
  int tc;             // threads per candidate in the model phases (a multiple of 32)
  int sx;             // wgrad ranks: threads per group in the cross-chunk phase (power of two <= 32)
  int nprefetch;      // 64-byte lines of this struct that block 0 touches at once
  unsigned magic_P, magic_tc;
  float wbytes, rbytes;  // fwd/dgrad: first-touch bytes of a group: wbytes + rows * rbytes
  float tie_hi;          // 1 + SELECT_TIE_TOL: predictions up to tie_hi * the fastest tie
  const int* cu;
  int* chosen_out;
  Cand cand[kMaxConfigs];  // ncand candidates (ncand == 1: forced, cand[0].cfg is the config)
  // problem arrays (block 1) and tails (blocks >= 2)
  int N, K, epn, nconf;
  int zero_groups;  // wgrad_lp: empty groups g < zero_groups are zeroed (G, or epn: keep slots)
  const char *A, *B, *B_slot;
  char *D, *D_slot;
  int* shapes[kMaxConfigs];
  const void** ptr[4];  // A, B, C, D (a swap config takes A and B exchanged)
  // [0]: the kind's plain configs, [1]: its swap-AB configs (fwd/dgrad: their shapes are
  // written transposed and their strides apart; stride[1] is null when the kind has none)
  long long* stride[2][4];
  long long sb[2][4][4];  // the stride of A, B, C, D (8-byte words; the same for every group)
  int sbw[2][4];          // words per stride
  unsigned swapmask;      // bit c: config c is swap-AB
};

__device__ __forceinline__ int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// x / d for x < 2^22 and 1 <= d <= 1024 (magic = ceil(2^32 / d), unused for d == 1)
__device__ __forceinline__ int udiv_small(int x, int d, unsigned magic) {
  return d == 1 ? x : (int)__umulhi((unsigned)x, magic);
}

// Rows [x, y) of group g from cu_seqlens, clamped to [0, M] so that bad offsets can never make
// the GEMM read or write out of bounds (an empty group has y == x).
__device__ __forceinline__ int2 group_rows(const int* cu, int g, int M) {
  const int start = g == 0 ? 0 : clampi(__ldg(cu + g - 1), 0, M);
  return make_int2(start, clampi(__ldg(cu + g), start, M));
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Inclusive warp scans of N values side by side: the N chains interleave, so no shuffle waits
// for another value's (one scan after the other, every shuffle waited for the previous one).
template <int N>
__device__ __forceinline__ void warp_scans(int (&v)[N], int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
#pragma unroll
    for (int c = 0; c < N; ++c) {
      const int u = __shfl_up_sync(0xffffffffu, v[c], off);
      if (lane >= off) v[c] += u;
    }
  }
}

// cost_model.pick on the device, candidate k in lane k < 8 (lanes past the candidates hold
// cost = vol = 3e38): among the candidates predicted within tie_hi of the fastest, the least MMA
// work, then the first listed.  Every lane returns lane 0's answer.
__device__ __forceinline__ int pick_lane(float cost, float vol, int lane, float tie_hi) {
  float fastest = cost;
  for (int off = 4; off > 0; off >>= 1)
    fastest = fminf(fastest, __shfl_xor_sync(0xffffffffu, fastest, off));
  float key = cost <= fastest * tie_hi ? vol : 3.0e38f;
  int best = lane;
  for (int off = 4; off > 0; off >>= 1) {
    const float ok = __shfl_xor_sync(0xffffffffu, key, off);
    const int ob = __shfl_xor_sync(0xffffffffu, best, off);
    if (ok < key || (ok == key && ob < best)) { key = ok; best = ob; }
  }
  return __shfl_sync(0xffffffffu, best, 0);
}

// fwd / dgrad: tiles of a group of c rows (c >= 0)
__device__ __forceinline__ int rows_tiles(const Cand& C, int c) {
  const int x = c + C.bm - 1;
  const int mt = C.bm_shift >= 0 ? x >> C.bm_shift
                                 : (C.magic_d ? udiv_small(x, C.bm, C.magic_d) : x / C.bm);
  return mt * C.nt;
}
// wgrad: cost of one tile of a group of m rows
__device__ __forceinline__ float wgrad_tile(const Cand& C, int m) {
  const float f = (float)m;
  return fmaxf(fmaf(f, C.ca, C.cb), fmaf(f, C.ma, C.mb));
}

// fwd/dgrad: the candidates whose tile scans run side by side (the launcher refuses more).  The
// rows kernel is compiled for 4, 5 and 6 chains and launched with the fewest that hold the
// candidates: a fifth chain on zeros costs the 4-candidate calls ~200 SM cycles.  The op's
// candidate sets hold at most 5 (moonep_ops/gemm/cost_model.py); 6 is a whole family 0 of
// fwd/dgrad (a mask with no valid bit, or MOONEP_GEMM_CANDIDATES).
constexpr int kScanCand = 6;

constexpr int kChunkPad = 33;  // sorted chunks of 32 groups, one word apart: no bank conflicts

// Shared memory (block-wide phases separated by __syncthreads):
//   cnt[g], start[g]       rows of group g (cnt = -1 past G: padding of the sort chunks)
//   fwd/dgrad: cb[g]       first-touch bytes of the groups before g (config-independent)
//              ts[k][g]    first linear tile of group g under candidate k
//   wgrad:     sorted[j]   rows of the j-th largest group (LPT order)
//              kc[33c + r], rin[g]   chunks of 32 groups sorted by the warps (rows; rank of g)
//              dw[k][m]    difference array of candidate k at CTA m * d (after the sort)
struct Smem {
  int cnt[kMaxGroups], start[kMaxGroups];
  union {
    struct {
      float cb[kMaxGroups];
      int ts[kMaxConfigs][kMaxGroups];
    } rows;
    struct {
      int sorted[kMaxGroups];
      union {
        struct {
          int kc[kWarps * kChunkPad], rin[kMaxGroups];
        } sort;
        float dw[kMaxConfigs][kMaxSms];
      } u;
    } wg;
    unsigned short empty[kMaxGroups];  // tail blocks of wgrad_lp
  } u;
  float wpart[kWarps], wtot[kWarps], wd0[kWarps], cost[kMaxConfigs];
  int wnz[kWarps], wtile[kMaxConfigs][kWarps], nempty, ttot[kMaxConfigs];
};

// Group g's copy of one set of strides (the same for every group): sbw[a] 8-byte words of sb[a]
// for A, B, C, D.
__device__ __forceinline__ void write_strides(long long* const (&dst)[4], const long long (&sb)[4][4],
                                              const int (&sbw)[4], int g) {
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int w = 0; w < 4; ++w)
      if (w < sbw[a]) dst[a][(long long)g * sbw[a] + w] = sb[a][w];
}

// The problem arrays of group g at position i of the order the GEMM runs (i == g for fwd/dgrad;
// LPT position for wgrad).  Strides are written separately (the same for every group).
__device__ __forceinline__ void write_group(const PrepParams& p, int i, int g, long long start,
                                            int cnt) {
  const int N = p.N, K = p.K, epn = p.epn;
  const long long wofs = (long long)(g < epn ? g : g - epn) * N * K;
  int s0, s1, s2;
  if (p.kind < 2) {  // fwd: (M_g, N, K); dgrad: (M_g, K, N); swap-AB: M and N exchanged
    p.ptr[0][i] = p.A + start * (p.kind == 0 ? K : N) * 2;
    p.ptr[1][i] = (g < epn ? p.B : p.B_slot) + wofs * 2;
    p.ptr[3][i] = p.D + start * (p.kind == 0 ? N : K) * 2;
    s0 = cnt; s1 = p.kind == 0 ? N : K; s2 = p.kind == 0 ? K : N;
  } else {  // wgrad: (N, K, M_g); empty groups get no tiles (fp32: unchanged; lp: zeroed)
    p.ptr[0][i] = p.A + start * N * 2;
    p.ptr[1][i] = p.B + start * K * 2;
    char* d = (g < epn ? p.D : p.D_slot) + wofs * (p.kind == 2 ? 4 : 2);
    p.ptr[2][i] = d;
    p.ptr[3][i] = d;
    s0 = cnt > 0 ? N : 0; s1 = K; s2 = cnt;
  }
  for (int c = 0; c < p.nconf; ++c) {
    int* sh = p.shapes[c] + 3 * i;
    const bool sw = (p.swapmask >> c) & 1u;
    sh[0] = sw ? s1 : s0;
    sh[1] = sw ? s0 : s1;
    sh[2] = s2;
  }
}

// Blocks >= 2: zero the output rows past cu_seqlens[G-1] (fwd, dgrad) or the dW of empty groups
// (wgrad_lp, which writes dW once with beta = 0: an empty group has no tiles).
__device__ __noinline__ void zero_tails(const PrepParams& p, Smem& sm) {
  const int G = p.G, M = p.M;
  const long long nthr = (long long)(gridDim.x - 2) * blockDim.x;
  const long long first_i = (long long)(blockIdx.x - 2) * blockDim.x + threadIdx.x;
  if (p.kind == 3) {
    // The empty groups are listed once per block in shared memory (every thread reading all of
    // cu[] from global memory, or looping over all G groups, cost ~20 / ~4 us at G = 256).
    if (threadIdx.x == 0) sm.nempty = 0;
    __syncthreads();
    const int g = threadIdx.x;  // G <= blockDim
    if (g < p.zero_groups) {
      const int2 rows = group_rows(p.cu, g, M);
      if (rows.y <= rows.x) sm.u.empty[atomicAdd(&sm.nempty, 1)] = (unsigned short)g;
    }
    __syncthreads();
    const long long per = (long long)p.N * p.K / 8;  // uint4 units of one bf16 [N, K]
    for (int e = 0; e < sm.nempty; ++e) {
      const int ge = sm.u.empty[e];
      uint4* out = reinterpret_cast<uint4*>((ge < p.epn ? p.D : p.D_slot) +
                                            (long long)(ge < p.epn ? ge : ge - p.epn) * per * 16);
      for (long long i = first_i; i < per; i += nthr) out[i] = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  if (p.kind == 2) return;
  const int cols = p.kind == 0 ? p.N : p.K;
  const long long first = (long long)clampi(__ldg(p.cu + G - 1), 0, M) * cols / 8;  // uint4 units
  const long long last = (long long)M * cols / 8;
  uint4* out = reinterpret_cast<uint4*>(p.D);
  for (long long i = first + first_i; i < last; i += nthr) out[i] = make_uint4(0, 0, 0, 0);
}

// Block 0 chooses the config, block 1 writes the problem arrays (the same for every config),
// blocks >= 2 zero the tails; the blocks run side by side.  In block 0 thread g reads group g,
// and candidate k of the cost model (cost_model.py's formulas) owns the threads
// [k * tc, (k + 1) * tc).  Every phase is O(log) or O(G/32) deep, with 3 (fwd/dgrad) or 5 (wgrad)
// block barriers in all.
//   fwd/dgrad: the tile counts of every candidate are scanned block-wide (warp scans, then the
//     warp totals around the first barrier); then every thread of a candidate takes rounds of
//     P tiles and finds the groups holding the round's first and last tile by binary search;
//     per-round roofline, summed.
//   wgrad: LPT order by ranks (blocks 0 and 1 both sort): each warp sorts its chunk of 32 groups
//     (brute force from shared memory), then a group's rank adds the count of beating groups in
//     every other chunk (binary searches, sx threads per group).  Model: group j (LPT order)
//     adds one tile more than base = t_w / P to the CTAs of the circular window
//     [j*rem, (j+1)*rem) mod P, rem = t_w % P.  The windows follow each other around the circle,
//     so the per-CTA sums come from a difference array with one entry per window start: at CTA
//     j*rem mod P, v_j - v_{j-1} (whole-circle wraps add v_j at CTA 0).  Windows j and j + Q
//     start at the same CTA (Q = P / gcd(rem, P)): class rho = j mod Q is summed by S lanes and
//     reduced by shuffles, so no atomics (32 lanes adding floats to one shared word serialise:
//     ~28 us at G = 256 once).  Entries sit at multiples of d = gcd(rem, P), and a CTA's window
//     sum is constant between them while its tile count only falls, so the max over CTAs is a
//     max over the Q points.
// NScan: the tile-scan chains of the rows kernel (>= ncand).
// RowsKind: fwd/dgrad (true) or wgrad (false), a kernel each: one function holding both models
// let the compiler trade one's unrolling against the other's (interleaving the fwd scans cut
// their cycles by 22 % and cost wgrad's window loops 25 %).
template <int NT, bool RowsKind, int NScan = kScanCand>
__global__ void __launch_bounds__(NT, 1) prep_kernel(const __grid_constant__ PrepParams p) {
  __shared__ Smem sm;
  // A GEMM launched with MOONEP_GEMM_PDL may start its CTAs once every block of this grid has
  // passed here; it waits for this grid's completion (griddepcontrol.wait) before reading what
  // it wrote.  No effect on a GEMM launched without it.
  asm volatile("griddepcontrol.launch_dependents;");
  if (blockIdx.x >= 2) {
    zero_tails(p, sm);
    return;
  }
  const bool chooser = blockIdx.x == 0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = p.G, P = p.P, ncand = p.ncand;
  MOONEP_DIAG(const long long t_entry = clock64();)
  if (chooser && ncand == 1) {  // forced config (or one candidate): nothing to choose
    if (tid == 0) {
      MOONEP_DIAG(long long* st = reinterpret_cast<long long*>(p.chosen_out);)
      p.chosen_out[0] = p.cand[0].cfg;
      MOONEP_DIAG(st[1] = 0;)
    }
    return;
  }
  int start = 0, cnt = -1;  // -1: no group (sort padding)
  if (tid < G) {
    const int2 rows = group_rows(p.cu, tid, p.M);
    start = rows.x;
    cnt = rows.y - rows.x;
  }
  constexpr bool rows_kind = RowsKind;
  int sink = 0;  // block 0: every line of the parameters at once, while cu_seqlens is in flight
  if (chooser) {
    if (lane == 0)
      for (int l = warp; l < p.nprefetch; l += NT / 32)
        sink ^= reinterpret_cast<const int*>(&p)[l * 16];
  } else {  // block 1: the problem arrays
    if (tid < G) write_strides(p.stride[0], p.sb[0], p.sbw[0], tid);
    if constexpr (rows_kind) {
      if (tid < G && p.stride[1][0]) write_strides(p.stride[1], p.sb[1], p.sbw[1], tid);
      if (tid < G) write_group(p, tid, tid, start, cnt);
      return;
    }
    sm.start[tid] = start;
  }
  sm.cnt[tid] = cnt;
  const unsigned nzmask = __ballot_sync(0xffffffffu, cnt > 0);
  const int tc = p.tc;
  const int k = udiv_small(tid, tc, p.magic_tc), u = tid - k * tc;  // candidate k (k >= ncand: idle)
  MOONEP_DIAG(long long t_rows, t_model;)
  int chosen = 0;

  if constexpr (rows_kind) {
    // tiles of group tid under every candidate; scans within the warp, the candidates' side by
    // side (NScan chains, unused ones on zeros; one after the other they were most of the
    // choice's cycles)
    int part[NScan], incl[NScan];
#pragma unroll
    for (int c = 0; c < NScan; ++c) {
      part[c] = c < ncand && cnt > 0 ? rows_tiles(p.cand[c], cnt) : 0;
      incl[c] = part[c];
    }
    warp_scans(incl, lane);
#pragma unroll
    for (int c = 0; c < NScan; ++c) {
      part[c] = incl[c] - part[c];
      if (lane == 31 && c < ncand) sm.wtile[c][warp] = incl[c];
    }
    if (lane == 0) sm.wnz[warp] = __popc(nzmask);
    __syncthreads();  // barrier 1
    MOONEP_DIAG(t_rows = t_model = clock64();)
    // add the tiles of the warps before; the total; the bytes of the groups before g
    // (nonempty ones * weights + rows * (row in + row out))
    int T = 0;
    {
      const int before = __popc(nzmask & ((1u << lane) - 1)) +
                         warp_sum(lane < warp ? sm.wnz[lane] : 0);
      if (tid < G) sm.u.rows.cb[tid] = (float)before * p.wbytes + (float)start * p.rbytes;
    }
    {  // lane w of every warp scans warp w's tile totals, all candidates side by side
      int sc[NScan];
#pragma unroll
      for (int c = 0; c < NScan; ++c)
        sc[c] = c < ncand && lane < NT / 32 ? sm.wtile[c][lane] : 0;
      warp_scans(sc, lane);
#pragma unroll
      for (int c = 0; c < NScan; ++c) {
        const int before_w = __shfl_sync(0xffffffffu, sc[c], max(warp - 1, 0));
        const int tot = __shfl_sync(0xffffffffu, sc[c], 31);
        if (c < ncand && tid < G) sm.u.rows.ts[c][tid] = (warp ? before_w : 0) + part[c];
        if (c == k) T = tot;
      }
    }
    __syncthreads();  // barrier 2
    if (k < ncand) {
      const Cand& C = p.cand[k];
      const int* ts = sm.u.rows.ts[k];
      const int top = G > 1 ? 1 << (31 - __clz(G - 1)) : 0;
      const float wb = p.wbytes, rb = p.rbytes;
      float part_t = 0.f;
      for (int r = u; r * P < T; r += tc) {
        const int lo = r * P, hi = min(T, lo + P);
        // last groups with ts <= lo and ts <= hi (ts[0] == 0); empty groups share the next
        // group's start, so a is the nonempty group holding tile lo
        int a = 0, b = 0;
        for (int s = top; s > 0; s >>= 1) {
          if (a + s < G && ts[a + s] <= lo) a += s;
          if (b + s < G && ts[b + s] <= hi) b += s;
        }
        const int ca = sm.cnt[a], cb = sm.cnt[b], ta = rows_tiles(C, ca), tb = rows_tiles(C, cb);
        const int tsa = ts[a], tsb = ts[b];
        const float cum_lo = sm.u.rows.cb[a] +
            (ta ? (float)(lo - tsa) * __fdividef(fmaf((float)ca, rb, wb), (float)ta) : 0.f);
        const float cum_hi = sm.u.rows.cb[b] +
            (tb ? (float)(hi - tsb) * __fdividef(fmaf((float)cb, rb, wb), (float)tb) : 0.f);
        // a group starts in [lo, hi): group a at lo, or the next one before hi
        const bool sw = tsa == lo || tsa + ta < hi;
        part_t += fmaxf(C.tau + (sw ? C.tau_sw : 0.f), (cum_hi - cum_lo) * C.inv_bw);
      }
      part_t = warp_sum(part_t);
      if (lane == 0) sm.wpart[warp] = part_t;
      if (u == 0) sm.ttot[k] = T;
    }
    __syncthreads();  // barrier 3
    if (warp == 0) {  // lane k: candidate k's time and MMA work; ncand <= 8
      float cost = 3.0e38f, vol = 3.0e38f;
      if (lane < ncand) {
        const int nw = tc >> 5, w0 = lane * nw;
        float s = 0.f;
        for (int w = 0; w < nw; ++w) s += sm.wpart[w0 + w];
        cost = p.cand[lane].tau0 + s;
        vol = (float)sm.ttot[lane] * p.cand[lane].vol;
      }
      chosen = p.cand[pick_lane(cost, vol, lane, p.tie_hi)].cfg;
    }
  } else {
    const int nne = __syncthreads_count(cnt > 0);  // barrier 1
    MOONEP_DIAG(t_rows = clock64();)
    // LPT order: rank of group g = groups with more rows, or as many and a smaller index
    if (warp * 32 < G) {  // this warp's chunk of 32 groups, sorted by brute force
      const int4* row = reinterpret_cast<const int4*>(sm.cnt + warp * 32);
      const int cm1 = cnt - 1;
      int rin = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const int4 v = row[q];
        const int h = 4 * q;
        rin += (v.x > (h < lane ? cm1 : cnt)) + (v.y > (h + 1 < lane ? cm1 : cnt)) +
               (v.z > (h + 2 < lane ? cm1 : cnt)) + (v.w > (h + 3 < lane ? cm1 : cnt));
      }
      sm.u.wg.u.sort.kc[warp * kChunkPad + rin] = cnt;
      sm.u.wg.u.sort.rin[tid] = rin;
    }
    __syncthreads();  // barrier 2
    {
      const int sx = p.sx, g = tid >> (__ffs(sx) - 1), sub = tid & (sx - 1), nch = (G + 31) >> 5;
      int cross = 0, cg = 0;
      if (g < G) {
        cg = sm.cnt[g];
        const int mine = g >> 5;
        const int* kc = sm.u.wg.u.sort.kc;
        // entries of sorted chunk c beating g: rows >= cg (lower indices) or > cg (higher);
        // two chunks at a time (independent searches)
        for (int c = sub; c < nch; c += 2 * sx) {
          const int c2 = c + sx;
          const bool va = c != mine, vb = c2 < nch && c2 != mine;
          const int ta = c < mine ? cg : cg + 1, tb = c2 < mine ? cg : cg + 1;
          const int* ka = kc + c * kChunkPad;
          const int* kb = kc + min(c2, nch - 1) * kChunkPad;
          int na = 0, nb = 0;
          for (int s = 16; s > 0; s >>= 1) {
            if (ka[na + s - 1] >= ta) na += s;
            if (kb[nb + s - 1] >= tb) nb += s;
          }
          na += ka[na] >= ta;
          nb += kb[nb] >= tb;
          cross += (va ? na : 0) + (vb ? nb : 0);
        }
      }
      for (int off = sx >> 1; off > 0; off >>= 1) cross += __shfl_xor_sync(0xffffffffu, cross, off);
      if (g < G && sub == 0) {
        const int rank = sm.u.wg.u.sort.rin[g] + cross;
        if (chooser) sm.u.wg.sorted[rank] = cg;
        else write_group(p, rank, g, sm.start[g], cg);
      }
    }
    if (!chooser) return;
    __syncthreads();  // barrier 3
    MOONEP_DIAG(t_model = clock64();)
    if (k < ncand) {  // window classes of candidate k
      const Cand& C = p.cand[k];
      const int Q = C.Q, S = C.S, s = u & (S - 1), span = tc >> C.log2S, rem = C.rem, d = C.d;
      const unsigned md = C.magic_d, mP = p.magic_P;
      float tot = 0.f, d0 = 0.f;
      for (int rb = 0; rb < Q; rb += span) {
        const int rho = rb + (u >> C.log2S);
        float w = 0.f;
        int pos = 0;
        if (rho < Q) {
          const int x = rho * rem;
          pos = x - udiv_small(x, P, mP) * P;  // rho * rem mod P
          const bool wraps = rem > 0 && (pos == 0 || pos + rem > P);
          for (int j = rho + Q * s; j <= nne; j += Q * S) {
            const float vj = j < nne ? wgrad_tile(C, sm.u.wg.sorted[j]) : 0.f;
            const float vp = j > 0 ? wgrad_tile(C, sm.u.wg.sorted[j - 1]) : 0.f;
            w += vj - vp;
            tot += vj;
            if (wraps) d0 += vj;
          }
        }
        for (int off = S >> 1; off > 0; off >>= 1) w += __shfl_xor_sync(0xffffffffu, w, off);
        if (rho < Q && s == 0) sm.u.wg.u.dw[k][udiv_small(pos, d, md)] = pos ? w : 0.f;
      }
      tot = warp_sum(tot);
      d0 = warp_sum(d0);
      if (lane == 0) {
        sm.wtot[warp] = tot;
        sm.wd0[warp] = d0;
      }
    }
    __syncthreads();  // barrier 4
    if (k < ncand && u < 32) {  // first warp of candidate k: per-CTA sums, max
      const Cand& C = p.cand[k];
      const int nw = tc >> 5, w0 = k * nw, Q = C.Q, d = C.d, base = C.base;
      const float tot = warp_sum(lane < nw ? sm.wtot[w0 + lane] : 0.f);
      const float d0 = warp_sum(lane < nw ? sm.wd0[w0 + lane] : 0.f);
      const float* dw = sm.u.wg.u.dw[k];
      const int per = (Q + 31) >> 5, m0 = lane * per, m1 = min(Q, m0 + per);
      float sum = 0.f;
      for (int m = m0; m < m1; ++m) sum += dw[m];
      float incl = sum;
      for (int off = 1; off < 32; off <<= 1) {
        const float v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
      }
      float run = incl - sum, worst = 0.f;
      const float bt = base * tot;
      const int tiles = nne * C.rem;  // base == 0: CTA q runs ceil((tiles - q) / P) tiles
      for (int m = m0; m < m1; ++m) {
        run += dw[m];
        const int q = m * d;
        const int entered =
            base > 0 ? nne : (q < tiles ? udiv_small(tiles - q + P - 1, P, p.magic_P) : 0);
        worst = fmaxf(worst, bt + (d0 + run) + entered * C.tau_sw);
      }
      for (int off = 16; off > 0; off >>= 1)
        worst = fmaxf(worst, __shfl_xor_sync(0xffffffffu, worst, off));
      if (lane == 0) sm.cost[k] = C.tau0 + (nne > 0 ? worst : 0.f);
    }
    __syncthreads();  // barrier 5
    if (warp == 0) {
      const float cost = lane < ncand ? sm.cost[lane] : 3.0e38f;
      const float vol = lane < ncand ? p.cand[lane].vol : 3.0e38f;
      chosen = p.cand[pick_lane(cost, vol, lane, p.tie_hi)].cfg;
    }
  }
  if (tid == 0) {
    MOONEP_DIAG(const long long t_end = clock64();)
    p.chosen_out[0] = chosen;
#ifdef MOONEP_DIAGNOSTICS
    // The selector's timing (moonep_gemm.h, diagnostics): SM cycles from the model's start (rows
    // known; wgrad: LPT order known) to the chosen config being known at byte 8 of the
    // workspace; block 0's cycles from entry to the end, to the rows being known (first
    // barrier), to the model's start at bytes 16..39.
    long long* st = reinterpret_cast<long long*>(p.chosen_out);
    st[1] = t_end - t_model;
    st[2] = t_end - t_entry;
    st[3] = t_rows - t_entry;
    st[4] = t_model - t_entry;
#endif
  }
  if (sink == 0x7fffffff && tid == 1) p.chosen_out[1] = sink;  // keeps the prefetch (never true)
}

int fail(const char* msg) {
  snprintf(g_err, sizeof(g_err), "%s", msg);
  return -1;
}

// The prep kernel for a block of NT threads: fwd/dgrad (rows) with the fewest tile-scan chains
// that hold the candidates, or wgrad.
template <int NT>
void launch_prep(bool rows, int ncand, int blocks, cudaStream_t s, const PrepParams& p) {
  if (rows && ncand <= 4) prep_kernel<NT, true, 4><<<blocks, NT, 0, s>>>(p);
  else if (rows && ncand == 5) prep_kernel<NT, true, 5><<<blocks, NT, 0, s>>>(p);
  else if (rows) prep_kernel<NT, true><<<blocks, NT, 0, s>>>(p);
  else prep_kernel<NT, false><<<blocks, NT, 0, s>>>(p);
}

}  // namespace

// The message slot of moonep_gemm_last_error(), for the library's other host units (the FP8
// grouped GEMM, kernel_fp8_fwd.cu): one thread-local buffer for every export.
void gemm_clear_error() { g_err[0] = 0; }
int gemm_fail(const char* msg) { return fail(msg); }

}  // namespace moonep

using namespace moonep;

extern "C" {

int moonep_gemm_abi_version(void) { return MOONEP_GEMM_ABI_VERSION; }

const char* moonep_gemm_last_error(void) { return g_err; }

int moonep_gemm_num_configs(int kind) {
  if (kind < 0 || kind >= kNumKinds) return 0;
  return registry().n[kind];
}

int moonep_gemm_config_info(int kind, int cfg, int* info) {
  if (kind < 0 || kind >= kNumKinds || cfg < 0 || cfg >= registry().n[kind]) return -1;
  const ConfigGeom& g = registry().geom[kind][cfg];
  const int v[8] = {g.BM, g.BN, g.BK, g.CM, g.CN, g.pingpong, g.EN, g.swap};
  memcpy(info, v, sizeof(v));
  return 0;
}

size_t moonep_gemm_workspace_bytes(int kind, int G, int sm_count) {
  if (kind < 0 || kind >= kNumKinds || G <= 0) return 0;
  return layout(kind, G, sm_count).total;
}

int moonep_grouped_gemm(int kind, int config, int raster, const void* A, const void* B,
                        const void* B_slot, void* D, void* D_slot, const int* cu_seqlens,
                        int G, int epn, int M, int N, int K, const float* tuning, int cand_mask,
                        int flags, void* workspace, size_t workspace_bytes, int sm_count, void* stream) {
  g_err[0] = 0;
  const Registry& reg = registry();
  if (kind < 0 || kind >= kNumKinds) return fail("bad kind");
  if (reg.mismatch[0]) return fail(reg.mismatch);
  const int nconf = reg.n[kind];
  if (config < -1 || config >= nconf) return fail("bad config index");
  if (G <= 0 || G > kMaxGroups || G != 2 * epn) return fail("G must be 2*epn and <= 1024");
  if (M < 0 || N <= 0 || K <= 0 || N % 8 || K % 8) return fail("N, K must be positive multiples of 8");
  if (sm_count <= 0 || sm_count > kMaxSms) return fail("sm_count must be in [1, 1024]");
  const Layout L = layout(kind, G, sm_count);
  if (workspace_bytes < L.total) return fail("workspace too small");
  if (M == 0) return 0;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);

  PrepParams p{};
  p.kind = kind; p.G = G; p.epn = epn; p.M = M; p.N = N; p.K = K; p.P = sm_count;
  if (flags & ~(MOONEP_GEMM_KEEP_EMPTY_SLOTS | MOONEP_GEMM_PDL | MOONEP_GEMM_KEEP_TAIL))
    return fail("unknown flags");
  if ((flags & MOONEP_GEMM_KEEP_EMPTY_SLOTS) && kind != 3)
    return fail("MOONEP_GEMM_KEEP_EMPTY_SLOTS applies to wgrad_lp only");
  if ((flags & MOONEP_GEMM_KEEP_TAIL) && kind >= 2)
    return fail("MOONEP_GEMM_KEEP_TAIL applies to fwd and dgrad only");
  p.zero_groups = (flags & MOONEP_GEMM_KEEP_EMPTY_SLOTS) ? epn : G;
  p.nconf = nconf;
  // One call runs one family (one fused kernel): the forced config's, or that of every
  // candidate; a mask with no valid bit means every config of family 0.
  int mask = cand_mask & ((1 << nconf) - 1);
  if (mask == 0) mask = (1 << (reg.nfam[kind] > 1 ? reg.first[kind][1] : nconf)) - 1;
  const int family = config >= 0 ? reg.famof[kind][config] : reg.famof[kind][__builtin_ctz(mask)];
  for (int c = 0; config < 0 && c < nconf; ++c)
    if (((mask >> c) & 1) && reg.famof[kind][c] != family)
      return fail("cand_mask holds configs of two families (cluster shapes): one call runs one "
                  "fused kernel");
  p.cu = cu_seqlens;
  p.A = static_cast<const char*>(A);
  p.B = static_cast<const char*>(B);
  p.B_slot = static_cast<const char*>(B_slot);
  p.D = static_cast<char*>(D);
  p.D_slot = static_cast<char*>(D_slot);
  p.chosen_out = reinterpret_cast<int*>(ws + L.chosen);
  p.swapmask = reg.swapmask[kind];
  for (int c = 0; c < nconf; ++c) p.shapes[c] = reinterpret_cast<int*>(ws + L.shapes[c]);
  for (int i = 0; i < 4; ++i) {
    p.ptr[i] = reinterpret_cast<const void**>(ws + L.ptr[i]);
    p.stride[0][i] = reinterpret_cast<long long*>(ws + L.stride[0][i]);
    p.stride[1][i] = reg.swapmask[kind] ? reinterpret_cast<long long*>(ws + L.stride[1][i]) : nullptr;
  }
  // Strides depend on N and K only (leading dimensions), never on the group's rows: one set for
  // the kind's plain configs and one for its swap-AB configs, from the first config of each.
  const int pm = kind >= 2 ? N : 1, pn = kind == 0 ? N : K, pk = kind == 0 ? K : (kind == 1 ? N : 1);
  for (int o = 0; o < (reg.swapmask[kind] ? 2 : 1); ++o) {
    int c0 = 0;
    while (c0 < nconf && reg.geom[kind][c0].swap != o) ++c0;
    if (c0 == nconf) continue;  // a kind of swap configs only: no plain strides to write
    StrideBytes sb{};
    reg.strides(kind, c0, pm, pn, pk, &sb);
    const unsigned char* sbsrc[4] = {sb.a, sb.b, sb.c, sb.d};
    const int sbsize[4] = {sb.size_a, sb.size_b, sb.size_c, sb.size_d};
    for (int a = 0; a < 4; ++a) {
      if (sbsize[a] % 8 != 0 || sbsize[a] > 32) return fail("internal: stride size not a multiple of 8 bytes");
      p.sbw[o][a] = sbsize[a] / 8;
      memcpy(p.sb[o][a], sbsrc[a], sbsize[a]);
    }
  }

  // The candidates of the device cost model and their constants (cost_model.py's formulas,
  // the config-dependent factors computed here once in double).  A forced config is the one
  // candidate.
  if (!tuning && config < 0) return fail("tuning table required when config == -1");
  const int P = sm_count;
  auto magic = [](int d) { return d <= 1 ? 0u : (unsigned)(((1ull << 32) + d - 1) / d); };
  const double peak = tuning ? tuning[0] : 0.0, hbm = tuning ? tuning[1] : 0.0;
  p.tie_hi = tuning ? (float)(1.0 + tuning[2 + 5 * nconf]) : 1.f;   // after the per-config rows
  const int n_out = kind == 0 ? N : K, k_red = kind == 0 ? K : N;
  p.wbytes = (float)((double)n_out * k_red * 2.0);
  p.rbytes = (float)((double)(n_out + k_red) * 2.0);
  int ncand = 0;
  for (int c = 0; c < nconf; ++c) {
    if (config >= 0 ? c != config : !((mask >> c) & 1)) continue;
    if (kind < 2 && ncand == kScanCand)
      return fail("more fwd/dgrad candidates than the prep kernel scans (raise kScanCand)");
    Cand& C = p.cand[ncand++];
    C.cfg = c;
    if (config >= 0) continue;
    const ConfigGeom& g = reg.geom[kind][c];
    const double eta = tuning[2 + 5 * c], bw_frac = tuning[3 + 5 * c];
    const double tau_epi = tuning[6 + 5 * c];
    C.tau_sw = tuning[4 + 5 * c];
    C.tau0 = tuning[5 + 5 * c];
    const double tile_flops_us = peak * 1e6 / P * eta;  // flop per us of one CTA
    C.bm = g.swap ? g.BN * g.CN : g.BM * g.CM;  // rows per row tile: a cluster's extent
    C.bm_shift = -1;
    for (int sh = 0; sh < 31; ++sh)
      if ((1 << sh) == C.bm) C.bm_shift = sh;
    if (kind < 2) {
      C.nt = g.swap ? (int)(g.CN * (cdiv_ll(cdiv_ll(n_out, g.BM), g.CM) * g.CM))
                    : (int)(g.CM * (cdiv_ll(cdiv_ll(n_out, g.BN), g.CN) * g.CN));
      // udiv_small needs x = rows + bm - 1 < 2^22 and bm <= 1024
      C.magic_d = C.bm_shift < 0 && C.bm <= 1024 && (long long)M + C.bm < (1 << 22) ? magic(C.bm) : 0;
      C.vol = (float)g.BM * (float)g.BN;
      C.tau = (float)(2.0 * g.BM * g.BN * k_red / tile_flops_us + tau_epi);
      C.inv_bw = (float)(1.0 / (hbm * 1e6 * bw_frac));
    } else {
      const long long t_w =
          (cdiv_ll(cdiv_ll(N, g.BM), g.CM) * g.CM) * (cdiv_ll(cdiv_ll(K, g.BN), g.CN) * g.CN);
      if (t_w > (1 << 30)) return fail("N, K too large for the wgrad cost model");
      C.base = (int)(t_w / P);
      C.rem = (int)(t_w % P);
      int a = C.rem, b = P;  // gcd(rem, P); rem == 0: one class at CTA 0, no windows
      while (a) { const int t = b % a; b = a; a = t; }
      C.d = b;
      C.magic_d = magic(b);
      C.Q = P / b;
      C.vol = (float)t_w * (float)g.BM * (float)g.BN;
      const double bwp = hbm * 1e6 * bw_frac / P;  // bytes per us of one CTA
      const double out_bytes = kind == 2 ? 8.0 : 2.0;
      C.ca = (float)(2.0 * g.BM * g.BN / tile_flops_us);
      C.cb = (float)tau_epi;
      C.ma = (float)((N + (double)K) * 2.0 / (double)t_w / bwp);
      C.mb = (float)((double)N * K * out_bytes / (double)t_w / bwp);
    }
  }
  p.ncand = ncand;
  const int nt = G <= kSmallPrepThreads ? kSmallPrepThreads : kPrepThreads;
  p.tc = (nt / 32 / ncand) * 32;
  p.magic_tc = magic(p.tc);
  p.magic_P = magic(P);
  p.nprefetch = (int)((offsetof(PrepParams, N) + 63) / 64);
  for (int i = 0; i < ncand; ++i) {  // wgrad: lanes per window class (a power of two <= 32)
    Cand& C = p.cand[i];
    C.S = 1;
    C.log2S = 0;
    while (C.S < 32 && 2 * C.S * C.Q <= p.tc) { C.S *= 2; C.log2S++; }
  }
  int rounded = (G + 31) / 32 * 32;  // wgrad ranks: threads per group in the cross-chunk phase
  p.sx = 1;
  while (p.sx < 32 && 2 * p.sx * rounded <= nt) p.sx *= 2;

  // block 0: choice; block 1: problem arrays; blocks >= 2: zeroing (fwd/dgrad padding rows,
  // wgrad_lp empty groups).  At most 32 zeroing blocks of 1024 threads or 128 of 256 (as many
  // threads as the 132 x 256 before): more blocks made the prep kernel ~0.5-1 us longer on the
  // H200 with nothing to zero.  The GEMM waits for the whole prep grid, so zeroing the rows
  // past cu_seqlens[G-1] runs in series with it (H200: +12.5 us median on 60-176 MB tails, ~0
  // below 20 MB, whose stores stay in L2): MOONEP_GEMM_KEEP_TAIL launches no zeroing block
  // for callers that never read those rows.
  const int max_tail = 32 * (kPrepThreads / nt);  // as many zeroing threads at either size
  int tail_blocks = kind == 3 ? (sm_count - 2 < max_tail ? sm_count - 2 : max_tail) : 0;
  if (kind < 2 && !(flags & MOONEP_GEMM_KEEP_TAIL)) {
    const long long vec = (long long)M * (kind == 0 ? N : K) / 8;
    tail_blocks = (int)((vec + nt - 1) / nt);
    if (tail_blocks > sm_count - 2) tail_blocks = sm_count - 2;
    if (tail_blocks > max_tail) tail_blocks = max_tail;
  }
  if (kind != 2 && !(flags & MOONEP_GEMM_KEEP_TAIL) && tail_blocks < 1) tail_blocks = 1;
  if (nt == kPrepThreads) launch_prep<kPrepThreads>(kind < 2, ncand, 2 + tail_blocks, s, p);
  else launch_prep<kSmallPrepThreads>(kind < 2, ncand, 2 + tail_blocks, s, p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(g_err, sizeof(g_err), "prep kernel launch failed: %s", cudaGetErrorString(e));
    return -1;
  }

  // One launch of the family's fused kernel; it runs the config the prep kernel wrote to `chosen`.
  RunArgs r[kMaxConfigs];
  for (int c = 0; c < nconf; ++c) {  // configs differ in shapes and CUTLASS workspace; a swap-AB
    const bool sw = reg.geom[kind][c].swap;  // config also in A <-> B and its strides
    r[c] = RunArgs{};
    r[c].G = G;
    r[c].ptr_A = p.ptr[sw ? 1 : 0];
    r[c].ptr_B = p.ptr[sw ? 0 : 1];
    r[c].ptr_C = p.ptr[2];
    r[c].ptr_D = const_cast<void**>(p.ptr[3]);
    long long* const* st = p.stride[sw];
    r[c].stride_A = st[0];
    r[c].stride_B = st[1];
    r[c].stride_C = st[2];
    r[c].stride_D = st[3];
    r[c].sm_count = sm_count;
    r[c].raster = raster;
    r[c].stream = stream;
    r[c].shapes = ws + L.shapes[c];
    r[c].cutlass_ws = ws + L.cutlass[c];
  }
  const int f0 = reg.first[kind][family];
  const int pdl = (flags & MOONEP_GEMM_PDL) ? 1 : 0;
  if (reg.fam[kind][family]->run(r + f0, p.chosen_out, f0, pdl, g_err, sizeof(g_err)) != 0)
    return -1;
  return 0;
}

}  // extern "C"
