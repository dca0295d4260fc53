// The GPU data plane over symmetric memory: barrier, histogram exchange, dispatch, combine,
// prefetch_weight and reduce_grad.  Semantics: docs/data_plane.md (bit-exact with the
// torch.distributed backend).  Layout and protocol: docs/data_plane.md "CUDA backend".
//
// Peer tables.  Every symmetric region is passed as a device array of R base pointers
// (`T* const* peers`, entry p = rank p's copy, mapped into this process); `peers[rank]` is the
// local copy.  Kernels only ever write a peer's region at rows the plan gives this rank.
//
// Epochs.  Each rank keeps a local uint64 barrier counter in device memory.  Every op issues the
// same barriers in the same order on every rank, so counters agree across ranks at matching
// points; dispatch stamps the row descriptors it sends with the current counter, and the
// receiver accepts only rows carrying that stamp: rows nobody wrote this call (padding, tail)
// are recognised without a clear pass and without knowing the plan.  The counter lives on the
// device, so CUDA-graph replays advance it too.
//
// Hazards.  Every op ends with a barrier, so a peer's next op can never overwrite a staging
// region (x_stage, y_stage, row descriptors) that this rank is still reading.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ep_internal.h"
#include "pdl.cuh"

namespace {

constexpr int kErrAny = MOONEP_ERR_BAD_IDS | MOONEP_ERR_HIST | MOONEP_ERR_PLAN | MOONEP_ERR_TIMEOUT;

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int32_t load_err(const int32_t* err) {
  return *reinterpret_cast<const volatile int32_t*>(err);
}

// ------------------------------------------------------------------------------------------
// Barrier: signal every peer, then wait for every peer; a timeout sets MOONEP_ERR_TIMEOUT and
// returns (no trap, no hang), recording the first timed-out barrier's op, the peer it waited
// for and its epoch in err[1..3], so the host can say which op lost which rank.  After a
// timeout the group is broken: later barriers no longer wait, and the host reports the flag
// (Buffer.check_errors()).
// ------------------------------------------------------------------------------------------
__global__ void barrier_kernel(uint64_t* const* sig_peers, uint64_t* epoch, int rank, int R,
                               int32_t* err, long long timeout_ns, int op) {
  // Let a kernel launched with programmatic dependent launch (the planner's group kernel, right
  // after the histogram barrier) become resident and set up while this one waits; it still
  // waits for this kernel's completion (griddepcontrol.wait) before reading anything.
  grid_dep_launch();
  __shared__ uint64_t target;
  if (threadIdx.x == 0) {
    target = *epoch + 1;
    *epoch = target;
  }
  __syncthreads();
  const uint64_t t = target;
  __threadfence_system();  // this rank's earlier writes (previous kernels) before the signal
  for (int p = threadIdx.x; p < R; p += blockDim.x) st_release_sys(sig_peers[p] + rank, t);
  if (load_err(err) & MOONEP_ERR_TIMEOUT) return;
  const uint64_t* mine = sig_peers[rank];
  const uint64_t t0 = globaltimer_ns();
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    while (ld_acquire_sys(mine + p) < t) {
      if (static_cast<long long>(globaltimer_ns() - t0) > timeout_ns) {
        // details of the first timeout only (err[1] is 0 until then): op, missing peer + 1,
        // epoch of the barrier (low 31 bits)
        if (atomicCAS(err + 1, 0, op) == 0) {
          err[2] = p + 1;
          err[3] = static_cast<int32_t>(t & 0x7fffffff);
        }
        atomicOr(err, MOONEP_ERR_TIMEOUT);
        break;
      }
    }
  }
  __syncthreads();
  __threadfence_system();
}

// ------------------------------------------------------------------------------------------
// Histogram exchange: bincount of this rank's ids, written as row `rank` of every peer's
// [R, E+3] table together with (bad-ids flag, s, total).
// ------------------------------------------------------------------------------------------
__global__ void hist_publish_kernel(const int32_t* topk, int N, int E, int rank, int R, int s,
                                    int total, int32_t* const* hist_peers, int32_t* err) {
  extern __shared__ int32_t h[];  // [E + 1]: last = bad flag
  for (int i = threadIdx.x; i <= E; i += blockDim.x) h[i] = 0;
  __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    int e = topk[n];
    if (e < 0 || e >= E) h[E] = 1;
    else atomicAdd(&h[e], 1);
  }
  __syncthreads();
  const int W = E + 3;
  for (int j = threadIdx.x; j < R * W; j += blockDim.x) {
    int p = j / W, c = j % W;
    int v = c < E ? h[c] : (c == E ? h[E] : (c == E + 1 ? s : total));
    hist_peers[p][rank * W + c] = v;
  }
  if (threadIdx.x == 0 && h[E]) atomicOr(err, MOONEP_ERR_BAD_IDS);
}

// ------------------------------------------------------------------------------------------
// Dispatch, source side: one row descriptor + route weight per entry into the destination's
// tables.  Descriptor = (stamp << 32) | value, value = src_rank*S + token for a primary entry,
// -(row of the primary on that rank) - 1 for a duplicate (filled by a local copy there).
// ------------------------------------------------------------------------------------------
struct Decoded {
  int d, loff;
  bool primary;
};
__device__ __forceinline__ Decoded decode(int32_t v, int NvS) {
  bool p = v >= 0;
  int raw = p ? v : -v - 1;
  return {raw / NvS, raw % NvS, p};
}

__global__ void dispatch_send_kernel(const float* w, const int32_t* dst, int s, int K, int rank,
                                     int R, int S, int NvS, int nvs_s,
                                     int64_t* const* desc_peers, float* const* wland_peers,
                                     const uint64_t* epoch, int32_t* err) {
  // Stamp = the counter value after the barrier that follows (never 0: never-written rows are 0).
  const uint64_t stamp = static_cast<uint32_t>(*epoch + 1);
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < s; t += gridDim.x * blockDim.x) {
    for (int k = 0; k < K; ++k) {
      const int n = t * K + k;
      Decoded e = decode(dst[n], NvS);
      if (e.d < 0 || e.d >= R || e.loff >= nvs_s) {
        atomicOr(err, MOONEP_ERR_PLAN);
        continue;
      }
      int32_t value = rank * S + t;
      if (!e.primary) {
        bool found = false;
        for (int j = 0; j < k && !found; ++j) {
          Decoded p = decode(dst[t * K + j], NvS);
          if (p.primary && p.d == e.d) {
            value = -p.loff - 1;  // -1 is valid: the primary sits in row 0
            found = true;
          }
        }
        if (!found) {  // a duplicate without a primary: not a plan of moonep::plan
          atomicOr(err, MOONEP_ERR_PLAN);
          continue;
        }
      }
      desc_peers[e.d][e.loff] = static_cast<int64_t>((stamp << 32) | static_cast<uint32_t>(value));
      wland_peers[e.d][e.loff] = w ? w[n] : 0.f;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Row copies: one warp per row, V-wide vector loads (V = int4 when rows are 16-byte multiples).
// ------------------------------------------------------------------------------------------
template <typename V>
__device__ __forceinline__ void copy_row(char* dst, const char* src, int64_t row_bytes, int lane) {
  const int64_t n = row_bytes / sizeof(V);
  V* d = reinterpret_cast<V*>(dst);
  const V* s = reinterpret_cast<const V*>(src);
  for (int64_t i = lane; i < n; i += 32) d[i] = s[i];
}
template <typename V>
__device__ __forceinline__ void zero_row(char* dst, int64_t row_bytes, int lane) {
  const int64_t n = row_bytes / sizeof(V);
  V* d = reinterpret_cast<V*>(dst);
  V z;
  memset(&z, 0, sizeof(V));
  for (int64_t i = lane; i < n; i += 32) d[i] = z;
}

// Dispatch, destination side: rows [0, nvs_s) of a fresh output.  Stamped primaries are pulled
// from the source's x_stage, rows nobody wrote this call are zero, duplicates wait for
// dispatch_dups_kernel.  Any error flag -> all zeros (safe, never out of bounds).
template <typename V>
__global__ void dispatch_recv_kernel(char* h, float* w_out, int nvs_s, int64_t row_bytes,
                                     const int64_t* desc, const float* wland,
                                     const char* const* xstage_peers, int R, int S,
                                     const uint64_t* epoch, int32_t* err) {
  const uint32_t want = static_cast<uint32_t>(*epoch);
  const bool broken = load_err(err) & kErrAny;
  const int lane = threadIdx.x & 31;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < nvs_s; i += warps) {
    const int64_t dv = desc[i];
    const bool real = !broken && static_cast<uint32_t>(static_cast<uint64_t>(dv) >> 32) == want;
    const int32_t value = static_cast<int32_t>(static_cast<uint32_t>(dv & 0xffffffffLL));
    char* out = h + static_cast<int64_t>(i) * row_bytes;
    if (lane == 0) w_out[i] = real ? wland[i] : 0.f;
    if (!real) {
      zero_row<V>(out, row_bytes, lane);
    } else if (value >= 0) {
      const int src = value / S, t = value % S;
      if (src < R) copy_row<V>(out, xstage_peers[src] + static_cast<int64_t>(t) * row_bytes, row_bytes, lane);
      else zero_row<V>(out, row_bytes, lane);
    }
  }
}

template <typename V>
__global__ void dispatch_dups_kernel(char* h, int nvs_s, int64_t row_bytes, const int64_t* desc,
                                     const uint64_t* epoch, int32_t* err) {
  const uint32_t want = static_cast<uint32_t>(*epoch);
  if (load_err(err) & kErrAny) return;
  const int lane = threadIdx.x & 31;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < nvs_s; i += warps) {
    const int64_t dv = desc[i];
    if (static_cast<uint32_t>(static_cast<uint64_t>(dv) >> 32) != want) continue;
    const int32_t value = static_cast<int32_t>(static_cast<uint32_t>(dv & 0xffffffffLL));
    if (value >= 0) continue;
    const int p = -value - 1;
    char* out = h + static_cast<int64_t>(i) * row_bytes;
    if (p < nvs_s) copy_row<V>(out, h + static_cast<int64_t>(p) * row_bytes, row_bytes, lane);
    else zero_row<V>(out, row_bytes, lane);
  }
}

// ------------------------------------------------------------------------------------------
// Combine, source side: y[t] = sum_{k=0..K-1} row(t, k) in Acc, in that order, rounded once;
// weighted: the terms are row(t, k) * w(t, k) in Acc.  The first term initialises the sum
// (0 + -0.0 would turn -0.0 into +0.0).  The product and the sum are separate roundings
// (mul_rn / add_rn: never contracted into an FMA), as the CPU reference computes them.
// ------------------------------------------------------------------------------------------
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> __device__ __forceinline__ typename AccOf<T>::type to_acc(T v) { return static_cast<typename AccOf<T>::type>(v); }
template <> __device__ __forceinline__ float to_acc<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_acc<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_acc(typename AccOf<T>::type v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename T, int VEC>
__global__ void combine_recv_kernel(T* y, float* w_out, int s, int K, int H, bool weighted,
                                    const int32_t* dst, int NvS, int n_rows, const int64_t* rows_of,
                                    const T* const* ystage_peers,
                                    const float* const* wstage_peers, int R, int32_t* err) {
  using Acc = typename AccOf<T>::type;
  const int t = blockIdx.x;
  const bool broken = load_err(err) & kErrAny;
  // rows rank d holds: its published count (direct mode) or the staging region's n_rows
  auto rows = [&](int d) { return rows_of ? rows_of[d] : static_cast<int64_t>(n_rows); };
  if (w_out && blockIdx.y == 0) {
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      Decoded e = decode(dst[t * K + k], NvS);
      bool ok = !broken && e.d < R && e.loff < rows(e.d);
      w_out[t * K + k] = ok ? wstage_peers[e.d][e.loff] : 0.f;
    }
  }
  const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  if (c0 >= H) return;
  Acc acc[VEC];
  for (int k = 0; k < K; ++k) {
    Decoded e = decode(dst[t * K + k], NvS);
    const bool ok = !broken && e.d < R && e.loff < rows(e.d);
    alignas(16) T v[VEC];
    Acc wk = Acc(1);
    if (ok) {
      if (weighted) wk = static_cast<Acc>(wstage_peers[e.d][e.loff]);
      const T* row = ystage_peers[e.d] + static_cast<int64_t>(e.loff) * H + c0;
      if constexpr (VEC * sizeof(T) == 16) {
        *reinterpret_cast<int4*>(v) = *reinterpret_cast<const int4*>(row);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = c0 + j < H ? row[j] : T(0);
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = from_acc<T>(Acc(0));
      if (!broken && threadIdx.x == 0 && blockIdx.y == 0) atomicOr(err, MOONEP_ERR_PLAN);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const Acc term = weighted ? mul_rn(to_acc<T>(v[j]), wk) : to_acc<T>(v[j]);
      acc[j] = k == 0 ? term : add_rn(acc[j], term);
    }
  }
  T* out = y + static_cast<int64_t>(t) * H + c0;
  if constexpr (VEC * sizeof(T) == 16) {   // one 16-byte store (the VEC path has D % VEC == 0)
    alignas(16) T o[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = from_acc<T>(acc[j]);
    *reinterpret_cast<int4*>(out) = *reinterpret_cast<const int4*>(o);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (c0 + j < H) out[j] = from_acc<T>(acc[j]);
  }
}

// ------------------------------------------------------------------------------------------
// Expert weights.  Up to kMaxT tensors of [epn, row_bytes] per call.
// ------------------------------------------------------------------------------------------
constexpr int kMaxT = 8;
constexpr int64_t kChunk = 32768;  // bytes per work item
struct TensorTable {
  int n;
  const char* local[kMaxT];   // this rank's [epn, row] tensor
  char* const* peers[kMaxT];  // device array [R] of the slot tensor on every rank
  int64_t row_bytes[kMaxT];
};

// prefetch_weight: the owner pushes local[e % epn] into slot b of every rank d holding e.
__global__ void push_weights_kernel(TensorTable tt, const int32_t* etc, int R, int B, int rank,
                                    int64_t max_chunks, const int32_t* err) {
  if (load_err(err) & MOONEP_ERR_TIMEOUT) return;
  const int i = blockIdx.y;
  const int64_t rb = tt.row_bytes[i];
  const int64_t chunks = (rb + kChunk - 1) / kChunk;
  const bool vec = (rb % 16) == 0;
  for (int64_t item = blockIdx.x; item < static_cast<int64_t>(R) * B * max_chunks; item += gridDim.x) {
    const int pair = static_cast<int>(item / max_chunks);
    const int64_t c = item % max_chunks;
    if (c >= chunks) continue;
    const int e = etc[pair];
    if (e < 0 || e / B != rank) continue;
    const int d = pair / B, b = pair % B;
    const int64_t off = c * kChunk, len = min(kChunk, rb - off);
    const char* src = tt.local[i] + static_cast<int64_t>(e % B) * rb + off;
    char* dstp = tt.peers[i][d] + static_cast<int64_t>(b) * rb + off;
    if (vec) {
      for (int64_t j = threadIdx.x; j < len / 16; j += blockDim.x)
        reinterpret_cast<int4*>(dstp)[j] = reinterpret_cast<const int4*>(src)[j];
    } else {
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x) dstp[j] = src[j];
    }
  }
}

// reduce_grad: the owner pulls every slot holding one of its experts and adds them into its
// local grad one at a time in ascending (src*epn + b), in fp32: fp32 grads in place, bf16 grads
// (T = __nv_bfloat16) read once, summed in fp32 and rounded once (RNE).
// Work split: every block takes a 1/gridDim slice of EVERY replicated expert's rows (it walks
// the local experts and skips those without replicas).  Which experts have replicas is only
// known on the device; a grid of (slices, expert) blocks sized for the worst case left a single
// replicated expert to 4 blocks (4 ms for 3 x 2M bf16 elements at epn = 128).
template <typename T>
__device__ __forceinline__ void add_row_slice(T* dst, char* const* peers, const int32_t* srcs,
                                              int n, int B, int64_t elems) {
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte access
  bool vec = (elems % V) == 0 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
  for (int q = 0; q < n && vec; ++q)
    vec = (reinterpret_cast<uintptr_t>(peers[srcs[q] / B]) & 15) == 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (vec) {
    for (int64_t jv = first; jv < elems / V; jv += stride) {
      union { uint4 u; T t[V]; } d, v;
      d.u = reinterpret_cast<const uint4*>(dst)[jv];
      float acc[V];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = to_acc<T>(d.t[k]);
      for (int q = 0; q < n; ++q) {
        const int src = srcs[q] / B, b = srcs[q] % B;
        v.u = reinterpret_cast<const uint4*>(
            reinterpret_cast<const T*>(peers[src]) + static_cast<int64_t>(b) * elems)[jv];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += to_acc<T>(v.t[k]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) d.t[k] = from_acc<T>(acc[k]);
      reinterpret_cast<uint4*>(dst)[jv] = d.u;
    }
    return;
  }
  for (int64_t j = first; j < elems; j += stride) {
    float acc = to_acc<T>(dst[j]);
    for (int q = 0; q < n; ++q) {
      const int src = srcs[q] / B, b = srcs[q] % B;
      acc += to_acc<T>(reinterpret_cast<const T*>(peers[src])[static_cast<int64_t>(b) * elems + j]);
    }
    dst[j] = from_acc<T>(acc);
  }
}

template <typename T>
__global__ void reduce_grads_kernel(TensorTable tt, const int32_t* etc, int R, int B, int rank,
                                    const int32_t* err) {
  // Shared: etc copy [R*B]; slot ids j = src*B + b grouped by local expert, ascending j inside a
  // group [R*B] (at most one expert per slot, so R*B entries in all); group offsets [B+1].
  extern __shared__ int32_t sm[];
  const int RB = R * B;
  int32_t* s_etc = sm;
  int32_t* s_src = sm + RB;
  int32_t* s_off = sm + 2 * RB;
  if (load_err(err) & MOONEP_ERR_TIMEOUT) return;
  for (int j = threadIdx.x; j < RB; j += blockDim.x) s_etc[j] = etc[j];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  for (int le = warp; le < B; le += nw) {  // count each expert's slots (one warp per expert)
    int cnt = 0;
    for (int base = 0; base < RB; base += 32)
      cnt += __popc(__ballot_sync(0xffffffffu, base + lane < RB && s_etc[base + lane] == rank * B + le));
    if (lane == 0) s_off[le + 1] = cnt;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive offsets, 32 experts per step
    int run = 0;
    if (lane == 0) s_off[0] = 0;
    for (int base = 0; base < B; base += 32) {
      int v = base + lane < B ? s_off[base + lane + 1] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
      }
      if (base + lane < B) s_off[base + lane + 1] = run + v;
      run += __shfl_sync(0xffffffffu, v, 31);
    }
  }
  __syncthreads();
  for (int le = warp; le < B; le += nw) {  // fill, ascending j within each expert
    int pos = s_off[le];
    for (int base = 0; base < RB; base += 32) {
      const bool hit = base + lane < RB && s_etc[base + lane] == rank * B + le;
      const unsigned m = __ballot_sync(0xffffffffu, hit);
      if (hit) s_src[pos + __popc(m & ((1u << lane) - 1))] = base + lane;
      pos += __popc(m);
    }
  }
  __syncthreads();
  for (int le = 0; le < B; ++le) {
    const int n = s_off[le + 1] - s_off[le];
    if (n == 0) continue;
    for (int i = 0; i < tt.n; ++i) {
      const int64_t elems = tt.row_bytes[i] / static_cast<int64_t>(sizeof(T));
      T* dst = reinterpret_cast<T*>(const_cast<char*>(tt.local[i])) + static_cast<int64_t>(le) * elems;
      add_row_slice<T>(dst, tt.peers[i], s_src + s_off[le], n, B, elems);
    }
  }
}

// Zero this rank's consumed slots (experts_to_copy[rank, b] >= 0) of every tensor.
__global__ void zero_slots_kernel(TensorTable tt, const int32_t* etc, int B, int rank,
                                  int64_t max_chunks) {
  const int i = blockIdx.y;
  const int64_t rb = tt.row_bytes[i];
  const int64_t chunks = (rb + kChunk - 1) / kChunk;
  const bool vec = (rb % 16) == 0;
  for (int64_t item = blockIdx.x; item < static_cast<int64_t>(B) * max_chunks; item += gridDim.x) {
    const int b = static_cast<int>(item / max_chunks);
    const int64_t c = item % max_chunks;
    if (c >= chunks || etc[rank * B + b] < 0) continue;
    const int64_t off = c * kChunk, len = min(kChunk, rb - off);
    char* p = const_cast<char*>(tt.local[i]) + static_cast<int64_t>(b) * rb + off;
    if (vec) {
      for (int64_t j = threadIdx.x; j < len / 16; j += blockDim.x)
        reinterpret_cast<int4*>(p)[j] = make_int4(0, 0, 0, 0);
    } else {
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x) p[j] = 0;
    }
  }
}

int grid_for(int64_t work, int per_block, int cap) {
  int64_t g = (work + per_block - 1) / per_block;
  if (g < 1) g = 1;
  return static_cast<int>(g < cap ? g : cap);
}

TensorTable make_table(int n, const void* const* local, const void* const* peers,
                       const int64_t* row_bytes) {
  TensorTable tt{};
  tt.n = n;
  for (int i = 0; i < n; ++i) {
    tt.local[i] = static_cast<const char*>(local[i]);
    tt.peers[i] = static_cast<char* const*>(peers[i]);
    tt.row_bytes[i] = row_bytes[i];
  }
  return tt;
}

int64_t max_chunks_of(const TensorTable& tt) {
  int64_t m = 1;
  for (int i = 0; i < tt.n; ++i) m = max(m, (tt.row_bytes[i] + kChunk - 1) / kChunk);
  return m;
}

}  // namespace

using moonep_ep::fail;

MOONEP_EXPORT int moonep_ep_barrier(void* sig_peers, void* epoch, int rank, int R, void* err,
                                    long long timeout_ns, int op, void* stream) {
  barrier_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint64_t* const*>(sig_peers), static_cast<uint64_t*>(epoch), rank, R,
      static_cast<int32_t*>(err), timeout_ns, op);
  return fail(cudaGetLastError(), "moonep_ep_barrier");
}

MOONEP_EXPORT int moonep_ep_hist_publish(const void* topk, int N, int E, int rank, int R, int s,
                                         int total, void* hist_peers, void* err, void* stream) {
  hist_publish_kernel<<<1, 1024, (E + 1) * sizeof(int32_t), static_cast<cudaStream_t>(stream)>>>(
      static_cast<const int32_t*>(topk), N, E, rank, R, s, total,
      static_cast<int32_t* const*>(hist_peers), static_cast<int32_t*>(err));
  return fail(cudaGetLastError(), "moonep_ep_hist_publish");
}

// Dispatch, source half: stage x (s rows) locally and send descriptors + weights.
MOONEP_EXPORT int moonep_ep_dispatch_send(const void* x, int64_t row_bytes, const void* w,
                                          const void* dst, int s, int K, int rank, int R, int S,
                                          int NvS, int nvs_s, void* x_stage, void* desc_peers,
                                          void* wland_peers, const void* epoch, void* err,
                                          void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemcpyAsync(x_stage, x, static_cast<size_t>(s) * row_bytes,
                                  cudaMemcpyDeviceToDevice, st);
  if (e != cudaSuccess) return fail(e, "moonep_ep_dispatch_send (stage)");
  dispatch_send_kernel<<<grid_for(s, 256, 1024), 256, 0, st>>>(
      static_cast<const float*>(w), static_cast<const int32_t*>(dst), s, K, rank, R, S, NvS,
      nvs_s, static_cast<int64_t* const*>(desc_peers), static_cast<float* const*>(wland_peers),
      static_cast<const uint64_t*>(epoch), static_cast<int32_t*>(err));
  return fail(cudaGetLastError(), "moonep_ep_dispatch_send");
}

// Dispatch, destination half (after the barrier): pull rows, zero the rest, fill duplicates.
MOONEP_EXPORT int moonep_ep_dispatch_recv(void* h, void* w_out, int nvs_s, int64_t row_bytes,
                                          const void* desc, const void* wland,
                                          const void* xstage_peers, int R, int S,
                                          const void* epoch, void* err, int num_sms,
                                          void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  const int grid = grid_for(static_cast<int64_t>(nvs_s) * 32, 256, num_sms * 8);
  auto ep = static_cast<const uint64_t*>(epoch);
  auto er = static_cast<int32_t*>(err);
  auto ds = static_cast<const int64_t*>(desc);
  if (row_bytes % 16 == 0) {
    dispatch_recv_kernel<int4><<<grid, 256, 0, st>>>(
        static_cast<char*>(h), static_cast<float*>(w_out), nvs_s, row_bytes, ds,
        static_cast<const float*>(wland), static_cast<const char* const*>(xstage_peers), R, S, ep, er);
    dispatch_dups_kernel<int4><<<grid, 256, 0, st>>>(static_cast<char*>(h), nvs_s, row_bytes, ds, ep, er);
  } else {
    dispatch_recv_kernel<char><<<grid, 256, 0, st>>>(
        static_cast<char*>(h), static_cast<float*>(w_out), nvs_s, row_bytes, ds,
        static_cast<const float*>(wland), static_cast<const char* const*>(xstage_peers), R, S, ep, er);
    dispatch_dups_kernel<char><<<grid, 256, 0, st>>>(static_cast<char*>(h), nvs_s, row_bytes, ds, ep, er);
  }
  return fail(cudaGetLastError(), "moonep_ep_dispatch_recv");
}

// Combine, destination half: stage h (and w) for the peers to read.
MOONEP_EXPORT int moonep_ep_combine_stage(const void* h, int64_t n_rows, int64_t row_bytes,
                                          const void* w, void* y_stage, void* w_stage,
                                          void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemcpyAsync(y_stage, h, static_cast<size_t>(n_rows * row_bytes),
                                  cudaMemcpyDeviceToDevice, st);
  if (e == cudaSuccess && w)
    e = cudaMemcpyAsync(w_stage, w, static_cast<size_t>(n_rows) * 4, cudaMemcpyDeviceToDevice, st);
  return fail(e, "moonep_ep_combine_stage");
}

// dtype codes: MoonepEpDtype (moonep_ep.h)
// Direct mode (one address space: virtual ranks): instead of staging h, every rank publishes
// (h pointer, w pointer, rows) into row `rank` of every peer's [3, R] int64 table.
__global__ void publish_ptrs_kernel(int64_t* const* table_peers, int rank, int R, int64_t h,
                                    int64_t w, int64_t rows) {
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    table_peers[p][rank] = h;
    table_peers[p][R + rank] = w;
    table_peers[p][2 * R + rank] = rows;
  }
}

MOONEP_EXPORT int moonep_ep_publish_ptrs(void* table_peers, int rank, int R, const void* h,
                                         const void* w, int64_t rows, void* stream) {
  publish_ptrs_kernel<<<1, 128, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<int64_t* const*>(table_peers), rank, R,
      reinterpret_cast<int64_t>(h), reinterpret_cast<int64_t>(w), rows);
  return fail(cudaGetLastError(), "moonep_ep_publish_ptrs");
}

MOONEP_EXPORT int moonep_ep_combine_recv(void* y, void* w_out, int s, int K, int D, int dtype,
                                         int weighted, const void* dst, int NvS, int n_rows,
                                         const void* rows_of, const void* ystage_peers,
                                         const void* wstage_peers, int R, void* err,
                                         void* stream) {
  auto ro = static_cast<const int64_t*>(rows_of);
  auto st = static_cast<cudaStream_t>(stream);
  auto d = static_cast<const int32_t*>(dst);
  auto wo = static_cast<float*>(w_out);
  auto ws = static_cast<const float* const*>(wstage_peers);
  auto er = static_cast<int32_t*>(err);
  const bool wt = weighted != 0;
  constexpr int TPB = 128;
#define MOONEP_COMBINE(T, VEC)                                                                \
  do {                                                                                        \
    const bool vec_ok = (D % VEC) == 0;                                                       \
    const int vec = vec_ok ? VEC : 1;                                                         \
    dim3 grid(s, (D + TPB * vec - 1) / (TPB * vec));                                          \
    if (vec_ok)                                                                               \
      combine_recv_kernel<T, VEC><<<grid, TPB, 0, st>>>(static_cast<T*>(y), wo, s, K, D, wt,  \
          d, NvS, n_rows, ro, static_cast<const T* const*>(ystage_peers), ws, R, er);         \
    else                                                                                      \
      combine_recv_kernel<T, 1><<<grid, TPB, 0, st>>>(static_cast<T*>(y), wo, s, K, D, wt,    \
          d, NvS, n_rows, ro, static_cast<const T* const*>(ystage_peers), ws, R, er);         \
  } while (0)
  switch (dtype) {
    case 0: MOONEP_COMBINE(__nv_bfloat16, 8); break;
    case 1: MOONEP_COMBINE(__half, 8); break;
    case 2: MOONEP_COMBINE(float, 4); break;
    case 3: MOONEP_COMBINE(double, 2); break;
    default: return fail(cudaErrorInvalidValue, "moonep_ep_combine_recv (dtype)");
  }
#undef MOONEP_COMBINE
  return fail(cudaGetLastError(), "moonep_ep_combine_recv");
}

MOONEP_EXPORT int moonep_ep_push_weights(int n, const void* const* local, const void* const* peers,
                                         const int64_t* row_bytes, const void* etc, int R, int B,
                                         int rank, const void* err, int num_sms, void* stream) {
  if (n < 1 || n > kMaxT) return fail(cudaErrorInvalidValue, "moonep_ep_push_weights (n)");
  TensorTable tt = make_table(n, local, peers, row_bytes);
  const int64_t mc = max_chunks_of(tt);
  dim3 grid(grid_for(static_cast<int64_t>(R) * B * mc, 1, num_sms * 4), n);
  push_weights_kernel<<<grid, 512, 0, static_cast<cudaStream_t>(stream)>>>(
      tt, static_cast<const int32_t*>(etc), R, B, rank, mc, static_cast<const int32_t*>(err));
  return fail(cudaGetLastError(), "moonep_ep_push_weights");
}

MOONEP_EXPORT int moonep_ep_reduce_grads(int n, const void* const* local, const void* const* peers,
                                         const int64_t* row_bytes, const void* etc, int R, int B,
                                         int rank, const void* err, int num_sms, int dtype,
                                         void* stream) {
  if (n < 1 || n > kMaxT) return fail(cudaErrorInvalidValue, "moonep_ep_reduce_grads (n)");
  if (dtype != MOONEP_DTYPE_F32 && dtype != MOONEP_DTYPE_BF16)
    return fail(cudaErrorInvalidValue, "moonep_ep_reduce_grads (dtype)");
  TensorTable tt = make_table(n, local, peers, row_bytes);
  const size_t smem = (2 * static_cast<size_t>(R) * B + B + 1) * sizeof(int32_t);
  if (smem > 48 * 1024) return fail(cudaErrorInvalidValue, "moonep_ep_reduce_grads (R*epn > 6000)");
  const int64_t esize = dtype == MOONEP_DTYPE_F32 ? 4 : 2;
  int64_t max_elems = 1;
  for (int i = 0; i < n; ++i) max_elems = max(max_elems, row_bytes[i] / esize);
  // Each block handles a slice of every replicated expert (see the kernel): size the grid for
  // one row's 16-byte vectors, at most a few waves.
  dim3 grid(grid_for((max_elems * esize + 15) / 16, 256, num_sms * 4));
  auto kernel = dtype == MOONEP_DTYPE_F32 ? reduce_grads_kernel<float>
                                          : reduce_grads_kernel<__nv_bfloat16>;
  kernel<<<grid, 256, smem, static_cast<cudaStream_t>(stream)>>>(
      tt, static_cast<const int32_t*>(etc), R, B, rank, static_cast<const int32_t*>(err));
  return fail(cudaGetLastError(), "moonep_ep_reduce_grads");
}

// Zero the consumed slots: `local` are this rank's slot tensors (peers unused).
MOONEP_EXPORT int moonep_ep_zero_slots(int n, const void* const* slots, const int64_t* row_bytes,
                                       const void* etc, int B, int rank, int num_sms,
                                       void* stream) {
  if (n < 1 || n > kMaxT) return fail(cudaErrorInvalidValue, "moonep_ep_zero_slots (n)");
  const void* none[kMaxT] = {};
  TensorTable tt = make_table(n, slots, none, row_bytes);
  const int64_t mc = max_chunks_of(tt);
  dim3 grid(grid_for(static_cast<int64_t>(B) * mc, 1, num_sms * 4), n);
  zero_slots_kernel<<<grid, 512, 0, static_cast<cudaStream_t>(stream)>>>(
      tt, static_cast<const int32_t*>(etc), B, rank, mc);
  return fail(cudaGetLastError(), "moonep_ep_zero_slots");
}
