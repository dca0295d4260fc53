// Host entry points of libmoonep_gemm.so and the one small "prep" kernel that runs before the
// CUTLASS grouped GEMM.  The prep kernel reads cu_seqlens on the device, so no group size ever
// reaches the host (no sync; the whole call can be captured in a CUDA graph).  It
//   1. turns cu_seqlens into per-group (start, count), clamped to [0, M] so that bad offsets can
//      never make the GEMM read or write out of bounds;
//   2. for wgrad, orders the groups largest first (LPT: a wgrad tile costs ~M_g, and the static
//      round-robin scheduler then balances better);
//   3. evaluates the cost model (same formulas as moonep_ops/gemm_cost_model.py, spread over the
//      block) for every candidate config and picks the cheapest;
//   4. writes the problem-shape / pointer / stride arrays: real shapes for the chosen config and
//      all-empty shapes for the other candidates, which are launched too and exit at once;
//   5. (blocks >= 1) zeroes the output rows past cu_seqlens[G-1] for fwd and dgrad.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "configs.h"
#include "moonep_gemm.h"
#include "selector.cuh"

namespace moonep {

#define MOONEP_DECLARE_ENTRY(KIND, NAME, ...) extern const ConfigEntry entry_##KIND##_##NAME;
MOONEP_GEMM_CONFIGS(MOONEP_DECLARE_ENTRY)

namespace {

thread_local char g_err[512] = "";

constexpr int kMaxGroups = 1024;
constexpr int kMaxRounds = 4096;  // rounds with a "group starts here" flag; later ones assume one
constexpr int kPrepThreads = 256;
constexpr size_t kAlign = 256;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Registry {
  const ConfigEntry* e[kNumKinds][kMaxConfigs] = {};
  int n[kNumKinds] = {};
  Registry() {
#define MOONEP_REGISTER(KIND, NAME, ...) add(#KIND, &entry_##KIND##_##NAME);
    MOONEP_GEMM_CONFIGS(MOONEP_REGISTER)
  }
  void add(const char* kind, const ConfigEntry* entry) {
    int k = strcmp(kind, "fwd") == 0     ? 0
            : strcmp(kind, "dgrad") == 0 ? 1
            : strcmp(kind, "wgrad") == 0 ? 2
                                         : 3;
    e[k][n[k]++] = entry;
  }
};

const Registry& registry() {
  static Registry r;
  return r;
}

struct Layout {  // byte offsets inside the call's workspace
  size_t chosen, shapes[kMaxConfigs], ptr[4], stride[4], cutlass[kMaxConfigs], total;
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
  for (int i = 0; i < 4; ++i) {
    L.stride[i] = off;
    off = align_up(off + (size_t)G * 32);
  }
  for (int c = 0; c < reg.n[kind]; ++c) {
    L.cutlass[c] = off;
    off = align_up(off + reg.e[kind][c]->workspace_bytes(G, sm_count));
  }
  L.total = off;
  return L;
}

struct PrepParams {
  int kind, G, epn, M, N, K, P, config, cand_mask, nconf;
  const int* cu;
  const char *A, *B, *B_slot;
  char *D, *D_slot;
  int* chosen_out;
  int* shapes[kMaxConfigs];
  const void** ptr[4];  // A, B, C, D
  char* stride[4];
  StrideBytes sb;
  ConfigGeom geom[kMaxConfigs];
  Tuning tuning;
};

__device__ __forceinline__ int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }
__device__ __forceinline__ int cdivi(int a, int b) { return (a + b - 1) / b; }

// Bytes first touched by linear tiles [0, t): piecewise linear, group g spreads its bytes evenly
// over its tiles.  g = the last group starting at or before t (binary search over the starts).
__device__ __forceinline__ float cum_bytes(int t, int G, const int* tstart, const float* cb,
                                           const float* bpt) {
  int lo = 0, hi = G - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tstart[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return cb[lo] + (float)(t - tstart[lo]) * bpt[lo];
}

__global__ void __launch_bounds__(kPrepThreads) prep_kernel(const PrepParams p) {
  const int G = p.G, M = p.M;
  if (blockIdx.x > 0) {
    if (p.kind == 3) {
      // wgrad_lp writes dW once (beta = 0): an empty group has no tiles, so zero its [N, K] here.
      const long long per = (long long)p.N * p.K / 8;  // uint4 units of one bf16 [N, K]
      for (int g = 0; g < G; ++g) {
        const int start = g == 0 ? 0 : clampi(p.cu[g - 1], 0, M);
        if (clampi(p.cu[g], start, M) > start) continue;
        uint4* out = reinterpret_cast<uint4*>((g < p.epn ? p.D : p.D_slot) +
                                              (long long)(g < p.epn ? g : g - p.epn) * per * 16);
        for (long long i = (long long)(blockIdx.x - 1) * blockDim.x + threadIdx.x; i < per;
             i += (long long)(gridDim.x - 1) * blockDim.x)
          out[i] = make_uint4(0, 0, 0, 0);
      }
      return;
    }
    // Zero the padding rows of the fwd/dgrad output: [cu[G-1], M) x cols, bf16, 16-byte stores.
    if (p.kind == 2) return;
    const int cols = p.kind == 0 ? p.N : p.K;
    const long long first = (long long)clampi(p.cu[G - 1], 0, M) * cols / 8;  // uint4 units
    const long long last = (long long)M * cols / 8;
    uint4* out = reinterpret_cast<uint4*>(p.D);
    for (long long i = first + (long long)(blockIdx.x - 1) * blockDim.x + threadIdx.x; i < last;
         i += (long long)(gridDim.x - 1) * blockDim.x)
      out[i] = make_uint4(0, 0, 0, 0);
    return;
  }
  __shared__ int s_cnt[kMaxGroups], s_start[kMaxGroups], s_order[kMaxGroups];
  __shared__ int s_tiles[kMaxGroups], s_tstart[kMaxGroups];
  __shared__ float s_bpt[kMaxGroups], s_cb[kMaxGroups];
  __shared__ unsigned char s_flag[kMaxRounds];
  __shared__ float s_cost[kMaxConfigs];
  __shared__ float s_acc;
  __shared__ unsigned s_max;
  __shared__ int s_chosen, s_nonempty, s_total;
  const int tid = threadIdx.x;

  for (int g = tid; g < G; g += blockDim.x) {
    const int start = g == 0 ? 0 : clampi(p.cu[g - 1], 0, M);
    const int end = clampi(p.cu[g], start, M);
    s_start[g] = start;
    s_cnt[g] = end - start;
  }
  if (tid == 0) s_nonempty = 0;
  __syncthreads();
  for (int g = tid; g < G; g += blockDim.x) {
    int rank = g;
    if (p.kind >= 2) {  // wgrad: largest first, stable
      rank = 0;
      for (int h = 0; h < G; ++h) rank += (s_cnt[h] > s_cnt[g]) || (s_cnt[h] == s_cnt[g] && h < g);
    }
    s_order[rank] = g;
    if (s_cnt[g] > 0) atomicAdd(&s_nonempty, 1);
  }
  __syncthreads();

  if (p.config < 0) {
    // Every loop below is spread over the block (one thread walking all groups and rounds
    // serially cost up to ~0.4 ms on big problems, more than the gain of choosing).
    const float peak = p.tuning.peak_tflops, hbm = p.tuning.hbm_tbps;
    for (int c = 0; c < p.nconf; ++c) {
      if (!((p.cand_mask >> c) & 1)) {
        if (tid == 0) s_cost[c] = 3.0e38f;
        continue;
      }
      const ConfigGeom cg = p.geom[c];
      const float eta = p.tuning.c[c][0], bw_frac = p.tuning.c[c][1];
      const float tau_sw = p.tuning.c[c][2], tau0 = p.tuning.c[c][3], tau_epi = p.tuning.c[c][4];
      if (tid == 0) { s_acc = 0.f; s_max = 0u; }
      if (p.kind < 2) {
        // fwd / dgrad: rounds of P equal-cost tiles, per-round roofline (gemm_cost_model).
        const int n_out = p.kind == 0 ? p.N : p.K, k_red = p.kind == 0 ? p.K : p.N;
        const int n_tiles = cdivi(cdivi(n_out, cg.BN), cg.CN) * cg.CN;
        const float tau = 2.f * cg.BM * cg.BN * (float)k_red / (peak * 1e6f / p.P * eta) + tau_epi;
        const float bw = hbm * 1e6f * bw_frac;
        for (int g = tid; g < G; g += blockDim.x) {
          const int t = cdivi(s_cnt[g], cg.BM) * n_tiles;
          s_tiles[g] = t;
          s_bpt[g] = t ? ((float)n_out * k_red * 2.f + (float)s_cnt[g] * (n_out + k_red) * 2.f) / t
                       : 0.f;
        }
        __syncthreads();
        if (tid == 0) {  // exclusive scans of tiles and bytes (G <= 1024 adds)
          int run = 0;
          float cb = 0.f;
          for (int g = 0; g < G; ++g) {
            s_tstart[g] = run;
            s_cb[g] = cb;
            run += s_tiles[g];
            cb += s_bpt[g] * s_tiles[g];
          }
          s_total = run;
        }
        __syncthreads();
        const int T = s_total, R = cdivi(T, p.P);
        for (int r = tid; r < R && r < kMaxRounds; r += blockDim.x) s_flag[r] = 0;
        __syncthreads();
        for (int g = tid; g < G; g += blockDim.x)
          if (s_tiles[g] > 0 && s_tstart[g] / p.P < kMaxRounds) s_flag[s_tstart[g] / p.P] = 1;
        __syncthreads();
        float part = 0.f;
        for (int r = tid; r < R; r += blockDim.x) {
          const int lo = r * p.P, hi = min(T, lo + p.P);
          const float bytes = cum_bytes(hi, G, s_tstart, s_cb, s_bpt) -
                              cum_bytes(lo, G, s_tstart, s_cb, s_bpt);
          const bool sw = r < kMaxRounds ? s_flag[r] != 0 : true;
          part += fmaxf(tau + (sw ? tau_sw : 0.f), bytes / bw);
        }
        atomicAdd(&s_acc, part);
        __syncthreads();
        if (tid == 0) s_cost[c] = tau0 + s_acc;
      } else {
        // wgrad: LPT order, a tile of group j costs ~M_j; CTA q runs tiles q, q+P, ...
        const int t_w = cdivi(p.N, cg.BM) * cdivi(cdivi(p.K, cg.BN), cg.CN) * cg.CN;
        const float out_bytes = p.kind == 2 ? 8.f : 2.f;  // fp32 read + write, or bf16 write
        for (int i = tid; i < G; i += blockDim.x) {
          const float m = (float)s_cnt[s_order[i]];
          const float comp = 2.f * cg.BM * cg.BN * m / (peak * 1e6f / p.P * eta) + tau_epi;
          const float mem = (m * (p.N + p.K) * 2.f + (float)p.N * p.K * out_bytes) / (float)t_w /
                            (hbm * 1e6f * bw_frac / p.P);
          s_bpt[i] = fmaxf(comp, mem);
        }
        __syncthreads();
        const int nne = s_nonempty;
        for (int q = tid; q < p.P; q += blockDim.x) {
          float sum = 0.f;
          int sw = 0;
          for (int j = 0; j < nne; ++j) {
            // tiles of group j: [j*t_w, (j+1)*t_w); how many are congruent to q mod P
            const int e = (j + 1) * t_w, b = j * t_w;
            const int n = (e > q ? (e - q + p.P - 1) / p.P : 0) - (b > q ? (b - q + p.P - 1) / p.P : 0);
            sum += s_bpt[j] * n;
            sw += n > 0;
          }
          atomicMax(&s_max, __float_as_uint(sum + sw * tau_sw));  // >= 0: uint order = float order
        }
        __syncthreads();
        if (tid == 0) s_cost[c] = tau0 + __uint_as_float(s_max);
      }
      __syncthreads();
    }
    __syncthreads();
    if (tid == 0) {
      int best = -1;
      for (int c = 0; c < p.nconf; ++c)
        if (((p.cand_mask >> c) & 1) && (best < 0 || s_cost[c] < s_cost[best])) best = c;
      s_chosen = best < 0 ? 0 : best;
    }
  } else if (tid == 0) {
    s_chosen = p.config;
  }
  __syncthreads();
  const int chosen = s_chosen;
  if (tid == 0) *p.chosen_out = chosen;

  const int N = p.N, K = p.K, epn = p.epn;
  for (int i = tid; i < G; i += blockDim.x) {
    const int g = s_order[i];
    const long long start = s_start[g];
    const int cnt = s_cnt[g];
    const long long wofs = (long long)(g < epn ? g : g - epn) * N * K;
    int shape[3];
    if (p.kind == 0) {  // fwd: (M_g, N, K)
      p.ptr[0][i] = p.A + start * K * 2;
      p.ptr[1][i] = (g < epn ? p.B : p.B_slot) + wofs * 2;
      p.ptr[3][i] = p.D + start * N * 2;
      shape[0] = cnt; shape[1] = N; shape[2] = K;
    } else if (p.kind == 1) {  // dgrad: (M_g, K, N)
      p.ptr[0][i] = p.A + start * N * 2;
      p.ptr[1][i] = (g < epn ? p.B : p.B_slot) + wofs * 2;
      p.ptr[3][i] = p.D + start * K * 2;
      shape[0] = cnt; shape[1] = K; shape[2] = N;
    } else {  // wgrad: (N, K, M_g); empty groups get no tiles (fp32: unchanged; lp: zeroed above)
      p.ptr[0][i] = p.A + start * N * 2;
      p.ptr[1][i] = p.B + start * K * 2;
      char* d = (g < epn ? p.D : p.D_slot) + wofs * (p.kind == 2 ? 4 : 2);
      p.ptr[2][i] = d;
      p.ptr[3][i] = d;
      shape[0] = cnt > 0 ? N : 0; shape[1] = K; shape[2] = cnt;
    }
    for (int c = 0; c < p.nconf; ++c) {
      if (c != chosen && !(p.config < 0 && ((p.cand_mask >> c) & 1))) continue;
      int* s = p.shapes[c] + 3 * i;
      s[0] = c == chosen ? shape[0] : 0;
      s[1] = shape[1];
      s[2] = c == chosen ? shape[2] : (p.kind >= 2 ? 0 : shape[2]);
    }
    memcpy(p.stride[0] + (size_t)i * p.sb.size_a, p.sb.a, p.sb.size_a);
    memcpy(p.stride[1] + (size_t)i * p.sb.size_b, p.sb.b, p.sb.size_b);
    memcpy(p.stride[2] + (size_t)i * p.sb.size_c, p.sb.c, p.sb.size_c);
    memcpy(p.stride[3] + (size_t)i * p.sb.size_d, p.sb.d, p.sb.size_d);
  }
}

int fail(const char* msg) {
  snprintf(g_err, sizeof(g_err), "%s", msg);
  return -1;
}

}  // namespace
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
  const ConfigGeom& g = registry().e[kind][cfg]->geom;
  const int v[8] = {g.BM, g.BN, g.BK, g.CM, g.CN, g.pingpong, 0, 0};
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
                        void* workspace, size_t workspace_bytes, int sm_count, void* stream) {
  g_err[0] = 0;
  const Registry& reg = registry();
  if (kind < 0 || kind >= kNumKinds) return fail("bad kind");
  const int nconf = reg.n[kind];
  if (config < -1 || config >= nconf) return fail("bad config index");
  if (G <= 0 || G > kMaxGroups || G != 2 * epn) return fail("G must be 2*epn and <= 1024");
  if (M < 0 || N <= 0 || K <= 0 || N % 8 || K % 8) return fail("N, K must be positive multiples of 8");
  if (sm_count <= 0) return fail("sm_count must be positive");
  const Layout L = layout(kind, G, sm_count);
  if (workspace_bytes < L.total) return fail("workspace too small");
  if (M == 0) return 0;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);

  PrepParams p{};
  p.kind = kind; p.G = G; p.epn = epn; p.M = M; p.N = N; p.K = K; p.P = sm_count;
  p.config = config; p.cand_mask = cand_mask & ((1 << nconf) - 1); p.nconf = nconf;
  if (p.cand_mask == 0) p.cand_mask = (1 << nconf) - 1;
  p.cu = cu_seqlens;
  p.A = static_cast<const char*>(A);
  p.B = static_cast<const char*>(B);
  p.B_slot = static_cast<const char*>(B_slot);
  p.D = static_cast<char*>(D);
  p.D_slot = static_cast<char*>(D_slot);
  p.chosen_out = reinterpret_cast<int*>(ws + L.chosen);
  for (int c = 0; c < nconf; ++c) {
    p.shapes[c] = reinterpret_cast<int*>(ws + L.shapes[c]);
    p.geom[c] = reg.e[kind][c]->geom;
  }
  for (int i = 0; i < 4; ++i) {
    p.ptr[i] = reinterpret_cast<const void**>(ws + L.ptr[i]);
    p.stride[i] = ws + L.stride[i];
  }
  // Strides depend on N and K only (leading dimensions), never on the group's rows.
  const int pm = kind >= 2 ? N : 1, pn = kind == 0 ? N : K, pk = kind == 0 ? K : (kind == 1 ? N : 1);
  reg.e[kind][0]->strides(pm, pn, pk, &p.sb);
  if (tuning) {
    p.tuning.peak_tflops = tuning[0];
    p.tuning.hbm_tbps = tuning[1];
    for (int c = 0; c < nconf; ++c)
      for (int j = 0; j < 5; ++j) p.tuning.c[c][j] = tuning[2 + 5 * c + j];
  } else if (config < 0) {
    return fail("tuning table required when config == -1");
  }
  int tail_blocks = kind == 3 ? sm_count : 0;
  if (kind < 2) {
    const long long vec = (long long)M * (kind == 0 ? N : K) / 8;
    tail_blocks = (int)((vec + kPrepThreads - 1) / kPrepThreads);
    if (tail_blocks > 2 * sm_count) tail_blocks = 2 * sm_count;
  }
  prep_kernel<<<1 + tail_blocks, kPrepThreads, 0, s>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(g_err, sizeof(g_err), "prep kernel launch failed: %s", cudaGetErrorString(e));
    return -1;
  }

  RunArgs r{};
  r.G = G;
  r.ptr_A = p.ptr[0];
  r.ptr_B = p.ptr[1];
  r.ptr_C = p.ptr[2];
  r.ptr_D = const_cast<void**>(p.ptr[3]);
  r.stride_A = p.stride[0];
  r.stride_B = p.stride[1];
  r.stride_C = p.stride[2];
  r.stride_D = p.stride[3];
  r.sm_count = sm_count;
  r.raster = raster;
  r.stream = stream;
  for (int c = 0; c < nconf; ++c) {
    if (config >= 0 ? c != config : !((p.cand_mask >> c) & 1)) continue;
    r.shapes = ws + L.shapes[c];
    r.cutlass_ws = ws + L.cutlass[c];
    r.cutlass_ws_bytes = reg.e[kind][c]->workspace_bytes(G, sm_count);
    if (reg.e[kind][c]->run(r, g_err, sizeof(g_err)) != 0) return -1;
  }
  return 0;
}

}  // extern "C"
