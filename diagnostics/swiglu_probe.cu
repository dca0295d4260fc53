// Variants of the plain SwiGLU kernels (csrc/swiglu.cu), timed side by side by
// diagnostics/swiglu_probe.py.  Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a
//   -shared -Xcompiler -fPIC -o build/swiglu_probe.so diagnostics/swiglu_probe.cu
#include <cuda_bf16.h>
#include <cstdint>

namespace {
struct Pack8 { __nv_bfloat16 v[8]; };                 // 2-byte aligned: eight 2-byte accesses
struct alignas(16) Pack8A { __nv_bfloat16 v[8]; };    // one 16-byte access
__device__ __forceinline__ float sig_precise(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float sig_fast(float x) { return __frcp_rn(1.f + __expf(-x)); }

template <bool kFast>
__device__ __forceinline__ void bwd_math(float g, float u, float d, float& dg, float& du, float& a) {
  const float sig = kFast ? sig_fast(g) : sig_precise(g);
  const float s = g * sig;
  dg = d * u * (sig * (1.f + g * (1.f - sig)));
  du = d * s;
  a = s * u;
}
template <bool kFast>
__device__ __forceinline__ float fwd_math(float g, float u) {
  const float sig = kFast ? sig_fast(g) : sig_precise(g);
  return g * sig * u;
}

// v0: the library's kernel (pointer structs, grid-stride, blocks capped at 8 per SM)
template <int N> struct Ptrs { const __nv_bfloat16* p[N]; };
template <int N> struct OutPtrs { __nv_bfloat16* p[N]; };
__global__ void v0_bwd(Ptrs<3> in, OutPtrs<3> out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < n / 8; i += stride) {
    Pack8 pin[3], pout[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) pin[k] = reinterpret_cast<const Pack8*>(in.p[k])[i];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float y0, y1, y2;
      bwd_math<false>(__bfloat162float(pin[0].v[j]), __bfloat162float(pin[1].v[j]),
                      __bfloat162float(pin[2].v[j]), y0, y1, y2);
      pout[0].v[j] = __float2bfloat16_rn(y0);
      pout[1].v[j] = __float2bfloat16_rn(y1);
      pout[2].v[j] = __float2bfloat16_rn(y2);
    }
#pragma unroll
    for (int k = 0; k < 3; ++k) reinterpret_cast<Pack8*>(out.p[k])[i] = pout[k];
  }
}
__global__ void v0_fwd(Ptrs<2> in, OutPtrs<1> out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < n / 8; i += stride) {
    Pack8 pg = reinterpret_cast<const Pack8*>(in.p[0])[i], pu = reinterpret_cast<const Pack8*>(in.p[1])[i], pa;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      pa.v[j] = __float2bfloat16_rn(fwd_math<false>(__bfloat162float(pg.v[j]), __bfloat162float(pu.v[j])));
    reinterpret_cast<Pack8*>(out.p[0])[i] = pa;
  }
}

// v1..: restrict pointers, kU packs per thread (strided by the grid), one pass, no loop
template <bool kFast, int kU, int kMinBlocks = 1, class P = Pack8>
__global__ void __launch_bounds__(256, kMinBlocks) vr_bwd(const P* __restrict__ g, const P* __restrict__ u,
                       const P* __restrict__ da, P* __restrict__ dg, P* __restrict__ du,
                       P* __restrict__ a, int64_t n8) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t base = first; base < n8; base += stride * kU) {
    P pg[kU], pu[kU], pd[kU];
#pragma unroll
    for (int r = 0; r < kU; ++r) {
      const int64_t i = base + r * stride;
      if (i < n8) { pg[r] = g[i]; pu[r] = u[i]; pd[r] = da[i]; }
    }
#pragma unroll
    for (int r = 0; r < kU; ++r) {
      const int64_t i = base + r * stride;
      if (i >= n8) break;
      P o0, o1, o2;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float y0, y1, y2;
        bwd_math<kFast>(__bfloat162float(pg[r].v[j]), __bfloat162float(pu[r].v[j]),
                        __bfloat162float(pd[r].v[j]), y0, y1, y2);
        o0.v[j] = __float2bfloat16_rn(y0);
        o1.v[j] = __float2bfloat16_rn(y1);
        o2.v[j] = __float2bfloat16_rn(y2);
      }
      dg[i] = o0; du[i] = o1; a[i] = o2;
    }
  }
}
template <bool kFast, int kU, int kMinBlocks = 1, class P = Pack8>
__global__ void __launch_bounds__(256, kMinBlocks) vr_fwd(const P* __restrict__ g, const P* __restrict__ u,
                       P* __restrict__ a, int64_t n8) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t base = first; base < n8; base += stride * kU) {
    P pg[kU], pu[kU];
#pragma unroll
    for (int r = 0; r < kU; ++r) {
      const int64_t i = base + r * stride;
      if (i < n8) { pg[r] = g[i]; pu[r] = u[i]; }
    }
#pragma unroll
    for (int r = 0; r < kU; ++r) {
      const int64_t i = base + r * stride;
      if (i >= n8) break;
      P o;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        o.v[j] = __float2bfloat16_rn(fwd_math<kFast>(__bfloat162float(pg[r].v[j]), __bfloat162float(pu[r].v[j])));
      a[i] = o;
    }
  }
}
int cap_blocks(int64_t n8, int per_thread, int cap) {
  int64_t want = (n8 + 256LL * per_thread - 1) / (256LL * per_thread);
  if (cap > 0 && want > cap) want = cap;
  return static_cast<int>(want < 1 ? 1 : want);
}
}  // namespace

// variant: 0 library; 1 restrict U1 full grid; 2 restrict U2 full grid; 3 restrict U4 full grid;
// 4 restrict U1 grid-stride capped at 8 blocks/SM; 5 = 2 with fast sigmoid; 6 = 1 with fast
extern "C" int probe_bwd(int variant, const void* g, const void* u, const void* da, void* dg, void* du,
                         void* a, int64_t n, int num_sms, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t n8 = n / 8;
  auto G = static_cast<const Pack8*>(g); auto U = static_cast<const Pack8*>(u);
  auto D = static_cast<const Pack8*>(da);
  auto DG = static_cast<Pack8*>(dg); auto DU = static_cast<Pack8*>(du); auto A = static_cast<Pack8*>(a);
  auto GA = static_cast<const Pack8A*>(g); auto UA = static_cast<const Pack8A*>(u);
  auto DA = static_cast<const Pack8A*>(da);
  auto DGA = static_cast<Pack8A*>(dg); auto DUA = static_cast<Pack8A*>(du); auto AA = static_cast<Pack8A*>(a);
  switch (variant) {
    case 0: {
      Ptrs<3> in{{static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u), static_cast<const __nv_bfloat16*>(da)}};
      OutPtrs<3> out{{static_cast<__nv_bfloat16*>(dg), static_cast<__nv_bfloat16*>(du), static_cast<__nv_bfloat16*>(a)}};
      v0_bwd<<<cap_blocks(n8, 1, num_sms * 8), 256, 0, s>>>(in, out, n); break; }
    case 1: vr_bwd<false, 1><<<cap_blocks(n8, 1, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 2: vr_bwd<false, 2><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 3: vr_bwd<false, 4><<<cap_blocks(n8, 4, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 4: vr_bwd<false, 1><<<cap_blocks(n8, 1, num_sms * 8), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 5: vr_bwd<true, 2><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 6: vr_bwd<true, 1><<<cap_blocks(n8, 1, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 7: vr_bwd<false, 4, 2><<<cap_blocks(n8, 4, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 8: vr_bwd<false, 8, 1><<<cap_blocks(n8, 8, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 9: vr_bwd<false, 4, 2><<<cap_blocks(n8, 4, num_sms * 2), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 10: vr_bwd<false, 2, 3><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(G, U, D, DG, DU, A, n8); break;
    case 11: vr_bwd<false, 1, 1, Pack8A><<<cap_blocks(n8, 1, 0), 256, 0, s>>>(GA, UA, DA, DGA, DUA, AA, n8); break;
    case 12: vr_bwd<false, 2, 4, Pack8A><<<cap_blocks(n8, 2, num_sms * 4), 256, 0, s>>>(GA, UA, DA, DGA, DUA, AA, n8); break;
    case 13: vr_bwd<false, 4, 2, Pack8A><<<cap_blocks(n8, 4, num_sms * 2), 256, 0, s>>>(GA, UA, DA, DGA, DUA, AA, n8); break;
    case 14: vr_bwd<false, 2, 1, Pack8A><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(GA, UA, DA, DGA, DUA, AA, n8); break;
    case 15: vr_bwd<false, 1, 1, Pack8A><<<cap_blocks(n8, 1, num_sms * 8), 256, 0, s>>>(GA, UA, DA, DGA, DUA, AA, n8); break;
    default: return 1;
  }
  return static_cast<int>(cudaGetLastError());
}
extern "C" int probe_fwd(int variant, const void* g, const void* u, void* a, int64_t n, int num_sms,
                         void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t n8 = n / 8;
  auto G = static_cast<const Pack8*>(g); auto U = static_cast<const Pack8*>(u); auto A = static_cast<Pack8*>(a);
  auto GA = static_cast<const Pack8A*>(g); auto UA = static_cast<const Pack8A*>(u); auto AA = static_cast<Pack8A*>(a);
  switch (variant) {
    case 0: {
      Ptrs<2> in{{static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u)}};
      OutPtrs<1> out{{static_cast<__nv_bfloat16*>(a)}};
      v0_fwd<<<cap_blocks(n8, 1, num_sms * 8), 256, 0, s>>>(in, out, n); break; }
    case 1: vr_fwd<false, 1><<<cap_blocks(n8, 1, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 2: vr_fwd<false, 2><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 3: vr_fwd<false, 4><<<cap_blocks(n8, 4, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 4: vr_fwd<false, 1><<<cap_blocks(n8, 1, num_sms * 8), 256, 0, s>>>(G, U, A, n8); break;
    case 5: vr_fwd<true, 2><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 6: vr_fwd<true, 1><<<cap_blocks(n8, 1, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 7: vr_fwd<false, 4, 2><<<cap_blocks(n8, 4, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 8: vr_fwd<false, 8, 1><<<cap_blocks(n8, 8, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 9: vr_fwd<false, 4, 2><<<cap_blocks(n8, 4, num_sms * 2), 256, 0, s>>>(G, U, A, n8); break;
    case 10: vr_fwd<false, 2, 3><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(G, U, A, n8); break;
    case 11: vr_fwd<false, 1, 1, Pack8A><<<cap_blocks(n8, 1, 0), 256, 0, s>>>(GA, UA, AA, n8); break;
    case 12: vr_fwd<false, 2, 4, Pack8A><<<cap_blocks(n8, 2, num_sms * 4), 256, 0, s>>>(GA, UA, AA, n8); break;
    case 13: vr_fwd<false, 4, 2, Pack8A><<<cap_blocks(n8, 4, num_sms * 2), 256, 0, s>>>(GA, UA, AA, n8); break;
    case 14: vr_fwd<false, 2, 1, Pack8A><<<cap_blocks(n8, 2, 0), 256, 0, s>>>(GA, UA, AA, n8); break;
    case 15: vr_fwd<false, 1, 1, Pack8A><<<cap_blocks(n8, 1, num_sms * 8), 256, 0, s>>>(GA, UA, AA, n8); break;
    default: return 1;
  }
  return static_cast<int>(cudaGetLastError());
}
