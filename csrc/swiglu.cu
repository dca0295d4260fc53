// SwiGLU of the routed experts, fused: one read of each input, one write of each output.
// Unfused, the forward (silu(g.float()) * u.float() -> bf16) moves ~38 bytes per element and the
// backward ~90 (every fp32 temporary is a full [M, F] pass); inside the moe_experts custom op
// torch.compile cannot fuse them either.  Here: forward 6 bytes, backward 12 bytes per element.
//
//   fwd:  a = bf16(silu(g) * u)                       silu(g) = g * sigmoid(g), fp32 math
//   bwd:  dg = bf16(da * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))))
//         du = bf16(da * silu(g))
//         a  = bf16(silu(g) * u)   (recomputed for w2's weight grad instead of saved)
// Same operation order as the torch reference (moonep_ops/ops/swiglu.py); results agree to fp32
// rounding of exp (within one bf16 ulp), not bitwise.
//
// The gated variant (moonep_ep_glu_fwd / _bwd, the experts with biases or gpt-oss's clamped
// SwiGLU, moonep::moe_experts_ext) does the same in one pass, adding each row's expert biases
// (b1, b3 [G, F], the row's group found in cu_seqlens) before the activation:
//   g' = g + b1[grp], u' = u + b3[grp], gc = min(g', limit), uc = clamp(u', -limit, limit)
//   fwd:  a  = bf16(gc * sigmoid(alpha * gc) * (uc + offset))
//   bwd:  dg = bf16(g' <= limit ? da * (uc + offset) * (sig * (1 + alpha * gc * (1 - sig))) : 0)
//         du = bf16(|u'| <= limit ? da * gc * sig : 0),  a recomputed
// swiglu is alpha = 1, limit = inf, offset = 0 (bitwise the plain kernel's values).
#include <cuda_bf16.h>

#include "ep_internal.h"

namespace {

struct Pack8 {  // 8 bf16 = 16 bytes
  __nv_bfloat16 v[8];
};

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

// x = (g, u) -> y = (a)
struct FwdOp {
  static constexpr int kIn = 2, kOut = 1;
  __device__ __forceinline__ void operator()(const float (&x)[kIn], float (&y)[kOut]) const {
    const float s = x[0] * sigmoidf_(x[0]);
    y[0] = s * x[1];
  }
};

// x = (g, u, da) -> y = (dg, du, a)
struct BwdOp {
  static constexpr int kIn = 3, kOut = 3;
  __device__ __forceinline__ void operator()(const float (&x)[kIn], float (&y)[kOut]) const {
    const float g = x[0], u = x[1], da = x[2];
    const float sig = sigmoidf_(g);
    const float s = g * sig;
    y[0] = da * u * (sig * (1.f + g * (1.f - sig)));
    y[1] = da * s;
    y[2] = s * u;
  }
};

template <int N>
struct Ptrs {
  const __nv_bfloat16* p[N];
};
template <int N>
struct OutPtrs {
  __nv_bfloat16* p[N];
};

// Elementwise over n bf16 elements of every tensor: a persistent grid (kBlocksPerSm blocks of
// 256 threads per SM) striding over packs of 8 (16-byte loads and stores), each thread loading
// kUnroll packs of every input before computing any, then the n % 8 tail one element per thread.
// fp32 math in Op.  Why this shape (diagnostics/swiglu_probe.py, H100, five [M, F] from
// [4096, 512] to [49024, 768] and [36864, 2880]): with one pack in flight per thread the
// backward reached 0.95-1.08 TB/s whatever the grid; four packs in flight and two blocks per SM
// 1.23-1.80 TB/s (torch's bf16 add on the same tensors: 2.1-3.0), the forward 1.88-2.47 against
// 1.45-1.99; eight packs or more blocks per SM were slower at the larger shapes.
constexpr int kUnroll = 4, kBlocksPerSm = 2;

template <class Op>
__global__ void __launch_bounds__(256, kBlocksPerSm)
swiglu_kernel(Ptrs<Op::kIn> in, OutPtrs<Op::kOut> out, int64_t n) {
  constexpr int I = Op::kIn, O = Op::kOut;
  const Op op;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t n8 = n / 8;
  for (int64_t base = first; base < n8; base += stride * kUnroll) {
    Pack8 pin[kUnroll][I];
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      const int64_t i = base + r * stride;
#pragma unroll
      for (int k = 0; k < I; ++k) {
        if (i < n8) pin[r][k] = reinterpret_cast<const Pack8*>(in.p[k])[i];
      }
    }
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      const int64_t i = base + r * stride;
      if (i >= n8) break;
      Pack8 pout[O];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float x[I], y[O];
#pragma unroll
        for (int k = 0; k < I; ++k) x[k] = __bfloat162float(pin[r][k].v[j]);
        op(x, y);
#pragma unroll
        for (int k = 0; k < O; ++k) pout[k].v[j] = __float2bfloat16_rn(y[k]);
      }
#pragma unroll
      for (int k = 0; k < O; ++k) reinterpret_cast<Pack8*>(out.p[k])[i] = pout[k];
    }
  }
  for (int64_t i = n8 * 8 + first; i < n; i += stride) {
    float x[I], y[O];
#pragma unroll
    for (int k = 0; k < I; ++k) x[k] = __bfloat162float(in.p[k][i]);
    op(x, y);
#pragma unroll
    for (int k = 0; k < O; ++k) out.p[k][i] = __float2bfloat16_rn(y[k]);
  }
}

// swiglu_kernel's grid: enough blocks for every thread to have kUnroll packs, at most
// kBlocksPerSm per SM.
int swiglu_blocks(int64_t n, int num_sms) {
  const int64_t want = (n / 8 + 256 * kUnroll - 1) / (256 * kUnroll);
  const int64_t cap = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * kBlocksPerSm;
  return static_cast<int>(want < 1 ? 1 : (want > cap ? cap : want));
}

int blocks_for(int64_t n, int num_sms) {
  const int64_t want = (n / 8 + 255) / 256;
  const int64_t cap = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * 8;
  return static_cast<int>(want < 1 ? 1 : (want > cap ? cap : want));
}

// The gated variant: every pack of 8 lies in one row (F % 8 == 0), whose group g (the number of
// inclusive ends cu[0..G-1] <= row, G for rows past the last group: bias 0, output unread) picks
// the bias rows.
struct GluParams {
  const __nv_bfloat16* b1;  // [G, F] or null
  const __nv_bfloat16* b3;  // [G, F] or null
  const int* cu;            // [G] inclusive end rows
  int G;
  int64_t F;
  float alpha, limit, offset;
};

__device__ __forceinline__ int group_of_row(const int* cu, int G, int64_t row) {
  int lo = 0, hi = G;  // first g with cu[g] > row
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(cu[mid]) <= row) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <bool kBwd>
__global__ void glu_kernel(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ u,
                           const __nv_bfloat16* __restrict__ da, __nv_bfloat16* __restrict__ a,
                           __nv_bfloat16* __restrict__ dg, __nv_bfloat16* __restrict__ du,
                           GluParams p, int64_t n8) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += stride) {
    const int64_t row = (i * 8) / p.F, col = (i * 8) % p.F;
    const int grp = group_of_row(p.cu, p.G, row);
    Pack8 pg = reinterpret_cast<const Pack8*>(g)[i], pu = reinterpret_cast<const Pack8*>(u)[i];
    Pack8 pb1, pb3, pda, pa, pdg, pdu;
    const bool has_b1 = p.b1 != nullptr && grp < p.G, has_b3 = p.b3 != nullptr && grp < p.G;
    if (has_b1) pb1 = *reinterpret_cast<const Pack8*>(p.b1 + grp * p.F + col);
    if (has_b3) pb3 = *reinterpret_cast<const Pack8*>(p.b3 + grp * p.F + col);
    if (kBwd) pda = reinterpret_cast<const Pack8*>(da)[i];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float gv = __bfloat162float(pg.v[j]), uv = __bfloat162float(pu.v[j]);
      if (has_b1) gv = gv + __bfloat162float(pb1.v[j]);
      if (has_b3) uv = uv + __bfloat162float(pb3.v[j]);
      const float gc = fminf(gv, p.limit), uc = fminf(fmaxf(uv, -p.limit), p.limit);
      const float sig = sigmoidf_(p.alpha * gc);
      const float s = gc * sig;
      const float up = uc + p.offset;
      pa.v[j] = __float2bfloat16_rn(s * up);
      if (kBwd) {
        const float d = __bfloat162float(pda.v[j]);
        const float dgv = d * up * (sig * (1.f + p.alpha * gc * (1.f - sig)));
        const float duv = d * s;
        pdg.v[j] = __float2bfloat16_rn(gv <= p.limit ? dgv : 0.f);
        pdu.v[j] = __float2bfloat16_rn(uv >= -p.limit && uv <= p.limit ? duv : 0.f);
      }
    }
    reinterpret_cast<Pack8*>(a)[i] = pa;
    if (kBwd) {
      reinterpret_cast<Pack8*>(dg)[i] = pdg;
      reinterpret_cast<Pack8*>(du)[i] = pdu;
    }
  }
}

int glu_launch(bool bwd, const void* g, const void* u, const void* da, void* a, void* dg,
               void* du, const void* b1, const void* b3, const void* cu, int G, int64_t F,
               int64_t n, float alpha, float limit, float offset, int num_sms, void* stream) {
  const GluParams p{static_cast<const __nv_bfloat16*>(b1), static_cast<const __nv_bfloat16*>(b3),
                    static_cast<const int*>(cu), G, F, alpha, limit, offset};
  const auto* gp = static_cast<const __nv_bfloat16*>(g);
  const auto* up = static_cast<const __nv_bfloat16*>(u);
  const auto* dap = static_cast<const __nv_bfloat16*>(da);
  auto* ap = static_cast<__nv_bfloat16*>(a);
  auto* dgp = static_cast<__nv_bfloat16*>(dg);
  auto* dup = static_cast<__nv_bfloat16*>(du);
  const int blocks = blocks_for(n, num_sms);
  const auto s = static_cast<cudaStream_t>(stream);
  if (bwd) glu_kernel<true><<<blocks, 256, 0, s>>>(gp, up, dap, ap, dgp, dup, p, n / 8);
  else glu_kernel<false><<<blocks, 256, 0, s>>>(gp, up, dap, ap, dgp, dup, p, n / 8);
  return 0;
}

// The route-weight pass of moonep::moe_experts_ext with the down bias folded in (one read of y,
// one write of z):  z[m] = bf16((y[m] + b2[grp(m)]) * w[m])  (fp32 math; b2 may be null).
__global__ void bias_scale_rows_kernel(const __nv_bfloat16* __restrict__ y,
                                       const __nv_bfloat16* __restrict__ b2,
                                       const int* __restrict__ cu, int G, int64_t D,
                                       const float* __restrict__ w, __nv_bfloat16* __restrict__ z,
                                       int64_t n8) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += stride) {
    const int64_t row = (i * 8) / D, col = (i * 8) % D;
    const int grp = group_of_row(cu, G, row);
    const Pack8 py = reinterpret_cast<const Pack8*>(y)[i];
    Pack8 pb, pz;
    const bool has_b = b2 != nullptr && grp < G;
    if (has_b) pb = *reinterpret_cast<const Pack8*>(b2 + grp * D + col);
    const float wr = w[row];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = __bfloat162float(py.v[j]);
      if (has_b) v = v + __bfloat162float(pb.v[j]);
      pz.v[j] = __float2bfloat16_rn(v * wr);
    }
    reinterpret_cast<Pack8*>(z)[i] = pz;
  }
}

// Its backward, one warp per row: dy[m] = bf16(dz[m] * w[m]) and
// d_rows[m] = sum_D dz[m] * (y[m] + b2[grp(m)]) in fp32 (lanes strided over the row's packs,
// then a shuffle reduction: fp32 sums in another order than torch's, not bitwise).
__global__ void bias_scale_rows_bwd_kernel(const __nv_bfloat16* __restrict__ dz,
                                           const __nv_bfloat16* __restrict__ y,
                                           const __nv_bfloat16* __restrict__ b2,
                                           const int* __restrict__ cu, int G, int64_t D,
                                           const float* __restrict__ w,
                                           __nv_bfloat16* __restrict__ dy,
                                           float* __restrict__ d_rows, int64_t M) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t packs = D / 8;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
       row < M; row += warps) {
    const int grp = group_of_row(cu, G, row);
    const bool has_b = b2 != nullptr && grp < G;
    const float wr = w[row];
    float acc = 0.f;
    for (int64_t p = lane; p < packs; p += 32) {
      const int64_t i = row * packs + p;
      const Pack8 pdz = reinterpret_cast<const Pack8*>(dz)[i];
      const Pack8 py = reinterpret_cast<const Pack8*>(y)[i];
      Pack8 pb, pdy;
      if (has_b) pb = *reinterpret_cast<const Pack8*>(b2 + grp * D + p * 8);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float d = __bfloat162float(pdz.v[j]);
        float v = __bfloat162float(py.v[j]);
        if (has_b) v = v + __bfloat162float(pb.v[j]);
        acc += d * v;
        pdy.v[j] = __float2bfloat16_rn(d * wr);
      }
      reinterpret_cast<Pack8*>(dy)[i] = pdy;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) d_rows[row] = acc;
  }
}

// The bias grads: out[g, c] = sum of x[m, c] over group g's rows, fp32, in an order fixed by
// the code (not by the grid or the SM count: run to run bitwise, no atomics); rows past cu[G-1]
// are not read.  Block (t, g) sums the kSumPacks * 8 columns of tile t over group g's rows with
// kSumLanes row lanes: lane r adds rows lo + r, lo + r + kSumLanes, ... in ascending order, then
// the lanes' sums are added in lane order.  Why blocks of row lanes, not one thread per
// (group, 8 columns) walking all its group's rows: at gpt-oss-120b's sizes (16 non-empty groups
// of ~2k rows, C = 2880) that is 5760 threads, 23 blocks on 23 SMs, a fraction of the memory
// bandwidth (~1 ms per call, estimated, against ~70 us to read the [32k, 2880] bf16 input
// once); here each group has ceil(C / 32) blocks of 256 threads (1440 blocks in all).
constexpr int kSumPacks = 4;   // 32 columns (64 bytes of a row) per block
constexpr int kSumLanes = 64;  // row lanes per block
constexpr int kSumThreads = kSumPacks * kSumLanes;

__global__ void __launch_bounds__(kSumThreads)
group_sums_kernel(const __nv_bfloat16* __restrict__ x, const int* __restrict__ cu, int64_t C,
                  float* __restrict__ out) {
  __shared__ float part[kSumLanes][kSumPacks * 8];
  const int g = blockIdx.y;
  const int pl = threadIdx.x % kSumPacks, lane = threadIdx.x / kSumPacks;
  const int64_t packs = C / 8;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kSumPacks + pl;
  const int64_t lo = g == 0 ? 0 : cu[g - 1], hi = cu[g];
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (p < packs) {
#pragma unroll 4
    for (int64_t m = lo + lane; m < hi; m += kSumLanes) {
      const Pack8 px = reinterpret_cast<const Pack8*>(x)[m * packs + p];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += __bfloat162float(px.v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) part[lane][pl * 8 + j] = acc[j];
  __syncthreads();
  const int c = threadIdx.x;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * (kSumPacks * 8) + c;
  if (c < kSumPacks * 8 && col < C) {
    float s = 0.f;
    for (int r = 0; r < kSumLanes; ++r) s += part[r][c];
    out[g * C + col] = s;
  }
}

}  // namespace

using moonep_ep::fail;

// Pointers must be 16-byte aligned (whole-tensor bases from the caching allocator are).
MOONEP_EXPORT int moonep_ep_swiglu_fwd(const void* g, const void* u, void* a, int64_t n,
                                       int num_sms, void* stream) {
  if (n <= 0) return 0;
  const Ptrs<2> in{{static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u)}};
  const OutPtrs<1> out{{static_cast<__nv_bfloat16*>(a)}};
  swiglu_kernel<FwdOp><<<swiglu_blocks(n, num_sms), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      in, out, n);
  return fail(cudaGetLastError(), "moonep_ep_swiglu_fwd");
}

MOONEP_EXPORT int moonep_ep_swiglu_bwd(const void* g, const void* u, const void* da, void* dg,
                                       void* du, void* a, int64_t n, int num_sms, void* stream) {
  if (n <= 0) return 0;
  const Ptrs<3> in{{static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u),
                    static_cast<const __nv_bfloat16*>(da)}};
  const OutPtrs<3> out{{static_cast<__nv_bfloat16*>(dg), static_cast<__nv_bfloat16*>(du),
                        static_cast<__nv_bfloat16*>(a)}};
  swiglu_kernel<BwdOp><<<swiglu_blocks(n, num_sms), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      in, out, n);
  return fail(cudaGetLastError(), "moonep_ep_swiglu_bwd");
}

// The gated variant (header: moonep_ep.h).  F % 8 == 0, n = M*F; b1, b3 may be null.
MOONEP_EXPORT int moonep_ep_glu_fwd(const void* g, const void* u, const void* b1, const void* b3,
                                    const void* cu, int G, int64_t F, void* a, int64_t n,
                                    float alpha, float limit, float offset, int num_sms,
                                    void* stream) {
  if (n <= 0) return 0;
  if (F <= 0 || F % 8 || n % F || G < 1) return fail(cudaErrorInvalidValue, "moonep_ep_glu_fwd");
  glu_launch(false, g, u, nullptr, a, nullptr, nullptr, b1, b3, cu, G, F, n, alpha, limit,
             offset, num_sms, stream);
  return fail(cudaGetLastError(), "moonep_ep_glu_fwd");
}

MOONEP_EXPORT int moonep_ep_glu_bwd(const void* g, const void* u, const void* da, const void* b1,
                                    const void* b3, const void* cu, int G, int64_t F, void* dg,
                                    void* du, void* a, int64_t n, float alpha, float limit,
                                    float offset, int num_sms, void* stream) {
  if (n <= 0) return 0;
  if (F <= 0 || F % 8 || n % F || G < 1) return fail(cudaErrorInvalidValue, "moonep_ep_glu_bwd");
  glu_launch(true, g, u, da, a, dg, du, b1, b3, cu, G, F, n, alpha, limit, offset, num_sms,
             stream);
  return fail(cudaGetLastError(), "moonep_ep_glu_bwd");
}

MOONEP_EXPORT int moonep_ep_bias_scale_rows(const void* y, const void* b2, const void* cu, int G,
                                            int64_t D, const void* w, void* z, int64_t M,
                                            int num_sms, void* stream) {
  if (M <= 0) return 0;
  if (D <= 0 || D % 8 || G < 1) return fail(cudaErrorInvalidValue, "moonep_ep_bias_scale_rows");
  const int64_t n = M * D;
  bias_scale_rows_kernel<<<blocks_for(n, num_sms), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(y), static_cast<const __nv_bfloat16*>(b2),
      static_cast<const int*>(cu), G, D, static_cast<const float*>(w),
      static_cast<__nv_bfloat16*>(z), n / 8);
  return fail(cudaGetLastError(), "moonep_ep_bias_scale_rows");
}

MOONEP_EXPORT int moonep_ep_bias_scale_rows_bwd(const void* dz, const void* y, const void* b2,
                                                const void* cu, int G, int64_t D, const void* w,
                                                void* dy, void* d_rows, int64_t M, int num_sms,
                                                void* stream) {
  if (M <= 0) return 0;
  if (D <= 0 || D % 8 || G < 1) {
    return fail(cudaErrorInvalidValue, "moonep_ep_bias_scale_rows_bwd");
  }
  const int64_t cap = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * 8;
  const int64_t want = (M + 7) / 8;  // 8 warps (rows) per 256-thread block
  const int blocks = static_cast<int>(want < cap ? want : cap);
  bias_scale_rows_bwd_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(dz), static_cast<const __nv_bfloat16*>(y),
      static_cast<const __nv_bfloat16*>(b2), static_cast<const int*>(cu), G, D,
      static_cast<const float*>(w), static_cast<__nv_bfloat16*>(dy),
      static_cast<float*>(d_rows), M);
  return fail(cudaGetLastError(), "moonep_ep_bias_scale_rows_bwd");
}

MOONEP_EXPORT int moonep_ep_group_sums(const void* x, const void* cu, int G, int64_t C, void* out,
                                       int num_sms, void* stream) {
  (void)num_sms;  // the grid is one block per (group, 32 columns), whatever the SM count
  if (G < 1 || G > 65535 || C <= 0 || C % 8) {
    return fail(cudaErrorInvalidValue, "moonep_ep_group_sums");
  }
  const int64_t tiles = (C / 8 + kSumPacks - 1) / kSumPacks;
  group_sums_kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(G)), kSumThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const int*>(cu), C,
      static_cast<float*>(out));
  return fail(cudaGetLastError(), "moonep_ep_group_sums");
}
