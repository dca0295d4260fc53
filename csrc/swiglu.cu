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

// 8 bf16 = 16 bytes, 16-byte aligned: one 16-byte access each (ld.global.v4 / st.global.v4),
// where a 2-byte aligned struct compiles to eight 2-byte accesses.  Every kernel here takes
// 16-byte aligned bases (the callers check) and offsets in whole packs.
struct alignas(16) Pack8 {
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

// Elementwise over n bf16 elements of every tensor: one pack of 8 (16-byte loads and stores)
// per thread of a grid that covers every pack, then the n % 8 tail one element per thread.
// fp32 math in Op.  Measured (diagnostics/swiglu_probe.py, H100, [M, F] from [4096, 512] to
// [49024, 768] and [36864, 2880]): 2.2-2.8 TB/s backward and 1.95-2.8 forward, about torch's
// bf16 add on the same tensors; the 16-byte alignment of Pack8 is what matters (with 2-byte
// accesses 0.93-1.06 / 1.4-1.9 TB/s).  More packs per thread, a persistent grid of 2-8 blocks
// per SM or __restrict__ were no faster.
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

// swiglu_kernel's grid: a thread per pack of 8 (the grid-stride loop only covers grids past
// 2^31); against at most 8 blocks per SM, the old grid: as fast or 2-5 % faster (swiglu_probe.py
// "aligned U1").
int pack_blocks(int64_t n) {
  const int64_t want = (n / 8 + 255) / 256;
  return static_cast<int>(want < 1 ? 1 : (want > 0x7fffffff ? 0x7fffffff : want));
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

// One pack of the gated variant (the formulas at the top), shared by both traversals
// (glu_kernel, glu_kernel_row_tiles): their a, dg and du are bitwise equal.  pda, pb1, pb3 are
// read only when kBwd, has_b1, has_b3.
template <bool kBwd>
__device__ __forceinline__ void glu_pack(const GluParams& p, const Pack8& pg, const Pack8& pu,
                                         const Pack8& pda, bool has_b1, const Pack8& pb1,
                                         bool has_b3, const Pack8& pb3, Pack8& pa, Pack8& pdg,
                                         Pack8& pdu) {
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
}

// The per-row elementwise kernels (glu_kernel, bias_scale_rows_kernel): a block per row (the
// grid striding over rows past 2^31 - 1 blocks), its threads over the row's packs of 8.  The
// row's group and route weight are found once per row, where a flat walk over packs divided a
// 64-bit index by the row length and searched cu once per pack: on the H100 at gpt-oss-120b's
// [36864, 2880] that cost the forward GLU 260 us against 229 for the plain SwiGLU's one pass.
int row_threads(int64_t packs) {   // a warp multiple covering the row's packs, at most 512
  const int64_t t = (packs + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 512 ? 512 : t));
}
int row_blocks(int64_t M) { return static_cast<int>(M < 1 ? 1 : (M > 0x7fffffff ? 0x7fffffff : M)); }

// The forward, and the backward without biases.
template <bool kBwd>
__global__ void glu_kernel(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ u,
                           const __nv_bfloat16* __restrict__ da, __nv_bfloat16* __restrict__ a,
                           __nv_bfloat16* __restrict__ dg, __nv_bfloat16* __restrict__ du,
                           GluParams p, int64_t M) {
  const int64_t packs = p.F / 8;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const int grp = group_of_row(p.cu, p.G, row);
    const bool has_b1 = p.b1 != nullptr && grp < p.G, has_b3 = p.b3 != nullptr && grp < p.G;
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      const int64_t i = row * packs + c;
      Pack8 pg = reinterpret_cast<const Pack8*>(g)[i], pu = reinterpret_cast<const Pack8*>(u)[i];
      Pack8 pb1, pb3, pda, pa, pdg, pdu;
      if (has_b1) pb1 = *reinterpret_cast<const Pack8*>(p.b1 + grp * p.F + c * 8);
      if (has_b3) pb3 = *reinterpret_cast<const Pack8*>(p.b3 + grp * p.F + c * 8);
      if (kBwd) pda = reinterpret_cast<const Pack8*>(da)[i];
      glu_pack<kBwd>(p, pg, pu, pda, has_b1, pb1, has_b3, pb3, pa, pdg, pdu);
      reinterpret_cast<Pack8*>(a)[i] = pa;
      if (kBwd) {
        reinterpret_cast<Pack8*>(dg)[i] = pdg;
        reinterpret_cast<Pack8*>(du)[i] = pdu;
      }
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
  (void)num_sms;
  const int64_t M = n / F;
  const int blocks = row_blocks(M), threads = row_threads(F / 8);
  const auto s = static_cast<cudaStream_t>(stream);
  if (bwd) glu_kernel<true><<<blocks, threads, 0, s>>>(gp, up, dap, ap, dgp, dup, p, M);
  else glu_kernel<false><<<blocks, threads, 0, s>>>(gp, up, dap, ap, dgp, dup, p, M);
  return 0;
}

// The route-weight pass of moonep::moe_experts_ext with the down bias folded in (one read of y,
// one write of z):  z[m] = bf16((y[m] + b2[grp(m)]) * w[m])  (fp32 math; b2 may be null).
__global__ void bias_scale_rows_kernel(const __nv_bfloat16* __restrict__ y,
                                       const __nv_bfloat16* __restrict__ b2,
                                       const int* __restrict__ cu, int G, int64_t D,
                                       const float* __restrict__ w, __nv_bfloat16* __restrict__ z,
                                       int64_t M) {
  const int64_t packs = D / 8;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const int grp = group_of_row(cu, G, row);
    const bool has_b = b2 != nullptr && grp < G;
    const float wr = w[row];
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      const int64_t i = row * packs + c;
      const Pack8 py = reinterpret_cast<const Pack8*>(y)[i];
      Pack8 pb, pz;
      if (has_b) pb = *reinterpret_cast<const Pack8*>(b2 + grp * D + c * 8);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v = __bfloat162float(py.v[j]);
        if (has_b) v = v + __bfloat162float(pb.v[j]);
        pz.v[j] = __float2bfloat16_rn(v * wr);
      }
      reinterpret_cast<Pack8*>(z)[i] = pz;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Row tiles: the bias grads summed inside the backward passes that write dg, du and dy, so no
// pass re-reads them.  db1, db3, db2 [G, C] are each group's column sums of dg's, du's and dy's
// bf16 values, in fp32.
//
// The two backward kernels below walk [M, C] in tiles of up to kTileRows consecutive rows of
// one group by kTileCols columns.  A group's tiles start at its first row and the last one is
// cut short at its end, so no tile mixes two groups whatever their sizes (the Buffer's
// token_padding aligns nothing here).  Group g (rows [lo_g, hi_g), lo_g = cu[g-1]) owns the
// partial-sum rows ("slots") base(g) .. base(g) + ceil((hi_g - lo_g) / kTileRows) - 1 with
// base(g) = floor(lo_g / kTileRows) + g, which end before base(g + 1); the rows past cu[G-1]
// (the tail, g = G, to M) follow, processed like the others but summed into nothing.  So
// M / kTileRows + G + 1 slots cover every row, at most one unused after each group's tiles and
// one after the tail's (their blocks return at once).  The FP8 wgrad's token tiles are laid out
// the same way (docs/fp8.md).
//
// Summation order, fixed by the code alone (run to run and for any grid or SM count bitwise, no
// atomics): in a tile, row lane r (warp r) adds rows lo + r, lo + r + kRowLanes, ... in
// ascending order; the row lanes are added in lane order into the tile's slot row of `part`
// [slots, C]; group_sums_finish_kernel adds a group's slot rows in ascending order into
// [G, C] (an empty group: 0).  Work items: (slot, column tile), slot-major.
// ---------------------------------------------------------------------------------------------
constexpr int kTileRows = 128;
constexpr int kColPacks = 32;  // a warp's lanes along the row: one pack each, 512 bytes a row
constexpr int kTileCols = kColPacks * 8;
constexpr int kRowLanes = 8;   // warps of a block, each its own rows of the tile
constexpr int kTileThreads = kColPacks * kRowLanes;
constexpr int kBatch = 1;      // rows a thread loads before it uses the first: 48 (glu) / 32
                               // bytes in flight a thread.  2 (96 / 64 bytes, 128 registers:
                               // two blocks an SM) made the gpt-oss-120b EP 8 step 1.043-1.044x
                               // the plain layer's against 1.034 with 1 (H100, same run); 4
                               // costs registers (glu: 188, one block an SM)
constexpr int kSumStride = kColPacks * 9;  // a row lane's sums in shared memory: lane's 8 at
                                           // lane * 9 (the odd stride: conflict-free banks)
static_assert(kTileThreads == kTileCols, "the tile's sums: one column per thread");

int64_t tile_slots(int64_t M, int G) { return M / kTileRows + G + 1; }
int64_t col_tiles(int64_t C) { return (C + kTileCols - 1) / kTileCols; }

// A block per work item up to 32 per SM (the hardware's block scheduler balances the tiles;
// beyond that the blocks take the items grid-stride).
int tile_blocks(int64_t items, int num_sms) {
  const int64_t cap = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * 32;
  return static_cast<int>(items < 1 ? 1 : (items > cap ? cap : items));
}

__device__ __forceinline__ int64_t group_first_row(const int* cu, int g) {
  return g == 0 ? 0 : static_cast<int64_t>(cu[g - 1]);
}

__device__ __forceinline__ int64_t slot_base(const int* cu, int g) {
  return group_first_row(cu, g) / kTileRows + g;
}

struct RowTile {
  int64_t lo, hi;  // rows [lo, hi); empty for an unused slot
  int grp;         // their group, G for the tail
};

__device__ __forceinline__ RowTile row_tile(const int* cu, int G, int64_t M, int64_t slot) {
  int lo = 0, hi = G;  // the last g in [0, G] with base(g) <= slot (base(0) = 0)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (slot_base(cu, mid) <= slot) lo = mid; else hi = mid - 1;
  }
  const int64_t first = group_first_row(cu, lo) + (slot - slot_base(cu, lo)) * kTileRows;
  const int64_t end = lo < G ? static_cast<int64_t>(cu[lo]) : M;
  return {first, first + kTileRows < end ? first + kTileRows : end, lo};
}

// The tile's sums into its slot row of each part[q] [slots, C]: thread (lane, row lane r) holds
// acc[q][j], its rows' sum at column lane * 8 + j of the column tile starting at col0; the row
// lanes are added in lane order.  Called by every thread of the block.
template <int N>
__device__ __forceinline__ void store_tile_sums(const float (&acc)[N][8], float* sm,
                                                float* const (&part)[N], int64_t slot,
                                                int64_t col0, int64_t C) {
  const int lane = threadIdx.x % 32, r = threadIdx.x / 32;
#pragma unroll
  for (int q = 0; q < N; ++q) {
#pragma unroll
    for (int j = 0; j < 8; ++j) sm[(q * kRowLanes + r) * kSumStride + lane * 9 + j] = acc[q][j];
  }
  __syncthreads();
  const int c = threadIdx.x;
  if (col0 + c < C) {
#pragma unroll
    for (int q = 0; q < N; ++q) {
      float s = 0.f;
#pragma unroll
      for (int rl = 0; rl < kRowLanes; ++rl) {
        s += sm[(q * kRowLanes + rl) * kSumStride + (c / 8) * 9 + c % 8];
      }
      part[q][slot * C + col0 + c] = s;
    }
  }
  __syncthreads();  // sm is the next tile's
}

// The gated variant's backward with the bias grads' tile sums: a, dg, du as glu_kernel<true>
// writes them (glu_pack: bitwise), every row of [M, F] included; part1, part3 [slots, F]: the
// tile sums of dg's and du's bf16 values (the tail's tiles write none).
__global__ void __launch_bounds__(kTileThreads)
glu_kernel_row_tiles(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ u,
                     const __nv_bfloat16* __restrict__ da, __nv_bfloat16* __restrict__ a,
                     __nv_bfloat16* __restrict__ dg, __nv_bfloat16* __restrict__ du, GluParams p,
                     int64_t M, float* __restrict__ part1, float* __restrict__ part3) {
  __shared__ float sm[2 * kRowLanes * kSumStride];
  const int lane = threadIdx.x % 32, r = threadIdx.x / 32;
  const int64_t packs = p.F / 8, T = (packs + kColPacks - 1) / kColPacks;
  const int64_t items = (M / kTileRows + p.G + 1) * T;
  const auto* g8 = reinterpret_cast<const Pack8*>(g);
  const auto* u8 = reinterpret_cast<const Pack8*>(u);
  const auto* da8 = reinterpret_cast<const Pack8*>(da);
  float* const parts[2] = {part1, part3};
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t slot = w / T, ct = w % T;
    const RowTile t = row_tile(p.cu, p.G, M, slot);
    if (t.lo >= t.hi) continue;  // an unused slot (the whole block)
    const bool sums = t.grp < p.G;
    const int64_t pk = ct * kColPacks + lane;
    float acc[2][8] = {};
    if (pk < packs) {
      const bool has_b1 = p.b1 != nullptr && sums, has_b3 = p.b3 != nullptr && sums;
      Pack8 pb1, pb3;
      if (has_b1) pb1 = *reinterpret_cast<const Pack8*>(p.b1 + t.grp * p.F + pk * 8);
      if (has_b3) pb3 = *reinterpret_cast<const Pack8*>(p.b3 + t.grp * p.F + pk * 8);
      for (int64_t m0 = t.lo + r; m0 < t.hi; m0 += kRowLanes * kBatch) {
        Pack8 pg[kBatch], pu[kBatch], pda[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int64_t m = m0 + k * kRowLanes;
          if (m < t.hi) {
            pg[k] = g8[m * packs + pk];
            pu[k] = u8[m * packs + pk];
            pda[k] = da8[m * packs + pk];
          }
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int64_t m = m0 + k * kRowLanes;
          if (m < t.hi) {
            Pack8 pa, pdg, pdu;
            glu_pack<true>(p, pg[k], pu[k], pda[k], has_b1, pb1, has_b3, pb3, pa, pdg, pdu);
            reinterpret_cast<Pack8*>(a)[m * packs + pk] = pa;
            reinterpret_cast<Pack8*>(dg)[m * packs + pk] = pdg;
            reinterpret_cast<Pack8*>(du)[m * packs + pk] = pdu;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              acc[0][j] += __bfloat162float(pdg.v[j]);
              acc[1][j] += __bfloat162float(pdu.v[j]);
            }
          }
        }
      }
    }
    if (sums) store_tile_sums<2>(acc, sm, parts, slot, ct * kTileCols, p.F);
  }
}

// The route-weight pass's backward, in row tiles: dy[m] = bf16(dz[m] * w[m]); d_part [T, M]:
// row m's sum over column tile ct of dz * (y + b2[grp(m)]) in fp32 (each lane its 8 columns,
// then a shuffle tree over the warp), summed over the tiles by group_sums_finish_kernel; with
// part2 [slots, D] the tile sums of dy's bf16 values (null: none).
__global__ void __launch_bounds__(kTileThreads)
bias_scale_rows_bwd_kernel(const __nv_bfloat16* __restrict__ dz,
                           const __nv_bfloat16* __restrict__ y,
                           const __nv_bfloat16* __restrict__ b2, const int* __restrict__ cu,
                           int G, int64_t D, const float* __restrict__ w,
                           __nv_bfloat16* __restrict__ dy, float* __restrict__ d_part,
                           float* __restrict__ part2, int64_t M) {
  __shared__ float sm[kRowLanes * kSumStride];
  const int lane = threadIdx.x % 32, r = threadIdx.x / 32;
  const int64_t packs = D / 8, T = (packs + kColPacks - 1) / kColPacks;
  const int64_t items = (M / kTileRows + G + 1) * T;
  const auto* dz8 = reinterpret_cast<const Pack8*>(dz);
  const auto* y8 = reinterpret_cast<const Pack8*>(y);
  float* const parts[1] = {part2};
  for (int64_t wi = blockIdx.x; wi < items; wi += gridDim.x) {
    const int64_t slot = wi / T, ct = wi % T;
    const RowTile t = row_tile(cu, G, M, slot);
    if (t.lo >= t.hi) continue;  // an unused slot (the whole block)
    const bool sums = part2 != nullptr && t.grp < G;
    const bool has_b = b2 != nullptr && t.grp < G;
    const int64_t pk = ct * kColPacks + lane;
    const bool live = pk < packs;  // the lane has a pack (the warp's rows are the same anyway)
    Pack8 pb;
    if (has_b && live) pb = *reinterpret_cast<const Pack8*>(b2 + t.grp * D + pk * 8);
    float acc[1][8] = {};
    for (int64_t m0 = t.lo + r; m0 < t.hi; m0 += kRowLanes * kBatch) {
      Pack8 pdz[kBatch], py[kBatch];
      float wr[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t m = m0 + k * kRowLanes;
        if (m < t.hi) {
          wr[k] = w[m];
          if (live) {
            pdz[k] = dz8[m * packs + pk];
            py[k] = y8[m * packs + pk];
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t m = m0 + k * kRowLanes;
        if (m >= t.hi) continue;  // (the same for the whole warp)
        float dot = 0.f;
        if (live) {
          Pack8 pdy;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float d = __bfloat162float(pdz[k].v[j]);
            float v = __bfloat162float(py[k].v[j]);
            if (has_b) v = v + __bfloat162float(pb.v[j]);
            dot += d * v;
            pdy.v[j] = __float2bfloat16_rn(d * wr[k]);
            acc[0][j] += __bfloat162float(pdy.v[j]);
          }
          reinterpret_cast<Pack8*>(dy)[m * packs + pk] = pdy;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_down_sync(0xffffffffu, dot, off);
        if (lane == 0) d_part[ct * M + m] = dot;
      }
    }
    if (sums) store_tile_sums<1>(acc, sm, parts, slot, ct * kTileCols, D);
  }
}

// The sums over the tiles: out[q][g, c] = sum of group g's slot rows of part[q] (ascending);
// with d_rows, d_rows[m] = sum over the column tiles of d_part[ct, m] (ascending).
struct FinishParams {
  const float* part[2];  // [slots, C]
  float* out[2];         // [G, C] fp32
  int nsums;             // how many of part / out are used
  const int* cu;
  int G;
  int64_t C;
  const float* d_part;  // [T, M], or null (then d_rows too)
  float* d_rows;        // [M]
  int64_t T, M;
};

__global__ void group_sums_finish_kernel(FinishParams f) {
  const int64_t GC = f.G * f.C, n_sums = f.nsums * GC;
  const int64_t n = n_sums + (f.d_rows != nullptr ? f.M : 0);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    float s = 0.f;
    if (i < n_sums) {
      const int q = static_cast<int>(i / GC);
      const int g = static_cast<int>((i % GC) / f.C);
      const int64_t c = i % f.C;
      const int64_t lo = g == 0 ? 0 : f.cu[g - 1], hi = f.cu[g];
      const int64_t tiles = hi > lo ? (hi - lo + kTileRows - 1) / kTileRows : 0;
      const float* part = (q == 0 ? f.part[0] : f.part[1]) + (lo / kTileRows + g) * f.C + c;
#pragma unroll 4
      for (int64_t k = 0; k < tiles; ++k) s += part[k * f.C];
      (q == 0 ? f.out[0] : f.out[1])[i % GC] = s;
    } else {
      const int64_t m = i - n_sums;
      for (int64_t ct = 0; ct < f.T; ++ct) s += f.d_part[ct * f.M + m];
      f.d_rows[m] = s;
    }
  }
}

void finish_launch(const FinishParams& f, int num_sms, cudaStream_t s) {
  const int64_t n = f.nsums * f.G * f.C + (f.d_rows != nullptr ? f.M : 0);
  group_sums_finish_kernel<<<tile_blocks((n + 255) / 256, num_sms), 256, 0, s>>>(f);
}

}  // namespace

using moonep_ep::fail;

// Pointers must be 16-byte aligned (whole-tensor bases from the caching allocator are).
MOONEP_EXPORT int moonep_ep_swiglu_fwd(const void* g, const void* u, void* a, int64_t n,
                                       int num_sms, void* stream) {
  (void)num_sms;  // a thread per pack whatever the SM count (the ABI keeps it)
  if (n <= 0) return 0;
  const Ptrs<2> in{{static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u)}};
  const OutPtrs<1> out{{static_cast<__nv_bfloat16*>(a)}};
  swiglu_kernel<FwdOp><<<pack_blocks(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      in, out, n);
  return fail(cudaGetLastError(), "moonep_ep_swiglu_fwd");
}

MOONEP_EXPORT int moonep_ep_swiglu_bwd(const void* g, const void* u, const void* da, void* dg,
                                       void* du, void* a, int64_t n, int num_sms, void* stream) {
  (void)num_sms;  // a thread per pack whatever the SM count (the ABI keeps it)
  if (n <= 0) return 0;
  const Ptrs<3> in{{static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u),
                    static_cast<const __nv_bfloat16*>(da)}};
  const OutPtrs<3> out{{static_cast<__nv_bfloat16*>(dg), static_cast<__nv_bfloat16*>(du),
                        static_cast<__nv_bfloat16*>(a)}};
  swiglu_kernel<BwdOp><<<pack_blocks(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
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

MOONEP_EXPORT int64_t moonep_ep_row_tile_work(int64_t M, int G, int64_t C, int num_sums,
                                              int row_dots) {
  if (M < 0 || G < 1 || C <= 0 || num_sums < 0) return -1;
  return num_sums * tile_slots(M, G) * C + (row_dots ? col_tiles(C) * M : 0);
}

MOONEP_EXPORT int moonep_ep_glu_bwd_bias_grads(const void* g, const void* u, const void* da,
                                               const void* b1, const void* b3, const void* cu,
                                               int G, int64_t F, void* dg, void* du, void* a,
                                               void* db1, void* db3, void* work, int64_t M,
                                               float alpha, float limit, float offset,
                                               int num_sms, void* stream) {
  if (M < 0 || F <= 0 || F % 8 || G < 1) {
    return fail(cudaErrorInvalidValue, "moonep_ep_glu_bwd_bias_grads");
  }
  const GluParams p{static_cast<const __nv_bfloat16*>(b1), static_cast<const __nv_bfloat16*>(b3),
                    static_cast<const int*>(cu), G, F, alpha, limit, offset};
  auto* part1 = static_cast<float*>(work);
  auto* part3 = part1 + tile_slots(M, G) * F;
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t items = tile_slots(M, G) * col_tiles(F);
  glu_kernel_row_tiles<<<tile_blocks(items, num_sms), kTileThreads, 0, s>>>(
      static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u),
      static_cast<const __nv_bfloat16*>(da), static_cast<__nv_bfloat16*>(a),
      static_cast<__nv_bfloat16*>(dg), static_cast<__nv_bfloat16*>(du), p, M, part1, part3);
  const FinishParams f{{part1, part3}, {static_cast<float*>(db1), static_cast<float*>(db3)}, 2,
                       p.cu, G, F, nullptr, nullptr, 0, M};
  finish_launch(f, num_sms, s);
  return fail(cudaGetLastError(), "moonep_ep_glu_bwd_bias_grads");
}

MOONEP_EXPORT int moonep_ep_bias_scale_rows(const void* y, const void* b2, const void* cu, int G,
                                            int64_t D, const void* w, void* z, int64_t M,
                                            int num_sms, void* stream) {
  (void)num_sms;  // a thread per pack (the ABI keeps it)
  if (M <= 0) return 0;
  if (D <= 0 || D % 8 || G < 1) return fail(cudaErrorInvalidValue, "moonep_ep_bias_scale_rows");
  bias_scale_rows_kernel<<<row_blocks(M), row_threads(D / 8), 0,
                           static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(y), static_cast<const __nv_bfloat16*>(b2),
      static_cast<const int*>(cu), G, D, static_cast<const float*>(w),
      static_cast<__nv_bfloat16*>(z), M);
  return fail(cudaGetLastError(), "moonep_ep_bias_scale_rows");
}

MOONEP_EXPORT int moonep_ep_bias_scale_rows_bwd(const void* dz, const void* y, const void* b2,
                                                const void* cu, int G, int64_t D, const void* w,
                                                void* dy, void* d_rows, void* db2, void* work,
                                                int64_t M, int num_sms, void* stream) {
  if (M < 0 || D <= 0 || D % 8 || G < 1) {
    return fail(cudaErrorInvalidValue, "moonep_ep_bias_scale_rows_bwd");
  }
  auto* part2 = db2 != nullptr ? static_cast<float*>(work) : nullptr;
  auto* d_part = static_cast<float*>(work) + (db2 != nullptr ? tile_slots(M, G) * D : 0);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t items = tile_slots(M, G) * col_tiles(D);
  bias_scale_rows_bwd_kernel<<<tile_blocks(items, num_sms), kTileThreads, 0, s>>>(
      static_cast<const __nv_bfloat16*>(dz), static_cast<const __nv_bfloat16*>(y),
      static_cast<const __nv_bfloat16*>(b2), static_cast<const int*>(cu), G, D,
      static_cast<const float*>(w), static_cast<__nv_bfloat16*>(dy), d_part, part2, M);
  const FinishParams f{{part2, nullptr}, {static_cast<float*>(db2), nullptr},
                       db2 != nullptr ? 1 : 0, static_cast<const int*>(cu), G, D, d_part,
                       static_cast<float*>(d_rows), col_tiles(D), M};
  finish_launch(f, num_sms, s);
  return fail(cudaGetLastError(), "moonep_ep_bias_scale_rows_bwd");
}
