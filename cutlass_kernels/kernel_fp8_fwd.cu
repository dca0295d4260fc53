// The FP8 grouped GEMM with blockwise scaling (the DeepSeek-V3 recipe), sm90a:
//   D[rows of g] (bf16) = (A * SA)[rows of g] . (B_g * SB_g)^T, fp32 accumulation,
// over the G = 2*epn groups of a receive buffer, in one CUTLASS ptr-array launch.  The exports
// (moonep_grouped_gemm_fp8, moonep_gemm_fp8_workspace_bytes, moonep_gemm_fp8_num_configs,
// moonep_gemm_fp8_config_info) are documented in moonep_gemm.h; what it shares with the FP8 wgrad
// GEMM (types, config kernel, workspace, launch) is fp8_common.cuh.
//
// As the bf16 path (prep.cu + gemm_kernel.cuh), a small prep kernel reads cu_seqlens on the
// device and writes the per-group problem shapes and pointers into the caller's workspace, so no
// group size reaches the host (no sync; capturable in a CUDA graph), then one persistent grouped
// CUTLASS kernel reads them.  The configs (`Configs` below) are branches of ONE fused kernel
// (gemm_kernel.cuh's fused_grouped_gemm, as a bf16 family): warp 0 of the prep kernel's block 0
// chooses one from the group sizes with the FP8 cost model (below; its constants come from the
// host's tuning table, moonep_ops/gemm/tuning_fp8.py) or takes the caller's forced index, and
// writes it to the workspace; the fused kernel reads it after griddepcontrol.wait.  Every
// config: cluster 1 x 2 (the two CTAs of a cluster share, by TMA multicast, the A tile of one
// group's rows and take neighbouring 128-column slices of the weight), raster along N, and
// CUTLASS's warp-specialised FP8 blockwise mainloop: the tensor cores accumulate one 128-deep K
// block in fp32 registers, which are then multiplied by SA[row, kb] * SB[nb, kb] and added into
// a separate fp32 accumulator (promotion every K block; FP8 "fast accumulation" is off by
// construction).
//   c128x128  cooperative 128 x 128 x 128, 64-column epilogue subtiles (the cooperative
//             epilogue does not overlap the MMAs; half as many subtile rounds as CUTLASS's 32);
//   p64x128   ping-pong 64 x 128 x 128: each consumer warpgroup on its own tile, so one
//             warpgroup's promotion and epilogue overlap the other's MMAs; twice the weight-tile
//             loads, so it wins only on small groups.
// Tile N must be a multiple of the 128-column scale block, and a consumer warpgroup holds two
// fp32 accumulators (the block's and the promoted one): 64 x 256 per warpgroup would need 256
// registers a thread, so 128-column tiles are the widest that fit.
//
// Scale layouts: ours are used AS THEY ARE, nothing is transposed.  CUTLASS's Sm90 blockwise
// mainloop derives each group's scale layout from the group's problem shape and the config's
// majorness (load_init: ScaleConfig::tile_atom_to_shape_SF*, packed; the layout_SF* arguments
// only carry the type), so we pick the majorness that matches our tensors:
//   SFA K-major, granularity 1 x 128: element (m, kb) at m * ceil(k/128) + kb, which is our
//       a_scale [M, ceil(k/128)] row-major; group g's pointer is a_scale + start_g * ceil(k/128).
//   SFB K-major, granularity 128 x 128: element (nb, kb) at nb * ceil(k/128) + kb, our weight
//       scale [epn, ceil(n/128), ceil(k/128)] row-major; pointer scale + e * P * C.
// (The CUTLASS examples use an M-major SFA, which a DeepGEMM-style producer writes transposed;
// that would cost the prep kernel a transpose of a_scale per call.  The mainloop loads scales
// with 4-byte cp.async either way; K-major only spreads one K tile's 128 row scales over 128
// rows of a_scale, which stay in L1/L2 for the following K tiles.)
// k need not be a multiple of 128: the last K tile is partial, TMA fills A and B past k with
// zeros, and its scales are those of the last (partial) scale tile, which covers it.
#include "fp8_common.cuh"

namespace moonep {
namespace fp8 {

using namespace fp8_common;

// Granularity (M, N, K) = (1, 128, 128): 1 x 128 activation tiles, 128 x 128 weight blocks; both
// K-major (see the top of the file).
using Sc = Scales<kTileK, cute::GMMA::Major::K>;

// One config of this GEMM (fp8_common.cuh's Config with these scales): tile BM x BN x 128,
// cluster CM x CN, cooperative or ping-pong, epilogue subtile width EN, raster order RasterN.
template <int BM, int BN, bool Pingpong, int CM, int CN, int EN = 0, int RasterN = 0>
using Fp8Config = Config<Sc, BM, BN, Pingpong, CM, CN, EN, RasterN>;

// The config table, in the order of the config index (moonep_ops/gemm/fp8_cost.py FP8_CONFIGS
// mirrors it; tests compare the two through moonep_gemm_fp8_config_info).  The configs that
// share a cluster shape and follow one another are a family: one fused kernel.  The device's
// choice (config -1) is among the first family's configs (kAutoConfigs).  Operands: A = x rows
// [M, k], B = W_g [n, k] (nn.Linear [O, I]), D = y [M, n].
using Configs = std::tuple<Fp8Config<128, 128, false, 1, 2, 64, 1>,   // c128x128
                           Fp8Config<64, 128, true, 1, 2, 0, 1>>;      // p64x128
using T = Table<Configs>;
constexpr int kNumConfigs = T::kNumConfigs;
// One family: every config is a candidate of the device's choice.
constexpr int kAutoConfigs = kNumConfigs;
using StrideA = T::StrideA;
using StrideB = T::StrideB;
using StrideD = T::StrideD;

// ---- the FP8 cost model (warp 0 of the prep kernel's block 0) -------------------------------
//
// Predicted time of config c on the call's group sizes, from the host's tuning table
// (moonep_ops/gemm/tuning_fp8.py CONSTANTS, fitted by benchmarks/fit_fp8_cost_model.py on
// committed measurements; laid out as moonep_gemm.h MOONEP_GEMM_FP8_TUNING_LEN says; the host
// mirror is moonep_ops/gemm/fp8_cost.py):
//   tiles_c = sum over non-empty groups of (ceil(M_g / BM_c) rounded up to CM) * (ceil(N / BN_c)
//             rounded up to CN), the output tiles the persistent scheduler walks;
//   rounds_c = ceil(tiles_c / (sm_count * tiles in flight per CTA: 1 cooperative, 2 ping-pong));
//   t_c = fixed_c + max(rounds_c * (per_round_c + per_kblock_c * ceil(K / 128)), bytes / mem_bw)
// with the compulsory bytes (every non-empty group's weight, A, D).  The cheapest wins; a
// prediction within tie_tol of the cheapest ties and goes to the lower index.

// ---- prep kernel --------------------------------------------------------------------------

struct PrepParams : T::Problems {  // the problem arrays to write, then the call's operands
  const int* cu;
  int G, epn, M, N, K, C, P;  // C = ceil(K / 128), P = ceil(N / 128)
  int config;                 // >= 0: forced; -1: the cost model chooses
  int sm_count;
  Tuning tune;
  const ElementA* A;
  const ElementScale* SA;
  const ElementB *BL, *BS;
  const ElementScale *SBL, *SBS;
  ElementD* D;
};

// Zeroing blocks: up to 128 x 256 threads, as many as the bf16 prep kernel's 32 x 1024 (whose
// measurements found more blocks cost ~0.5-1 us with nothing to zero); the padding is on the
// GEMM's critical path (it launches after the prep grid), ~128 * G rows.
constexpr int kMaxTailBlocks = 128;

// Block 0: warp 0 the config choice, the other warps the problem arrays of every group (a thread
// per group, strided).
// Blocks >= 1: zero the rows of D at or past cu_seqlens[G-1] (padding; no group writes them).
// The rows of group g are [cu[g-1], cu[g]) clamped to [0, M] (cu[-1] := 0), so bad offsets never
// read or write out of bounds, and an empty group gets a 0-row problem (no tiles: the scheduler
// skips it).
__global__ void __launch_bounds__(kPrepThreads) prep_fp8(const __grid_constant__ PrepParams p) {
  // The GEMM is launched as a programmatic dependent of this grid (MOONEP_GEMM_PDL): let its
  // CTAs start now; it waits for this grid's completion (griddepcontrol.wait) before it reads
  // the chosen word or the problem arrays.  A no-op without that launch attribute.
  asm volatile("griddepcontrol.launch_dependents;");
  if (blockIdx.x == 0) {
    // Warp 0 chooses while the other warps write the problem arrays: no barrier, and the
    // choice is off the arrays' critical path (a block-wide reduction with two __syncthreads
    // measured 1.9 % gm over the same config forced, 3.6 % on 18-60 us calls).
    if (threadIdx.x < 32) {
      if (p.config >= 0) {  // forced: nothing to choose
        if (threadIdx.x == 0) *p.chosen = p.config;
        return;
      }
      int tiles[kAutoConfigs] = {};
      int nonempty = 0, rows_all = 0;
      for (int g = threadIdx.x; g < p.G; g += 32) {
        const int start = g == 0 ? 0 : clampi(__ldg(p.cu + g - 1), 0, p.M);
        const int rows = clampi(__ldg(p.cu + g), start, p.M) - start;
#pragma unroll
        for (int c = 0; c < kAutoConfigs; ++c) {
          const ConfigGeom gc = T::geom_of(c);
          const int mt = (rows + gc.BM - 1) / gc.BM, nt = (p.N + gc.BN - 1) / gc.BN;
          tiles[c] += (mt + gc.CM - 1) / gc.CM * gc.CM * ((nt + gc.CN - 1) / gc.CN * gc.CN);
        }
        nonempty += rows > 0;
        rows_all += rows;
      }
#pragma unroll
      for (int c = 0; c < kAutoConfigs; ++c) tiles[c] = warp_sum(tiles[c]);
      nonempty = warp_sum(nonempty);
      // the groups' rows summed, not one more load of cu[G-1]: each dependent global load is an
      // L2 round trip on this warp's path to the choice
      const int rows = warp_sum(rows_all);
      if (threadIdx.x == 0) {
        // compulsory bytes: the weights of the non-empty groups, A's rows and D's rows (e4m3 A
        // and B, bf16 D; scales are < 4 % of them and left out)
        const float bytes = (float)nonempty * p.N * p.K + (float)rows * p.K + 2.f * rows * p.N;
        const float t_mem = bytes / p.tune.mem_bytes_per_us;
        const int kblocks = p.C;
        float t[kAutoConfigs];
        float best = 3.4e38f;
#pragma unroll
        for (int c = 0; c < kAutoConfigs; ++c) {
          const int slots = p.sm_count * (T::geom_of(c).pingpong ? 2 : 1);
          const int rounds = (tiles[c] + slots - 1) / slots;
          const float t_comp =
              rounds * (p.tune.per_round[c] + p.tune.per_kblock[c] * (float)kblocks);
          t[c] = p.tune.fixed[c] + fmaxf(t_comp, t_mem);
          best = fminf(best, t[c]);
        }
        int pick = 0;
#pragma unroll
        for (int c = kAutoConfigs - 1; c >= 0; --c)
          if (t[c] <= best * (1.f + p.tune.tie_tol)) pick = c;  // the lowest index in the window
        *p.chosen = pick;
      }
      return;
    }
    for (int g = threadIdx.x - 32; g < p.G; g += blockDim.x - 32) {
      const int start = g == 0 ? 0 : clampi(__ldg(p.cu + g - 1), 0, p.M);
      const int end = clampi(__ldg(p.cu + g), start, p.M);
      const int rows = end - start;
      const bool home = g < p.epn;
      const long long e = home ? g : g - p.epn;
      p.shapes[g] = UShape(rows, p.N, p.K);
      p.ptr_a[g] = p.A + (long long)start * p.K;
      p.ptr_b[g] = (home ? p.BL : p.BS) + e * p.N * p.K;
      p.ptr_d[g] = p.D + (long long)start * p.N;
      p.ptr_sfa[g] = p.SA + (long long)start * p.C;                 // K-major [M, C]
      p.ptr_sfb[g] = (home ? p.SBL : p.SBS) + e * p.P * p.C;        // K-major [P, C]
      p.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(rows, p.K, 1));
      p.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(p.N, p.K, 1));
      p.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(rows, p.N, 1));
      // Not read by this mainloop (it rebuilds the same layouts from the shapes), written so
      // that the arrays CUTLASS is handed hold what they claim to.
      p.lay_sfa[g] = Sc::Config::tile_atom_to_shape_SFA(make_shape(rows, p.N, p.K, 1));
      p.lay_sfb[g] = Sc::Config::tile_atom_to_shape_SFB(make_shape(rows, p.N, p.K, 1));
    }
    return;
  }
  // n % 16 == 0, so a row is a whole number of 16-byte (8 x bf16) units
  const long long first = (long long)clampi(__ldg(p.cu + p.G - 1), 0, p.M) * p.N / 8;
  const long long last = (long long)p.M * p.N / 8;
  const long long nthr = (long long)(gridDim.x - 1) * blockDim.x;
  uint4* out = reinterpret_cast<uint4*>(p.D);
  for (long long i = first + (long long)(blockIdx.x - 1) * blockDim.x + threadIdx.x; i < last;
       i += nthr)
    out[i] = make_uint4(0, 0, 0, 0);
}

using Family0 = T::Family<0, 0, 1>;
static_assert(kAutoConfigs == 2, "Family0 lists every config");

}  // namespace fp8
}  // namespace moonep

using namespace moonep;

extern "C" {

int moonep_gemm_fp8_num_configs(void) { return fp8::kNumConfigs; }

int moonep_gemm_fp8_config_info(int config, int* out8) {
  return fp8::T::config_info(config, out8);
}

size_t moonep_gemm_fp8_workspace_bytes(int G, int sm_count) {
  return fp8::T::workspace_bytes(G, sm_count);
}

int moonep_grouped_gemm_fp8(const void* a, const float* a_scale, const void* b_local,
                            const float* b_local_scale, const void* b_slot,
                            const float* b_slot_scale, void* d, const int* cu_seqlens, int G,
                            int epn, int M, int n, int k, int config, const float* tuning,
                            int flags, void* workspace, size_t workspace_bytes, int sm_count,
                            void* stream) {
  gemm_clear_error();
  if (epn < 1 || G != 2 * epn || G > fp8::kMaxGroups)
    return gemm_fail("moonep_grouped_gemm_fp8: G must be 2*epn, epn >= 1, G <= 1024");
  if (M < 0) return gemm_fail("moonep_grouped_gemm_fp8: M must be >= 0");
  if (n <= 0 || k <= 0 || n % 16 || k % 16)
    return gemm_fail("moonep_grouped_gemm_fp8: n and k must be positive multiples of 16 (16-byte "
                     "TMA rows of e4m3)");
  if (config < -1 || config >= fp8::kNumConfigs)
    return gemm_fail("moonep_grouped_gemm_fp8: config must be -1 (chosen on the device) or in "
                     "[0, moonep_gemm_fp8_num_configs())");
  if (config == -1 && !tuning)
    return gemm_fail("moonep_grouped_gemm_fp8: config -1 needs the tuning table");
  if (flags & ~(MOONEP_GEMM_PDL | MOONEP_GEMM_KEEP_TAIL))
    return gemm_fail("moonep_grouped_gemm_fp8: flags other than MOONEP_GEMM_PDL and "
                     "MOONEP_GEMM_KEEP_TAIL");
  if (sm_count <= 0 || sm_count > fp8::kMaxSms)
    return gemm_fail("moonep_grouped_gemm_fp8: sm_count must be in [1, 1024]");
  const fp8::T::Layout L = fp8::T::layout(G, sm_count);
  if (!workspace || workspace_bytes < L.total)
    return gemm_fail("moonep_grouped_gemm_fp8: workspace missing or smaller than "
                     "moonep_gemm_fp8_workspace_bytes(G, sm_count)");
  if (M == 0) return 0;
  if (!a || !a_scale || !b_local || !b_local_scale || !b_slot || !b_slot_scale || !d || !cu_seqlens)
    return gemm_fail("moonep_grouped_gemm_fp8: a NULL operand pointer");
  if (!fp8::aligned16(a) || !fp8::aligned16(b_local) || !fp8::aligned16(b_slot) ||
      !fp8::aligned16(d))
    return gemm_fail("moonep_grouped_gemm_fp8: a, b_local, b_slot and d must be 16-byte aligned "
                     "(TMA)");
  // CUTLASS keeps per-SM TMA descriptors (64-byte aligned objects) in its part of the workspace,
  // which starts at a multiple of kAlign from the base
  if ((reinterpret_cast<uintptr_t>(workspace) & (fp8::kAlign - 1)) != 0)
    return gemm_fail("moonep_grouped_gemm_fp8: the workspace must be 256-byte aligned");
  if (!fp8::aligned4(a_scale) || !fp8::aligned4(b_local_scale) || !fp8::aligned4(b_slot_scale) ||
      !fp8::aligned4(cu_seqlens))
    return gemm_fail("moonep_grouped_gemm_fp8: scales and cu_seqlens must be 4-byte aligned");

  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  fp8::PrepParams p{};
  p.cu = cu_seqlens;
  p.G = G;
  p.epn = epn;
  p.M = M;
  p.N = n;
  p.K = k;
  p.C = (k + fp8::kTileK - 1) / fp8::kTileK;
  p.P = (n + fp8::kTileK - 1) / fp8::kTileK;
  p.config = config;
  p.sm_count = sm_count;
  if (tuning) p.tune = fp8::read_tuning(tuning);
  p.A = static_cast<const fp8::ElementA*>(a);
  p.SA = a_scale;
  p.BL = static_cast<const fp8::ElementB*>(b_local);
  p.BS = static_cast<const fp8::ElementB*>(b_slot);
  p.SBL = b_local_scale;
  p.SBS = b_slot_scale;
  p.D = static_cast<fp8::ElementD*>(d);
  static_cast<fp8::T::Problems&>(p) = fp8::T::problems(ws, L);

  // 1 block for the arrays and the choice + zeroing blocks sized to M * n (the padding is only
  // known on the device; at most kMaxTailBlocks, grid-strided); none with MOONEP_GEMM_KEEP_TAIL
  const long long vec = (long long)M * n / 8;
  long long tail = (vec + fp8::kPrepThreads - 1) / fp8::kPrepThreads;
  if (tail > fp8::kMaxTailBlocks) tail = fp8::kMaxTailBlocks;
  if (tail > sm_count - 1) tail = sm_count - 1;
  if (tail < 1) tail = 1;
  if (flags & MOONEP_GEMM_KEEP_TAIL) tail = 0;
  const bool pdl = (flags & MOONEP_GEMM_PDL) != 0;
  return fp8::T::run<fp8::Family0>("moonep_grouped_gemm_fp8", p.chosen, G, sm_count, ws, L, s,
                                   pdl, [&] {
    fp8::prep_fp8<<<1 + (int)tail, fp8::kPrepThreads, 0, s>>>(p);
  });
}

}  // extern "C"
