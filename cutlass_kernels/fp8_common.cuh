// Internal to libmoonep_gemm.so (not part of its ABI): what the two FP8 grouped GEMMs with
// blockwise scaling share, kernel_fp8_fwd.cu (y = x . W_g^T) and kernel_fp8_wgrad.cu
// (dW_g = dy^T . x).  Both are a prep kernel that writes every group's problem on the device,
// then one persistent CUTLASS ptr-array launch of the config family (gemm_kernel.cuh's
// fused_grouped_gemm) as its programmatic dependent.  Shared here: the operand types, one
// config's CUTLASS kernel, the call's workspace (the problem arrays, then each config's CUTLASS
// workspace), CUTLASS's arguments, the family's initialisation and launch, the cost model's
// tuning table and the host's launch sequence.  Each file keeps its own: the scales' granularity
// and majorness, the prep kernel (each group's problem, the config choice, the zeroing) and the
// exported checks.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <tuple>
#include <type_traits>
#include <utility>

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

#include "gemm_kernel.cuh"  // fused_grouped_gemm, FusedParams, launch_fused, ConfigGeom
#include "moonep_gemm.h"

namespace moonep {

// prep.cu: the thread-local message of moonep_gemm_last_error()
void gemm_clear_error();
int gemm_fail(const char* msg);

namespace fp8_common {

using namespace cute;

constexpr int kTileK = 128;  // every config's K tile = the scales' K block (one promotion a tile)
constexpr int kMaxGroups = 1024;
constexpr int kMaxSms = 1024;
constexpr int kPrepThreads = 256;

// A is M x K with K contiguous (CUTLASS RowMajor); B is N x K with K contiguous (CUTLASS's
// column-major B, D = A . B^T); D is M x N row-major bf16, written once (beta = 0, no C).  The
// sm90 FP8 wgmma takes K-major operands only.
using ElementA = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;
using ElementB = cutlass::float_e4m3_t;
using LayoutB = cutlass::layout::ColumnMajor;
using ElementD = cutlass::bfloat16_t;
using LayoutD = cutlass::layout::RowMajor;
using ElementC = void;
using ElementAcc = float;
using ElementScale = float;

constexpr int kAlignA = 128 / cutlass::sizeof_bits<ElementA>::value;  // 16 e4m3 (TMA unit)
constexpr int kAlignB = 128 / cutlass::sizeof_bits<ElementB>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;  // 8 bf16

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using UShape = typename ProblemShape::UnderlyingProblemShape;
using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>;

// The scales: one fp32 scale per 1 x ScaleN x kTileK block of (M, N, K), both operands'
// scales in one majorness (each file says why its tensors are laid out so).
template <int ScaleN, cute::GMMA::Major Major>
struct Scales {
  using Config =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, ScaleN, kTileK, Major, Major>;
  using LayoutSFA = decltype(Config::deduce_layoutSFA());
  using LayoutSFB = decltype(Config::deduce_layoutSFB());
  static constexpr int scale_n = ScaleN;
  static constexpr bool mn_major = Major == cute::GMMA::Major::MN;
};

// One config: tile BM x BN x kTileK, cluster CM x CN, cooperative or ping-pong, epilogue subtile
// width EN (0: CUTLASS's), the persistent scheduler's raster order (0 along M, 1 along N).
template <class Sc, int BM, int BN, bool Pingpong, int CM, int CN, int EN = 0, int RasterN = 0>
struct Config {
  using TileShape = Shape<Int<BM>, Int<BN>, Int<kTileK>>;
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
      cute::tuple<LayoutA*, typename Sc::LayoutSFA*>, kAlignA, ElementB,
      cute::tuple<LayoutB*, typename Sc::LayoutSFB*>, kAlignB, ElementAcc, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using LayoutSFA = typename Sc::LayoutSFA;
  using LayoutSFB = typename Sc::LayoutSFB;
  static constexpr int cm = CM, cn = CN, raster_n = RasterN;
  __host__ __device__ static constexpr ConfigGeom geom() {
    return {BM, BN, kTileK, CM, CN, Pingpong ? 1 : 0, EN, 0};
  }

  // CUTLASS's mainloop rebuilds each group's scale layout from the group's problem shape and
  // these compile-time facts (it ignores the layout arrays), so they must be ours: the scale
  // tensors are used as they are.
  static_assert(CollectiveMainloop::MMajorSFA == Sc::mn_major &&
                    CollectiveMainloop::NMajorSFB == Sc::mn_major,
                "the mainloop must read the scales in the majorness of our tensors");
  static_assert(CollectiveMainloop::ScaleGranularityM == 1 &&
                    CollectiveMainloop::ScaleGranularityN == Sc::scale_n &&
                    CollectiveMainloop::ScaleGranularityK == kTileK,
                "scale granularity (1, ScaleN, 128)");
};

// The cost model's constants (moonep_gemm.h MOONEP_GEMM_FP8_TUNING_LEN floats: fixed,
// per_round, per_kblock per config, then mem_bytes_per_us and tie_tol), read from the host's
// table; each prep kernel's model says what they mean there.
struct Tuning {
  float fixed[MOONEP_GEMM_FP8_MAX_CONFIGS], per_round[MOONEP_GEMM_FP8_MAX_CONFIGS],
      per_kblock[MOONEP_GEMM_FP8_MAX_CONFIGS];
  float mem_bytes_per_us, tie_tol;
};

inline Tuning read_tuning(const float* tuning) {
  Tuning t{};
  const int C = MOONEP_GEMM_FP8_MAX_CONFIGS;
  for (int c = 0; c < C; ++c) {
    t.fixed[c] = tuning[c];
    t.per_round[c] = tuning[C + c];
    t.per_kblock[c] = tuning[2 * C + c];
  }
  t.mem_bytes_per_us = tuning[3 * C] > 0.f ? tuning[3 * C] : 1.f;
  t.tie_tol = tuning[3 * C + 1];
  return t;
}

__device__ __forceinline__ int clampi(int v, int lo, int hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

__device__ __forceinline__ int warp_sum(int v) {
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

inline bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }
inline bool aligned4(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 3u) == 0; }

constexpr size_t kAlign = 256;  // the workspace's parts (CUTLASS's TMA descriptors: 64 B objects)
inline size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// A config table (a std::tuple of Config, in the order of the config index) and what a call of
// it needs on the host.
template <class Configs>
struct Table {
  static constexpr int kNumConfigs = int(std::tuple_size_v<Configs>);
  static_assert(kNumConfigs <= MOONEP_GEMM_FP8_MAX_CONFIGS, "config count");
  template <int I>
  using Cfg = std::tuple_element_t<I, Configs>;

  template <size_t... I>
  __host__ __device__ static constexpr ConfigGeom geom_at(int c, std::index_sequence<I...>) {
    ConfigGeom g{};
    (void)((c == int(I) ? (g = Cfg<I>::geom(), true) : false) || ...);
    return g;
  }
  // A function, not only an array: the prep kernel's model reads the geometry on the device.
  __host__ __device__ static constexpr ConfigGeom geom_of(int c) {
    return geom_at(c, std::make_index_sequence<kNumConfigs>{});
  }

  // The configs share the operand, stride and scale-layout types, so one set of problem arrays
  // (written by the prep kernel) serves whichever config runs.
  using StrideA = typename Cfg<0>::Kernel::InternalStrideA;
  using StrideB = typename Cfg<0>::Kernel::InternalStrideB;
  using StrideD = typename Cfg<0>::Kernel::InternalStrideD;
  using LayoutSFA = typename Cfg<0>::LayoutSFA;
  using LayoutSFB = typename Cfg<0>::LayoutSFB;
  template <size_t... I>
  static constexpr bool same_types(std::index_sequence<I...>) {
    return ((std::is_same_v<StrideA, typename Cfg<I>::Kernel::InternalStrideA> &&
             std::is_same_v<StrideB, typename Cfg<I>::Kernel::InternalStrideB> &&
             std::is_same_v<StrideD, typename Cfg<I>::Kernel::InternalStrideD> &&
             std::is_same_v<LayoutSFA, typename Cfg<I>::LayoutSFA> &&
             std::is_same_v<LayoutSFB, typename Cfg<I>::LayoutSFB>) && ...);
  }
  static_assert(same_types(std::make_index_sequence<kNumConfigs>{}),
                "configs must share the stride and scale-layout types");

  struct Layout {  // byte offsets inside the call's workspace
    size_t chosen, shapes, ptr_a, ptr_b, ptr_d, ptr_sfa, ptr_sfb, stride_a, stride_b, stride_d,
        lay_sfa, lay_sfb, cutlass[kNumConfigs], total;
  };

  // The problem arrays of one call in its workspace: the prep kernel writes them (and the
  // chosen config), the fused GEMM reads them.
  struct Problems {
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

  static Problems problems(char* ws, const Layout& L) {
    Problems a;
    a.chosen = reinterpret_cast<int*>(ws + L.chosen);
    a.shapes = reinterpret_cast<UShape*>(ws + L.shapes);
    a.ptr_a = reinterpret_cast<const ElementA**>(ws + L.ptr_a);
    a.ptr_b = reinterpret_cast<const ElementB**>(ws + L.ptr_b);
    a.ptr_d = reinterpret_cast<ElementD**>(ws + L.ptr_d);
    a.ptr_sfa = reinterpret_cast<const ElementScale**>(ws + L.ptr_sfa);
    a.ptr_sfb = reinterpret_cast<const ElementScale**>(ws + L.ptr_sfb);
    a.stride_a = reinterpret_cast<StrideA*>(ws + L.stride_a);
    a.stride_b = reinterpret_cast<StrideB*>(ws + L.stride_b);
    a.stride_d = reinterpret_cast<StrideD*>(ws + L.stride_d);
    a.lay_sfa = reinterpret_cast<LayoutSFA*>(ws + L.lay_sfa);
    a.lay_sfb = reinterpret_cast<LayoutSFB*>(ws + L.lay_sfb);
    return a;
  }

  // Config C's CUTLASS arguments for a call; only the pointer arrays' addresses and G / sm_count
  // matter for the workspace size and the launch (everything per group is read on the device).
  template <class C>
  static typename C::Gemm::Arguments arguments(int G, int sm_count, char* base, const Layout& L) {
    using Args = typename C::Gemm::Arguments;
    // base may be NULL (workspace sizing): integer arithmetic, no pointer into nothing
    const uintptr_t ws0 = reinterpret_cast<uintptr_t>(base);
    auto at = [&](size_t off) { return reinterpret_cast<char*>(ws0 + off); };
    Args args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {G, reinterpret_cast<UShape*>(at(L.shapes)), nullptr};
    args.mainloop.ptr_A = reinterpret_cast<ElementA const**>(at(L.ptr_a));
    args.mainloop.dA = reinterpret_cast<StrideA*>(at(L.stride_a));
    args.mainloop.ptr_B = reinterpret_cast<ElementB const**>(at(L.ptr_b));
    args.mainloop.dB = reinterpret_cast<StrideB*>(at(L.stride_b));
    args.mainloop.ptr_SFA = reinterpret_cast<ElementScale const**>(at(L.ptr_sfa));
    args.mainloop.layout_SFA = reinterpret_cast<LayoutSFA*>(at(L.lay_sfa));
    args.mainloop.ptr_SFB = reinterpret_cast<ElementScale const**>(at(L.ptr_sfb));
    args.mainloop.layout_SFB = reinterpret_cast<LayoutSFB*>(at(L.lay_sfb));
    typename C::CollectiveEpilogue::Arguments epi{};
    epi.thread.alpha = 1.f;
    epi.thread.beta = 0.f;
    epi.ptr_C = nullptr;
    epi.dC = nullptr;
    epi.ptr_D = reinterpret_cast<ElementD**>(at(L.ptr_d));
    epi.dD = reinterpret_cast<StrideD*>(at(L.stride_d));
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
  static void take_cutlass(Layout& L, Take& take, int G, int sm_count,
                           std::index_sequence<I...>) {
    ((L.cutlass[I] = take(Cfg<I>::Gemm::get_workspace_size(
          arguments<Cfg<I>>(G, sm_count, nullptr, L)))), ...);
  }

  static Layout layout(int G, int sm_count) {
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

  // The exports *_config_info (config c's geometry as 8 ints, moonep_gemm.h; -1: no such
  // config) and *_workspace_bytes (0 outside the limits).
  static int config_info(int c, int* out8) {
    if (c < 0 || c >= kNumConfigs || !out8) return -1;
    const ConfigGeom g = geom_of(c);
    const int v[8] = {g.BM, g.BN, g.BK, g.CM, g.CN, g.pingpong, g.EN, g.swap};
    for (int i = 0; i < 8; ++i) out8[i] = v[i];
    return 0;
  }
  static size_t workspace_bytes(int G, int sm_count) {
    if (G <= 0 || G > kMaxGroups || sm_count <= 0 || sm_count > kMaxSms) return 0;
    return layout(G, sm_count).total;
  }

  // A family: the configs [First, First + sizeof...(I)) of the table, which share a cluster
  // shape, as one fused kernel (gemm_kernel.cuh's fused_grouped_gemm: the branch is the chosen
  // word minus First).
  template <int First, size_t... I>
  struct Family {
    using FP = FusedParams<typename Cfg<First + I>::Kernel...>;
    using C0 = Cfg<First>;
    static_assert(((Cfg<First + I>::cm == C0::cm && Cfg<First + I>::cn == C0::cn) && ...),
                  "a family has one cluster shape");
    static_assert(
        ((Cfg<First + I>::Kernel::MaxThreadsPerBlock == C0::Kernel::MaxThreadsPerBlock) && ...),
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
    // smallest of the family's persistent grids, so every CTA is co-resident whichever branch
    // runs.
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

    static cutlass::Status init(FP& fp, int G, int sm_count, char* ws, const Layout& L,
                                cudaStream_t s, dim3& grid, const int* chosen) {
      cutlass::Status st = cutlass::Status::kSuccess;
      (void)(((st = init_one<I>(fp, G, sm_count, ws, L, s, grid)) ==
              cutlass::Status::kSuccess) &&
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

  // One call: CUTLASS's initialisation of family F (host-side params; before the prep kernel,
  // so that an error leaves nothing enqueued and nothing is launched between the prep kernel and
  // its PDL dependent), the prep kernel (launch_prep()), then F's fused kernel.  name: the
  // export, for the error messages.
  template <class F, class LaunchPrep>
  static int run(const char* name, const int* chosen, int G, int sm_count, char* ws,
                 const Layout& L, cudaStream_t s, bool pdl, LaunchPrep&& launch_prep) {
    typename F::FP fp;
    dim3 grid(1, 1, 1);
    char msg[256];
    const cutlass::Status st = F::init(fp, G, sm_count, ws, L, s, grid, chosen);
    if (st != cutlass::Status::kSuccess) {
      snprintf(msg, sizeof(msg), "%s: CUTLASS initialize failed: %s", name,
               cutlassGetStatusString(st));
      return gemm_fail(msg);
    }
    launch_prep();
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      snprintf(msg, sizeof(msg), "%s: prep kernel launch failed: %s", name, cudaGetErrorString(e));
      return gemm_fail(msg);
    }
    const char* step = "";
    e = F::launch(fp, grid, s, pdl, &step);
    if (e != cudaSuccess) {
      snprintf(msg, sizeof(msg), "%s: %s failed: %s (grid %u x %u)", name, step,
               cudaGetErrorString(e), grid.x, grid.y);
      return gemm_fail(msg);
    }
    return 0;
  }
};

}  // namespace fp8_common
}  // namespace moonep
