// The FP8 grouped GEMM with blockwise scaling (the DeepSeek-V3 recipe), sm90a:
//   D[rows of g] (bf16) = (A * SA)[rows of g] . (B_g * SB_g)^T, fp32 accumulation,
// over the G = 2*epn groups of a receive buffer, in one CUTLASS ptr-array launch.  The exports
// (moonep_grouped_gemm_fp8, moonep_gemm_fp8_workspace_bytes, moonep_gemm_fp8_num_configs,
// moonep_gemm_fp8_config_info) are documented in moonep_gemm.h.
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
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "gemm_kernel.cuh"  // fused_grouped_gemm, FusedParams, ConfigGeom
#include "moonep_gemm.h"

namespace moonep {

// prep.cu: the thread-local message of moonep_gemm_last_error()
void gemm_clear_error();
int gemm_fail(const char* msg);

namespace fp8 {

using namespace cute;

constexpr int kScaleTile = 128;  // 1 x 128 activation tiles, 128 x 128 weight blocks
constexpr int kMaxGroups = 1024;
constexpr int kMaxSms = 1024;

using ElementA = cutlass::float_e4m3_t;   // x rows [M, k], k contiguous
using LayoutA = cutlass::layout::RowMajor;
using ElementB = cutlass::float_e4m3_t;   // W_g [n, k] (nn.Linear [O, I]), k contiguous: CUTLASS's
using LayoutB = cutlass::layout::ColumnMajor;  // N x K column-major B (D = A . W_g^T)
using ElementD = cutlass::bfloat16_t;     // y [M, n], row-major
using LayoutD = cutlass::layout::RowMajor;
using ElementC = void;                    // no source: beta = 0
using ElementAcc = float;
using ElementScale = float;

constexpr int kAlignA = 128 / cutlass::sizeof_bits<ElementA>::value;  // 16 e4m3: k % 16
constexpr int kAlignB = 128 / cutlass::sizeof_bits<ElementB>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;  // 8 bf16

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

// Granularity (M, N, K) = (1, 128, 128); both K-major (see the top of the file).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleTile, kScaleTile,
                                                              cute::GMMA::Major::K,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>;

// One config: tile BM x BN x 128, cluster CM x CN, cooperative or ping-pong, epilogue subtile
// width EN (0: CUTLASS's), the persistent scheduler's raster order (0 along M: co-resident CTAs
// share a weight slice; 1 along N).
template <int BM, int BN, bool Pingpong, int CM, int CN, int EN = 0, int RasterN = 0>
struct Fp8Config {
  using TileShape = Shape<Int<BM>, Int<BN>, Int<kScaleTile>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using KernelSchedule = std::conditional_t<
      Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>;
  using EpilogueSchedule =
      std::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using EpiTile = cute::conditional_t<EN == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                                      Shape<Int<Pingpong ? 64 : 128>, Int<(EN > 0 ? EN : 32)>>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpiTile,
      ElementAcc, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
      EpilogueSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int cm = CM, cn = CN, raster_n = RasterN;
  __host__ __device__ static constexpr ConfigGeom geom() {
    return {BM, BN, kScaleTile, CM, CN, Pingpong ? 1 : 0, EN, 0};
  }

  // The layout must be what the mainloop rebuilds from the problem shape (it ignores ours), and
  // the majorness must be ours: checked at compile time.
  static_assert(!CollectiveMainloop::MMajorSFA && !CollectiveMainloop::NMajorSFB,
                "the mainloop must read K-major scales (our a_scale / weight-scale layouts)");
  static_assert(CollectiveMainloop::ScaleGranularityM == 1 &&
                    CollectiveMainloop::ScaleGranularityN == kScaleTile &&
                    CollectiveMainloop::ScaleGranularityK == kScaleTile,
                "scale granularity (1, 128, 128)");
};

// The config table, in the order of the config index (moonep_ops/gemm/fp8_cost.py FP8_CONFIGS
// mirrors it; tests compare the two through moonep_gemm_fp8_config_info).  The configs that
// share a cluster shape and follow one another are a family: one fused kernel.  The device's
// choice (config -1) is among the first family's configs (kAutoConfigs).
using Configs = std::tuple<Fp8Config<128, 128, false, 1, 2, 64, 1>,   // c128x128
                           Fp8Config<64, 128, true, 1, 2, 0, 1>>;      // p64x128
constexpr int kNumConfigs = int(std::tuple_size_v<Configs>);
template <int I>
using Cfg = std::tuple_element_t<I, Configs>;
// One family: every config is a candidate of the device's choice.
constexpr int kAutoConfigs = kNumConfigs;
static_assert(kNumConfigs <= MOONEP_GEMM_FP8_MAX_CONFIGS, "config count");

template <size_t... I>
__host__ __device__ constexpr ConfigGeom geom_at(int c, std::index_sequence<I...>) {
  ConfigGeom g{};
  (void)((c == int(I) ? (g = Cfg<I>::geom(), true) : false) || ...);
  return g;
}
// A function, not only an array: the prep kernel's model reads the geometry on the device.
__host__ __device__ constexpr ConfigGeom geom_of(int c) {
  return geom_at(c, std::make_index_sequence<kNumConfigs>{});
}

// The configs share the operand, stride and scale-layout types, so one set of problem arrays
// (written by the prep kernel) serves whichever config runs.
using StrideA = typename Cfg<0>::Kernel::InternalStrideA;
using StrideB = typename Cfg<0>::Kernel::InternalStrideB;
using StrideD = typename Cfg<0>::Kernel::InternalStrideD;
template <size_t... I>
constexpr bool same_strides(std::index_sequence<I...>) {
  return ((std::is_same_v<StrideA, typename Cfg<I>::Kernel::InternalStrideA> &&
           std::is_same_v<StrideB, typename Cfg<I>::Kernel::InternalStrideB> &&
           std::is_same_v<StrideD, typename Cfg<I>::Kernel::InternalStrideD>) && ...);
}
static_assert(same_strides(std::make_index_sequence<kNumConfigs>{}),
              "configs must share the stride types");
using UShape = typename ProblemShape::UnderlyingProblemShape;

// ---- workspace ----------------------------------------------------------------------------

constexpr size_t kAlign = 256;
inline size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Layout {  // byte offsets inside the call's workspace
  size_t chosen, shapes, ptr_a, ptr_b, ptr_d, ptr_sfa, ptr_sfb, stride_a, stride_b, stride_d,
      lay_sfa, lay_sfb, cutlass[kNumConfigs], total;
};

// Config Cfg's CUTLASS arguments for a call; only the pointer arrays' addresses and G / sm_count
// matter for the workspace size and the launch (everything per group is read on the device).
template <class C>
typename C::Gemm::Arguments arguments(int G, int sm_count, char* base, const Layout& L) {
  using Args = typename C::Gemm::Arguments;
  // base may be NULL (workspace sizing): integer arithmetic, no pointer into nothing
  const uintptr_t ws0 = reinterpret_cast<uintptr_t>(base);
  struct At {
    uintptr_t b;
    char* operator+(size_t off) const { return reinterpret_cast<char*>(b + off); }
  } ws{ws0};
  Args args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {G, reinterpret_cast<UShape*>(ws + L.shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<ElementA const**>(ws + L.ptr_a);
  args.mainloop.dA = reinterpret_cast<StrideA*>(ws + L.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<ElementB const**>(ws + L.ptr_b);
  args.mainloop.dB = reinterpret_cast<StrideB*>(ws + L.stride_b);
  args.mainloop.ptr_SFA = reinterpret_cast<ElementScale const**>(ws + L.ptr_sfa);
  args.mainloop.layout_SFA = reinterpret_cast<LayoutSFA*>(ws + L.lay_sfa);
  args.mainloop.ptr_SFB = reinterpret_cast<ElementScale const**>(ws + L.ptr_sfb);
  args.mainloop.layout_SFB = reinterpret_cast<LayoutSFB*>(ws + L.lay_sfb);
  typename C::CollectiveEpilogue::Arguments epi{};
  epi.thread.alpha = 1.f;
  epi.thread.beta = 0.f;
  epi.ptr_C = nullptr;
  epi.dC = nullptr;
  epi.ptr_D = reinterpret_cast<ElementD**>(ws + L.ptr_d);
  epi.dD = reinterpret_cast<StrideD*>(ws + L.stride_d);
  args.epilogue = epi;
  int device = 0;
  cudaGetDevice(&device);
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  static int max_active_clusters = -1;  // occupancy query once per process and config
  if (max_active_clusters < 0)
    max_active_clusters =
        cutlass::KernelHardwareInfo::query_device_max_active_clusters<typename C::Kernel>();
  args.hw_info.max_active_clusters = max_active_clusters;
  using Raster = typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90GroupParams<
      UShape>::RasterOrderOptions;
  args.scheduler.raster_order = C::raster_n ? Raster::AlongN : Raster::AlongM;
  return args;
}

template <class Take, size_t... I>
void take_cutlass(Layout& L, Take& take, int G, int sm_count, std::index_sequence<I...>) {
  ((L.cutlass[I] = take(Cfg<I>::Gemm::get_workspace_size(
        arguments<Cfg<I>>(G, sm_count, nullptr, L)))), ...);
}

Layout layout(int G, int sm_count) {
  Layout L{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
  L.chosen = take(sizeof(int));
  L.shapes = take((size_t)G * sizeof(UShape));
  L.ptr_a = take((size_t)G * sizeof(void*));
  L.ptr_b = take((size_t)G * sizeof(void*));
  L.ptr_d = take((size_t)G * sizeof(void*));
  L.ptr_sfa = take((size_t)G * sizeof(void*));
  L.ptr_sfb = take((size_t)G * sizeof(void*));
  L.stride_a = take((size_t)G * sizeof(StrideA));
  L.stride_b = take((size_t)G * sizeof(StrideB));
  L.stride_d = take((size_t)G * sizeof(StrideD));
  L.lay_sfa = take((size_t)G * sizeof(LayoutSFA));
  L.lay_sfb = take((size_t)G * sizeof(LayoutSFB));
  // Each config's CUTLASS workspace (per-SM TMA descriptor copies, scheduler) depends on G and
  // sm_count only (the arguments' pointers are not read here).  Every config is initialised on
  // every call, as a bf16 family is: the chosen one is known on the device only.
  take_cutlass(L, take, G, sm_count, std::make_index_sequence<kNumConfigs>{});
  L.total = off;
  return L;
}

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
struct Fp8Tuning {
  float fixed[MOONEP_GEMM_FP8_MAX_CONFIGS], per_round[MOONEP_GEMM_FP8_MAX_CONFIGS],
      per_kblock[MOONEP_GEMM_FP8_MAX_CONFIGS];
  float mem_bytes_per_us, tie_tol;
};

__device__ __forceinline__ int warp_sum(int v) {
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// ---- prep kernel --------------------------------------------------------------------------

struct PrepParams {
  const int* cu;
  int G, epn, M, N, K, C, P;  // C = ceil(K / 128), P = ceil(N / 128)
  int config;                 // >= 0: forced; -1: the cost model chooses
  int sm_count;
  Fp8Tuning tune;
  const ElementA* A;
  const ElementScale* SA;
  const ElementB *BL, *BS;
  const ElementScale *SBL, *SBS;
  ElementD* D;
  int* chosen;
  UShape* shapes;
  const ElementA** ptr_a;
  const ElementB** ptr_b;
  ElementD** ptr_d;
  const ElementScale** ptr_sfa;
  const ElementScale** ptr_sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* lay_sfa;
  LayoutSFB* lay_sfb;
};

__device__ __forceinline__ int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

constexpr int kPrepThreads = 256;
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
          const ConfigGeom gc = geom_of(c);
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
          const int slots = p.sm_count * (geom_of(c).pingpong ? 2 : 1);
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
      p.lay_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, p.N, p.K, 1));
      p.lay_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, p.N, p.K, 1));
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
bool aligned4(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; }

// A family: the configs [First, First + sizeof...(I)) of the table, which share a cluster shape,
// as one fused kernel (gemm_kernel.cuh's fused_grouped_gemm: the branch is the chosen word minus
// First).
template <int First, size_t... I>
struct Family {
  using FP = FusedParams<typename Cfg<First + I>::Kernel...>;
  using C0 = Cfg<First>;
  static_assert(((Cfg<First + I>::cm == C0::cm && Cfg<First + I>::cn == C0::cn) && ...),
                "a family has one cluster shape");
  static_assert(((Cfg<First + I>::Kernel::MaxThreadsPerBlock == C0::Kernel::MaxThreadsPerBlock) &&
                 ...),
                "a family has one block size");
  static constexpr int smem() {
    int m = 0;
    ((m = int(Cfg<First + I>::Kernel::SharedStorageSize) > m
              ? int(Cfg<First + I>::Kernel::SharedStorageSize)
              : m),
     ...);
    return m;
  }

  // Initialise config J's CUTLASS params (its own workspace part) and shrink `grid` to the
  // smallest of the family's persistent grids, so every CTA is co-resident whichever branch runs.
  template <size_t J>
  static cutlass::Status init_one(FP& fp, int G, int sm_count, char* ws, const Layout& L,
                                  cudaStream_t s, dim3& grid) {
    using C = Cfg<First + J>;
    auto args = arguments<C>(G, sm_count, ws, L);
    cutlass::Status st = C::Kernel::initialize_workspace(args, ws + L.cutlass[First + J], s);
    if (st != cutlass::Status::kSuccess) return st;
    cute::get<J>(fp.p) = C::Kernel::to_underlying_arguments(args, ws + L.cutlass[First + J]);
    const dim3 g = C::Kernel::get_grid_shape(cute::get<J>(fp.p));
    if (J == 0 || (size_t)g.x * g.y * g.z < (size_t)grid.x * grid.y * grid.z) grid = g;
    return cutlass::Status::kSuccess;
  }

  // CUTLASS's initialisation (host-side params; before the prep kernel, so that an error leaves
  // nothing enqueued and nothing is launched between the prep kernel and its PDL dependent)
  static cutlass::Status init(FP& fp, int G, int sm_count, char* ws, const Layout& L,
                              cudaStream_t s, dim3& grid, const int* chosen) {
    cutlass::Status st = cutlass::Status::kSuccess;
    (void)(((st = init_one<I>(fp, G, sm_count, ws, L, s, grid)) == cutlass::Status::kSuccess) &&
           ...);
    fp.chosen = chosen;
    fp.first = First;
    return st;
  }

  static cudaError_t launch(const FP& fp, dim3 grid, cudaStream_t s, bool pdl,
                            const char** step) {
    return launch_fused(&fused_grouped_gemm<typename Cfg<First + I>::Kernel...>, fp, grid,
                        C0::Kernel::get_block_shape(), smem(), C0::cm, C0::cn, s, pdl, step);
  }
};

using Family0 = Family<0, 0, 1>;
static_assert(kAutoConfigs == 2, "Family0 lists every config");

// The prep kernel, then the family of `config` (-1: Family0, whose branch the prep kernel picks).
template <class F>
int run_family(const PrepParams& p, int G, int sm_count, char* ws, const Layout& L,
               cudaStream_t s, int tail_blocks, bool pdl) {
  typename F::FP fp;
  dim3 grid(1, 1, 1);
  const cutlass::Status st = F::init(fp, G, sm_count, ws, L, s, grid, p.chosen);
  if (st != cutlass::Status::kSuccess) {
    char msg[256];
    snprintf(msg, sizeof(msg), "moonep_grouped_gemm_fp8: CUTLASS initialize failed: %s",
             cutlassGetStatusString(st));
    return gemm_fail(msg);
  }
  prep_fp8<<<1 + tail_blocks, kPrepThreads, 0, s>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    char msg[256];
    snprintf(msg, sizeof(msg), "moonep_grouped_gemm_fp8: prep kernel launch failed: %s",
             cudaGetErrorString(e));
    return gemm_fail(msg);
  }
  const char* step = "";
  e = F::launch(fp, grid, s, pdl, &step);
  if (e != cudaSuccess) {
    char msg[256];
    snprintf(msg, sizeof(msg), "moonep_grouped_gemm_fp8: %s failed: %s (grid %u x %u)", step,
             cudaGetErrorString(e), grid.x, grid.y);
    return gemm_fail(msg);
  }
  return 0;
}

}  // namespace fp8
}  // namespace moonep

using namespace moonep;

extern "C" {

int moonep_gemm_fp8_num_configs(void) { return fp8::kNumConfigs; }

int moonep_gemm_fp8_config_info(int config, int* out8) {
  if (config < 0 || config >= fp8::kNumConfigs || !out8) return -1;
  const ConfigGeom g = fp8::geom_of(config);
  const int v[8] = {g.BM, g.BN, g.BK, g.CM, g.CN, g.pingpong, g.EN, g.swap};
  for (int i = 0; i < 8; ++i) out8[i] = v[i];
  return 0;
}

size_t moonep_gemm_fp8_workspace_bytes(int G, int sm_count) {
  if (G <= 0 || G > fp8::kMaxGroups || sm_count <= 0 || sm_count > fp8::kMaxSms) return 0;
  return fp8::layout(G, sm_count).total;
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
  const fp8::Layout L = fp8::layout(G, sm_count);
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
  p.C = (k + fp8::kScaleTile - 1) / fp8::kScaleTile;
  p.P = (n + fp8::kScaleTile - 1) / fp8::kScaleTile;
  p.config = config;
  p.sm_count = sm_count;
  if (tuning) {  // MOONEP_GEMM_FP8_TUNING_LEN floats, laid out as moonep_gemm.h says
    const int C = MOONEP_GEMM_FP8_MAX_CONFIGS;
    for (int c = 0; c < C; ++c) {
      p.tune.fixed[c] = tuning[c];
      p.tune.per_round[c] = tuning[C + c];
      p.tune.per_kblock[c] = tuning[2 * C + c];
    }
    p.tune.mem_bytes_per_us = tuning[3 * C] > 0.f ? tuning[3 * C] : 1.f;
    p.tune.tie_tol = tuning[3 * C + 1];
  }
  p.A = static_cast<const fp8::ElementA*>(a);
  p.SA = a_scale;
  p.BL = static_cast<const fp8::ElementB*>(b_local);
  p.BS = static_cast<const fp8::ElementB*>(b_slot);
  p.SBL = b_local_scale;
  p.SBS = b_slot_scale;
  p.D = static_cast<fp8::ElementD*>(d);
  p.chosen = reinterpret_cast<int*>(ws + L.chosen);
  p.shapes = reinterpret_cast<fp8::UShape*>(ws + L.shapes);
  p.ptr_a = reinterpret_cast<const fp8::ElementA**>(ws + L.ptr_a);
  p.ptr_b = reinterpret_cast<const fp8::ElementB**>(ws + L.ptr_b);
  p.ptr_d = reinterpret_cast<fp8::ElementD**>(ws + L.ptr_d);
  p.ptr_sfa = reinterpret_cast<const fp8::ElementScale**>(ws + L.ptr_sfa);
  p.ptr_sfb = reinterpret_cast<const fp8::ElementScale**>(ws + L.ptr_sfb);
  p.stride_a = reinterpret_cast<fp8::StrideA*>(ws + L.stride_a);
  p.stride_b = reinterpret_cast<fp8::StrideB*>(ws + L.stride_b);
  p.stride_d = reinterpret_cast<fp8::StrideD*>(ws + L.stride_d);
  p.lay_sfa = reinterpret_cast<fp8::LayoutSFA*>(ws + L.lay_sfa);
  p.lay_sfb = reinterpret_cast<fp8::LayoutSFB*>(ws + L.lay_sfb);

  // 1 block for the arrays and the choice + zeroing blocks sized to M * n (the padding is only
  // known on the device; at most kMaxTailBlocks, grid-strided); none with MOONEP_GEMM_KEEP_TAIL
  const long long vec = (long long)M * n / 8;
  long long tail = (vec + fp8::kPrepThreads - 1) / fp8::kPrepThreads;
  if (tail > fp8::kMaxTailBlocks) tail = fp8::kMaxTailBlocks;
  if (tail > sm_count - 1) tail = sm_count - 1;
  if (tail < 1) tail = 1;
  if (flags & MOONEP_GEMM_KEEP_TAIL) tail = 0;
  const bool pdl = (flags & MOONEP_GEMM_PDL) != 0;
  return fp8::run_family<fp8::Family0>(p, G, sm_count, ws, L, s, (int)tail, pdl);
}

}  // extern "C"
