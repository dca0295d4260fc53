// The FP8 grouped GEMM with blockwise scaling (the DeepSeek-V3 recipe), sm90a:
//   D[rows of g] (bf16) = (A * SA)[rows of g] . (B_g * SB_g)^T, fp32 accumulation,
// over the G = 2*epn groups of a receive buffer, in one CUTLASS ptr-array launch.  The exports
// moonep_grouped_gemm_fp8 and moonep_gemm_fp8_workspace_bytes are documented in moonep_gemm.h.
//
// As the bf16 path (prep.cu + gemm_kernel.cuh), a small prep kernel reads cu_seqlens on the
// device and writes the per-group problem shapes and pointers into the caller's workspace, so no
// group size reaches the host (no sync; capturable in a CUDA graph), then one persistent grouped
// CUTLASS kernel reads them.  One config only (no device cost model):
//   tile 128 x 128 x 128, cluster 1 x 2 (the two CTAs of a cluster share, by TMA multicast, the
//   A tile of one group's rows and take neighbouring 128-column slices of the weight), the
//   cooperative warp-specialised FP8 blockwise mainloop (KernelPtrArrayTmaWarpSpecialized-
//   CooperativeFP8BlockScaledAccum): the tensor cores accumulate one 128-deep K block in fp32
//   registers, which are then multiplied by SA[row, kb] * SB[nb, kb] and added into a separate
//   fp32 accumulator (promotion every K block; FP8 "fast accumulation" is off by construction).
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
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;

// Granularity (M, N, K) = (1, 128, 128); both K-major (see the top of the file).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleTile, kScaleTile,
                                                              cute::GMMA::Major::K,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, ElementC, LayoutD*,
    kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;

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

using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;
using UShape = typename ProblemShape::UnderlyingProblemShape;

// The layout must be what the mainloop rebuilds from the problem shape (it ignores ours), and
// the majorness must be ours: checked at compile time.
static_assert(!CollectiveMainloop::MMajorSFA && !CollectiveMainloop::NMajorSFB,
              "the mainloop must read K-major scales (our a_scale / weight-scale layouts)");
static_assert(CollectiveMainloop::ScaleGranularityM == 1 &&
                  CollectiveMainloop::ScaleGranularityN == kScaleTile &&
                  CollectiveMainloop::ScaleGranularityK == kScaleTile,
              "scale granularity (1, 128, 128)");

// ---- workspace ----------------------------------------------------------------------------

constexpr size_t kAlign = 256;
inline size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Layout {  // byte offsets inside the call's workspace
  size_t shapes, ptr_a, ptr_b, ptr_d, ptr_sfa, ptr_sfb, stride_a, stride_b, stride_d, lay_sfa,
      lay_sfb, cutlass, total;
};

// CUTLASS's arguments for a call; only the pointer arrays' addresses and G / sm_count matter for
// the workspace size and the launch (everything per group is read on the device).
Gemm::Arguments arguments(int G, int sm_count, char* base, const Layout& L) {
  // base may be NULL (workspace sizing): integer arithmetic, no pointer into nothing
  const uintptr_t ws0 = reinterpret_cast<uintptr_t>(base);
  struct At {
    uintptr_t b;
    char* operator+(size_t off) const { return reinterpret_cast<char*>(b + off); }
  } ws{ws0};
  Gemm::Arguments args;
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
  typename CollectiveEpilogue::Arguments epi{};
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
  static int max_active_clusters = -1;  // occupancy query once per process (as gemm_kernel.cuh)
  if (max_active_clusters < 0)
    max_active_clusters = cutlass::KernelHardwareInfo::query_device_max_active_clusters<Kernel>();
  args.hw_info.max_active_clusters = max_active_clusters;
  // Along M: co-resident CTAs share a weight slice (the bf16 fwd's default, raster = 0).
  using Raster = typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90GroupParams<
      UShape>::RasterOrderOptions;
  args.scheduler.raster_order = Raster::AlongM;
  return args;
}

Layout layout(int G, int sm_count) {
  Layout L{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
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
  L.cutlass = off;
  // The CUTLASS workspace (per-SM TMA descriptor copies, scheduler) depends on G and sm_count
  // only; the arguments' pointers are not read here.
  const Gemm::Arguments args = arguments(G, sm_count, nullptr, L);
  off = align_up(off + Gemm::get_workspace_size(args));
  L.total = off;
  return L;
}

// ---- prep kernel --------------------------------------------------------------------------

struct PrepParams {
  const int* cu;
  int G, epn, M, N, K, C, P;  // C = ceil(K / 128), P = ceil(N / 128)
  const ElementA* A;
  const ElementScale* SA;
  const ElementB *BL, *BS;
  const ElementScale *SBL, *SBS;
  ElementD* D;
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

// Block 0: the problem arrays of every group (thread per group, strided).  Blocks >= 1: zero the
// rows of D at or past cu_seqlens[G-1] (padding; no group writes them).  The rows of group g are
// [cu[g-1], cu[g]) clamped to [0, M] (cu[-1] := 0), so bad offsets never read or write out of
// bounds, and an empty group gets a 0-row problem (no tiles: the scheduler skips it).
__global__ void __launch_bounds__(kPrepThreads) prep_fp8(const __grid_constant__ PrepParams p) {
  if (blockIdx.x == 0) {
    for (int g = threadIdx.x; g < p.G; g += blockDim.x) {
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

}  // namespace fp8
}  // namespace moonep

using namespace moonep;

extern "C" {

size_t moonep_gemm_fp8_workspace_bytes(int G, int sm_count) {
  if (G <= 0 || G > fp8::kMaxGroups || sm_count <= 0 || sm_count > fp8::kMaxSms) return 0;
  return fp8::layout(G, sm_count).total;
}

int moonep_grouped_gemm_fp8(const void* a, const float* a_scale, const void* b_local,
                            const float* b_local_scale, const void* b_slot,
                            const float* b_slot_scale, void* d, const int* cu_seqlens, int G,
                            int epn, int M, int n, int k, void* workspace, size_t workspace_bytes,
                            int sm_count, void* stream) {
  gemm_clear_error();
  if (epn < 1 || G != 2 * epn || G > fp8::kMaxGroups)
    return gemm_fail("moonep_grouped_gemm_fp8: G must be 2*epn, epn >= 1, G <= 1024");
  if (M < 0) return gemm_fail("moonep_grouped_gemm_fp8: M must be >= 0");
  if (n <= 0 || k <= 0 || n % 16 || k % 16)
    return gemm_fail("moonep_grouped_gemm_fp8: n and k must be positive multiples of 16 (16-byte "
                     "TMA rows of e4m3)");
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
  p.A = static_cast<const fp8::ElementA*>(a);
  p.SA = a_scale;
  p.BL = static_cast<const fp8::ElementB*>(b_local);
  p.BS = static_cast<const fp8::ElementB*>(b_slot);
  p.SBL = b_local_scale;
  p.SBS = b_slot_scale;
  p.D = static_cast<fp8::ElementD*>(d);
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

  // 1 block for the arrays + zeroing blocks sized to M * n (the padding is only known on the
  // device; at most kMaxTailBlocks, grid-strided)
  const long long vec = (long long)M * n / 8;
  long long tail = (vec + fp8::kPrepThreads - 1) / fp8::kPrepThreads;
  if (tail > fp8::kMaxTailBlocks) tail = fp8::kMaxTailBlocks;
  if (tail > sm_count - 1) tail = sm_count - 1;
  if (tail < 1) tail = 1;
  fp8::prep_fp8<<<1 + (int)tail, fp8::kPrepThreads, 0, s>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    char msg[256];
    snprintf(msg, sizeof(msg), "moonep_grouped_gemm_fp8: prep kernel launch failed: %s",
             cudaGetErrorString(e));
    return gemm_fail(msg);
  }

  fp8::Gemm gemm;
  const fp8::Gemm::Arguments args = fp8::arguments(G, sm_count, ws, L);
  cutlass::Status st = gemm.initialize(args, ws + L.cutlass, s);
  if (st == cutlass::Status::kSuccess) st = gemm.run(s);
  if (st != cutlass::Status::kSuccess) {
    char msg[256];
    const cudaError_t le = cudaGetLastError();
    snprintf(msg, sizeof(msg), "moonep_grouped_gemm_fp8: CUTLASS %s (%s)",
             cutlassGetStatusString(st), cudaGetErrorString(le));
    return gemm_fail(msg);
  }
  return 0;
}

}  // extern "C"
