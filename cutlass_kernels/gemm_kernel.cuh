// One CUTLASS sm90 ptr-array grouped GEMM, instantiated by the kernel_*.cu translation units
// (one configuration each, so nvcc jobs stay small and can run in parallel).
//
// Layouts (CUTLASS convention: A is M x K, B is N x K, D is M x N):
//   fwd   A = x  [M,K] RowMajor      B = W_g [N,K] ColumnMajor (K contiguous)  D = y  RowMajor
//   dgrad A = dy [M,N] RowMajor      B = W_g viewed (K x N), N contiguous: RowMajor  D = dx
//   wgrad A = dy^T (N x M_g) ColumnMajor, B = x^T (K x M_g) RowMajor, D = dW_g [N,K] fp32,
//         C = D with beta = 1 (the += of the accumulate op happens in the epilogue).
//   wgrad_lp  as wgrad, but D = dW_g in bf16 written once (beta = 0, no C): the autograd path,
//         4x fewer output bytes than the fp32 read-modify-write.
#pragma once

#include <cstdio>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "configs.h"

namespace moonep {

using namespace cute;

template <int Kind>
struct KindTraits;

template <>
struct KindTraits<0> {  // fwd
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr float beta = 0.f;
};
template <>
struct KindTraits<1> : KindTraits<0> {  // dgrad
  using LayoutB = cutlass::layout::RowMajor;
};
template <>
struct KindTraits<2> {  // wgrad
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = float;
  using ElementD = float;
  using LayoutA = cutlass::layout::ColumnMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr float beta = 1.f;
};
template <>
struct KindTraits<3> : KindTraits<2> {  // wgrad_lp
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  static constexpr float beta = 0.f;
};

template <int Kind, int BM, int BN, int BK, int CM, int CN, bool Pingpong>
struct GroupedGemm {
  using T = KindTraits<Kind>;
  using ElementA = typename T::ElementA;
  using ElementB = typename T::ElementB;
  using ElementC = typename T::ElementC;
  using ElementD = typename T::ElementD;
  using LayoutA = typename T::LayoutA;
  using LayoutB = typename T::LayoutB;
  using LayoutC = typename T::LayoutD;
  using LayoutD = typename T::LayoutD;
  using ElementAcc = float;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using TileShape = Shape<Int<BM>, Int<BN>, Int<BK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using KernelSchedule =
      cute::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      cute::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  static constexpr int kAlignA = 128 / cutlass::sizeof_bits<ElementA>::value;
  static constexpr int kAlignB = 128 / cutlass::sizeof_bits<ElementB>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int kAlignC =
      cute::is_void_v<ElementC> ? kAlignD : 128 / cutlass::sizeof_bits<ElementC>::value;

  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, ElementC, LayoutC*,
      kAlignC, ElementD, LayoutD*, kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA, ElementB,
      LayoutB*, kAlignB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;

  static typename Gemm::Arguments arguments(RunArgs const& r) {
    using UShape = typename ProblemShape::UnderlyingProblemShape;
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {r.G, reinterpret_cast<UShape*>(r.shapes), nullptr};
    args.mainloop = {reinterpret_cast<ElementA const**>(r.ptr_A),
                     reinterpret_cast<StrideA*>(r.stride_A),
                     reinterpret_cast<ElementB const**>(r.ptr_B),
                     reinterpret_cast<StrideB*>(r.stride_B)};
    typename CollectiveEpilogue::Arguments epi{};
    epi.thread.alpha = 1.f;
    epi.thread.beta = T::beta;
    if constexpr (!cute::is_void_v<ElementC>) {
      epi.ptr_C = reinterpret_cast<ElementC const**>(r.ptr_C);
      epi.dC = reinterpret_cast<StrideC*>(r.stride_C);
    }
    epi.ptr_D = reinterpret_cast<ElementD**>(r.ptr_D);
    epi.dD = reinterpret_cast<StrideD*>(r.stride_D);
    args.epilogue = epi;
    int device = 0;
    cudaGetDevice(&device);
    args.hw_info.device_id = device;
    args.hw_info.sm_count = r.sm_count;
    static int max_active_clusters = -1;  // occupancy query once per process
    if (max_active_clusters < 0) {
      max_active_clusters =
          cutlass::KernelHardwareInfo::query_device_max_active_clusters<Kernel>();
    }
    args.hw_info.max_active_clusters = max_active_clusters;
    using Raster = typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90GroupParams<
        typename ProblemShape::UnderlyingProblemShape>::RasterOrderOptions;
    args.scheduler.raster_order = r.raster == 1 ? Raster::AlongN : Raster::AlongM;
    return args;
  }

  static size_t workspace_bytes(int G, int sm_count) {
    RunArgs r{};
    r.G = G;
    r.sm_count = sm_count;
    auto args = arguments(r);
    return Gemm::get_workspace_size(args);
  }

  static int run(RunArgs const& r, char* err, int err_len) {
    auto args = arguments(r);
    Gemm gemm;
    cudaStream_t stream = reinterpret_cast<cudaStream_t>(r.stream);
    cutlass::Status st = gemm.initialize(args, r.cutlass_ws, stream);
    if (st != cutlass::Status::kSuccess) {
      snprintf(err, err_len, "CUTLASS initialize failed: %s", cutlassGetStatusString(st));
      return -1;
    }
    st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess) {
      snprintf(err, err_len, "CUTLASS run failed: %s (%s)", cutlassGetStatusString(st),
               cudaGetErrorString(cudaGetLastError()));
      return -1;
    }
    return 0;
  }

  static void strides(int M, int N, int K, StrideBytes* out) {
    auto sa = cutlass::make_cute_packed_stride(StrideA{}, make_shape(M, K, 1));
    auto sb = cutlass::make_cute_packed_stride(StrideB{}, make_shape(N, K, 1));
    auto sd = cutlass::make_cute_packed_stride(StrideD{}, make_shape(M, N, 1));
    static_assert(sizeof(sa) <= 32 && sizeof(sb) <= 32 && sizeof(sd) <= 32, "stride size");
    memcpy(out->a, &sa, sizeof(sa));
    memcpy(out->b, &sb, sizeof(sb));
    memcpy(out->c, &sd, sizeof(sd));
    memcpy(out->d, &sd, sizeof(sd));
    out->size_a = sizeof(sa);
    out->size_b = sizeof(sb);
    out->size_c = sizeof(sd);
    out->size_d = sizeof(sd);
  }
};

}  // namespace moonep

// Defines moonep::entry_<kind>_<name>, a ConfigEntry, in the including translation unit.
#define MOONEP_DEFINE_CONFIG(KIND_ID, KIND, NAME, BM, BN, BK, CM, CN, PP)                    \
  namespace moonep {                                                                         \
  using Gemm_##KIND##_##NAME = GroupedGemm<KIND_ID, BM, BN, BK, CM, CN, PP != 0>;           \
  extern const ConfigEntry entry_##KIND##_##NAME = {                                         \
      #NAME, {BM, BN, BK, CM, CN, PP}, &Gemm_##KIND##_##NAME::run,                           \
      &Gemm_##KIND##_##NAME::workspace_bytes, &Gemm_##KIND##_##NAME::strides};               \
  }
