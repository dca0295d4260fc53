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

// Elementwise over n bf16 elements of every tensor: a grid-stride loop over packs of 8 (16-byte
// loads and stores), then the n % 8 tail one element per thread.  fp32 math in Op.
template <class Op>
__global__ void swiglu_kernel(Ptrs<Op::kIn> in, OutPtrs<Op::kOut> out, int64_t n) {
  constexpr int I = Op::kIn, O = Op::kOut;
  const Op op;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t n8 = n / 8;
  for (int64_t i = first; i < n8; i += stride) {
    Pack8 pin[I], pout[O];
#pragma unroll
    for (int k = 0; k < I; ++k) pin[k] = reinterpret_cast<const Pack8*>(in.p[k])[i];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float x[I], y[O];
#pragma unroll
      for (int k = 0; k < I; ++k) x[k] = __bfloat162float(pin[k].v[j]);
      op(x, y);
#pragma unroll
      for (int k = 0; k < O; ++k) pout[k].v[j] = __float2bfloat16_rn(y[k]);
    }
#pragma unroll
    for (int k = 0; k < O; ++k) reinterpret_cast<Pack8*>(out.p[k])[i] = pout[k];
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
  const Ptrs<2> in{{static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u)}};
  const OutPtrs<1> out{{static_cast<__nv_bfloat16*>(a)}};
  swiglu_kernel<FwdOp><<<blocks_for(n, num_sms), 256, 0, static_cast<cudaStream_t>(stream)>>>(
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
  swiglu_kernel<BwdOp><<<blocks_for(n, num_sms), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      in, out, n);
  return fail(cudaGetLastError(), "moonep_ep_swiglu_bwd");
}
