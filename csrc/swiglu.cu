// SwiGLU of the routed experts, fused: one read of each input, one write of each output.
// Unfused, the forward (silu(g.float()) * u.float() -> bf16) moves ~38 bytes per element and the
// backward ~90 (every fp32 temporary is a full [M, F] pass); inside the moe_experts custom op
// torch.compile cannot fuse them either.  Here: forward 6 bytes, backward 12 bytes per element.
//
//   fwd:  a = bf16(silu(g) * u)                       silu(g) = g * sigmoid(g), fp32 math
//   bwd:  dg = bf16(da * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))))
//         du = bf16(da * silu(g))
//         a  = bf16(silu(g) * u)   (recomputed for w2's weight grad instead of saved)
// Same operation order as the torch reference (moonep_ops/swiglu.py); results agree to fp32
// rounding of exp (within one bf16 ulp), not bitwise.
#include <cuda_bf16.h>

#include "moonep_ep.h"

namespace {

struct Pack8 {  // 8 bf16 = 16 bytes
  __nv_bfloat162 v[4];
};

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ void fwd1(float g, float u, float& a) {
  const float s = g * sigmoidf_(g);
  a = s * u;
}

__device__ __forceinline__ void bwd1(float g, float u, float da, float& dg, float& du, float& a) {
  const float sig = sigmoidf_(g);
  const float s = g * sig;
  a = s * u;
  dg = da * u * (sig * (1.f + g * (1.f - sig)));
  du = da * s;
}

__global__ void swiglu_fwd_kernel(const __nv_bfloat16* __restrict__ g,
                                  const __nv_bfloat16* __restrict__ u,
                                  __nv_bfloat16* __restrict__ a, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n8 = n / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8; i += stride) {
    const Pack8 pg = reinterpret_cast<const Pack8*>(g)[i];
    const Pack8 pu = reinterpret_cast<const Pack8*>(u)[i];
    Pack8 pa;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fg = __bfloat1622float2(pg.v[j]), fu = __bfloat1622float2(pu.v[j]);
      float2 fa;
      fwd1(fg.x, fu.x, fa.x);
      fwd1(fg.y, fu.y, fa.y);
      pa.v[j] = __floats2bfloat162_rn(fa.x, fa.y);
    }
    reinterpret_cast<Pack8*>(a)[i] = pa;
  }
  for (int64_t i = n8 * 8 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    float fa;
    fwd1(__bfloat162float(g[i]), __bfloat162float(u[i]), fa);
    a[i] = __float2bfloat16_rn(fa);
  }
}

__global__ void swiglu_bwd_kernel(const __nv_bfloat16* __restrict__ g,
                                  const __nv_bfloat16* __restrict__ u,
                                  const __nv_bfloat16* __restrict__ da,
                                  __nv_bfloat16* __restrict__ dg, __nv_bfloat16* __restrict__ du,
                                  __nv_bfloat16* __restrict__ a, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n8 = n / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8; i += stride) {
    const Pack8 pg = reinterpret_cast<const Pack8*>(g)[i];
    const Pack8 pu = reinterpret_cast<const Pack8*>(u)[i];
    const Pack8 pd = reinterpret_cast<const Pack8*>(da)[i];
    Pack8 og, ou, oa;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fg = __bfloat1622float2(pg.v[j]), fu = __bfloat1622float2(pu.v[j]),
                   fd = __bfloat1622float2(pd.v[j]);
      float2 rg, ru, ra;
      bwd1(fg.x, fu.x, fd.x, rg.x, ru.x, ra.x);
      bwd1(fg.y, fu.y, fd.y, rg.y, ru.y, ra.y);
      og.v[j] = __floats2bfloat162_rn(rg.x, rg.y);
      ou.v[j] = __floats2bfloat162_rn(ru.x, ru.y);
      oa.v[j] = __floats2bfloat162_rn(ra.x, ra.y);
    }
    reinterpret_cast<Pack8*>(dg)[i] = og;
    reinterpret_cast<Pack8*>(du)[i] = ou;
    reinterpret_cast<Pack8*>(a)[i] = oa;
  }
  for (int64_t i = n8 * 8 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    float rg, ru, ra;
    bwd1(__bfloat162float(g[i]), __bfloat162float(u[i]), __bfloat162float(da[i]), rg, ru, ra);
    dg[i] = __float2bfloat16_rn(rg);
    du[i] = __float2bfloat16_rn(ru);
    a[i] = __float2bfloat16_rn(ra);
  }
}

int blocks_for(int64_t n, int num_sms) {
  const int64_t want = (n / 8 + 255) / 256;
  const int64_t cap = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * 8;
  return static_cast<int>(want < 1 ? 1 : (want > cap ? cap : want));
}

}  // namespace

using moonep_ep::fail;

// Pointers must be 16-byte aligned (whole-tensor bases from the caching allocator are).
MOONEP_EXPORT int moonep_ep_swiglu_fwd(const void* g, const void* u, void* a, int64_t n,
                                       int num_sms, void* stream) {
  if (n <= 0) return 0;
  swiglu_fwd_kernel<<<blocks_for(n, num_sms), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u),
      static_cast<__nv_bfloat16*>(a), n);
  return fail(cudaGetLastError(), "moonep_ep_swiglu_fwd");
}

MOONEP_EXPORT int moonep_ep_swiglu_bwd(const void* g, const void* u, const void* da, void* dg,
                                       void* du, void* a, int64_t n, int num_sms, void* stream) {
  if (n <= 0) return 0;
  swiglu_bwd_kernel<<<blocks_for(n, num_sms), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u),
      static_cast<const __nv_bfloat16*>(da), static_cast<__nv_bfloat16*>(dg),
      static_cast<__nv_bfloat16*>(du), static_cast<__nv_bfloat16*>(a), n);
  return fail(cudaGetLastError(), "moonep_ep_swiglu_bwd");
}
