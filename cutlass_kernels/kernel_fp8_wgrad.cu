// The FP8 weight-gradient grouped GEMM of the DeepSeek-V3 recipe, sm90a:
//   dW_g [O, I] (bf16) = (dy * s_dy)[rows of g]^T . (x * s_x)[rows of g], fp32 accumulation,
// over the G = 2*epn groups of a receive buffer, in one CUTLASS ptr-array launch whose
// reduction (CUTLASS's K) runs over each group's TOKENS.  The exports
// (moonep_grouped_gemm_fp8_wgrad, moonep_gemm_fp8_wgrad_workspace_bytes,
// moonep_gemm_fp8_wgrad_num_configs, moonep_gemm_fp8_wgrad_config_info) are documented in
// moonep_gemm.h; the op is moonep_ops/ops/grouped_mm_fp8_wgrad.py.  What it shares with the
// forward FP8 GEMM (types, config kernel, workspace, launch) is fp8_common.cuh.
//
// Operands: token-major ("transposed") e4m3 copies with one fp32 scale per 1 x 128 tile along
// the tokens of one group (moonep::quantize_fp8_tokens and its fused forms, quantize_fp8.py):
//   dyT [O, Mp] e4m3, dyT_scale [Nb, O] fp32;   xT [I, Mp] e4m3, xT_scale [Nb, I] fp32
// with Nb = floor(M/128) + G token tiles and Mp = 128 * Nb columns.  Group g (rows [s_g, e_g) of
// the receive buffer) owns the tiles t0_g .. t0_g + ceil((e_g - s_g)/128) - 1 with
//   t0_g = floor(s_g / 128) + g
// (a closed form of s_g and g whose tile ranges never overlap, for ANY token_padding: the
// quantiser and this kernel compute it independently from cu_seqlens, nothing is passed between
// them), i.e. columns [128 t0_g, 128 t0_g + M_g) of dyT / xT and rows t0_g.. of the scales.
// Every 128-token tile therefore lies inside one group (DeepSeek-V3's 1 x 128 tiles "per group").
//
// Why token-major copies: the sm90 FP8 wgmma takes K-major operands only, and the reduction of a
// wgrad runs over the tokens, so both operands must be token-contiguous (A = dy^T is O x M_g
// K-major = CUTLASS RowMajor; B = x^T is I x M_g K-major = CUTLASS ColumnMajor B, the forward
// kernel's layouts).  A group's A starts at dyT + 128 t0_g (16-byte aligned) with row stride Mp
// (a multiple of 128): the per-group strides are NOT packed, which the ptr-array kernel allows
// (its TMA descriptors are rebuilt per group from the stride arrays).  The last K tile of a group
// is partial: TMA fills past the group's K = M_g with zeros, and its scales are those of the last
// (partial) token tile.
//
// Scales: granularity (M, N, K) = (1, 1, 128) -- one scale per output row o and per output column
// i for each 128-token block -- so the promotion multiplies each accumulator element by
// s_dy[kb, o] * s_x[kb, i] (CUTLASS's ScaleMsPerTile > 1 && ScaleNsPerTile > 1 branch).  Both
// scale operands are MN-major: SFA element (o, kb) at kb * O + o, which is dyT_scale [Nb, O]
// row-major from row t0_g on; the mainloop rebuilds each group's (packed) scale layout from the
// group's problem shape (O, I, M_g), whose packed MN-major form is exactly that.
//
// As the forward FP8 kernel (kernel_fp8_fwd.cu), one call is two launches, nothing on the host:
// a prep kernel reads cu_seqlens on the device, orders the groups largest first (LPT: a tile of
// group g costs ~M_g, and the persistent scheduler walks groups in array order), chooses the
// config with the cost model (warp 0 of block 0; moonep_ops/gemm/fp8_wgrad_cost.py is the host
// mirror), writes every group's problem (O, I, M_g), pointers and strides (the other warps), and
// its blocks >= 1 zero the dW of empty groups; then one launch of the fused CUTLASS kernel
// (gemm_kernel.cuh's fused_grouped_gemm) runs the chosen config as a programmatic dependent.
// Capturable: group sizes never reach the host.
#include "fp8_common.cuh"

namespace moonep {
namespace fp8w {

using namespace fp8_common;

// The token tile (the reduction's scale block) = every config's K tile.  Operands: A = dyT
// [O, Mp], tokens contiguous (O x M_g, K-major); B = xT [I, Mp], tokens contiguous (CUTLASS's
// column-major N x K); D = dW_g [O, I] row-major, written once (beta = 0).
constexpr int kTile = kTileK;

// Granularity (M, N, K) = (1, 1, 128), both MN-major (see the top of the file).
using Sc = Scales<1, cute::GMMA::Major::MN>;

// One config of this GEMM (fp8_common.cuh's Config with these scales): tile BM x BN x 128,
// cluster CM x CN, cooperative or ping-pong, epilogue subtile width EN, raster order RasterN.
template <int BM, int BN, bool Pingpong, int CM, int CN, int EN = 0, int RasterN = 0>
using WgradConfig = Config<Sc, BM, BN, Pingpong, CM, CN, EN, RasterN>;

// The config table, in config-index order (moonep_ops/gemm/fp8_wgrad_cost.py WGRAD_CONFIGS
// mirrors it; tests compare through moonep_gemm_fp8_wgrad_config_info).  One family (cluster
// 1 x 2: the two CTAs of a cluster take neighbouring 128-column slices of dW_g and share the
// dyT tile by TMA multicast); the device chooses among all of them.
//   c128x128  cooperative 128 x 128 x 128, 64-column epilogue subtiles (the forward's winner);
//   p64x128   ping-pong 64 x 128 x 128: one warpgroup's promotion and epilogue overlap the
//             other's MMAs; for groups of few tokens (short K loops, epilogue-heavy tiles).
using Configs = std::tuple<WgradConfig<128, 128, false, 1, 2, 64, 1>,   // c128x128
                           WgradConfig<64, 128, true, 1, 2, 0, 1>>;      // p64x128
using T = Table<Configs>;
constexpr int kNumConfigs = T::kNumConfigs;
using StrideA = T::StrideA;
using StrideB = T::StrideB;
using StrideD = T::StrideD;

// ---- the cost model (warp 0 of the prep kernel's block 0) ----------------------------------
//
// moonep_ops/gemm/fp8_wgrad_cost.py is the host mirror (same float32 operations in the same
// order, rounded explicitly with __f*_rn so that nvcc contracts nothing into an FMA).  Every
// group has the same output tiles (T_c = ceil(O/BM) * (ceil(I/BN) rounded up to CN), CM = 1),
// and a tile of group g runs kb_g = ceil(M_g / 128) K blocks:
//   work_c = T_c * (per_round_c * nonempty + per_kblock_c * sum_g kb_g)     (tile-us)
//   t_c = fixed_c + max(work_c / slots_c, per_round_c + per_kblock_c * max_g kb_g,
//                       bytes / mem_bytes_per_us)        (the middle term 0 without a tile)
// slots_c = sm_count (x2 ping-pong: two tiles in flight per SM); the LPT order makes the
// balanced bound work / slots nearly exact when tiles outnumber the SMs, and the one-tile term
// bounds it when they do not.  bytes: the e4m3 operands (M_g * (O + I)) and the bf16 dW
// (2 * O * I) of every non-empty group.  The cheapest wins; within tie_tol of it the lower index.

__device__ __forceinline__ long long warp_sum_ll(long long v) {
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int warp_max_i(int v) {
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

// ---- prep kernel --------------------------------------------------------------------------

struct PrepParams : T::Problems {  // the problem arrays to write, then the call's operands
  const int* cu;
  int G, epn, M;        // M: the offsets' clamp bound, 128 * (Nb - G) + 127 (the launcher)
  int O, I, Mp;         // dW_g is O x I; the token-major operands have Mp = 128 * Nb columns
  int config;           // >= 0: forced; -1: the cost model chooses
  int sm_count;
  int zero_groups;      // empty groups g < zero_groups get their dW zeroed (G, or epn: keep slots)
  Tuning tune;
  const ElementA* A;    // dyT
  const ElementScale* SA;
  const ElementB* B;    // xT
  const ElementScale* SB;
  ElementD *DL, *DS;    // dW of the home experts / of the slots, [epn, O, I] each
};

constexpr int kMaxZeroBlocks = 128;

// Every block first reads the groups' (start, rows) into shared memory (clamped: rows of group g
// are [cu[g-1], cu[g]) within [0, M], cu[-1] := 0, so bad offsets never read or write out of
// bounds).  Block 0: warp 0 chooses the config, the other warps write the problem arrays in LPT
// order.  Blocks >= 1: zero the dW of the empty groups g < zero_groups (an empty group is a
// 0 x I x 0 problem: no tiles, so the GEMM never writes its dW).
__global__ void __launch_bounds__(kPrepThreads)
    prep_fp8_wgrad(const __grid_constant__ PrepParams p) {
  // The GEMM is a programmatic dependent of this grid (MOONEP_GEMM_PDL): let its CTAs launch now;
  // it waits for this grid's completion before reading anything written here.
  asm volatile("griddepcontrol.launch_dependents;");
  __shared__ int s_rows[kMaxGroups];
  __shared__ int s_start[kMaxGroups];
  __shared__ int s_empty[kMaxGroups];
  __shared__ int s_nempty;
  if (threadIdx.x == 0) s_nempty = 0;
  __syncthreads();
  for (int g = threadIdx.x; g < p.G; g += blockDim.x) {
    const int start = g == 0 ? 0 : clampi(__ldg(p.cu + g - 1), 0, p.M);
    const int end = clampi(__ldg(p.cu + g), start, p.M);
    s_start[g] = start;
    s_rows[g] = end - start;
    if (end == start && g < p.zero_groups) s_empty[atomicAdd(&s_nempty, 1)] = g;
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    if (threadIdx.x < 32) {
      if (p.config >= 0) {
        if (threadIdx.x == 0) *p.chosen = p.config;
        return;
      }
      int nonempty = 0, kb_sum = 0, kb_max = 0;
      long long rows_all = 0;
      for (int g = threadIdx.x; g < p.G; g += 32) {
        const int r = s_rows[g];
        const int kb = (r + kTile - 1) / kTile;
        nonempty += r > 0;
        kb_sum += kb;
        kb_max = max(kb_max, kb);
        rows_all += r;
      }
      nonempty = warp_sum(nonempty);
      kb_sum = warp_sum(kb_sum);
      kb_max = warp_max_i(kb_max);
      rows_all = warp_sum_ll(rows_all);
      if (threadIdx.x == 0) {
        // integer sums, then float32 operations in the host mirror's order, each rounded alone
        const float bytes = __fadd_rn(__fmul_rn((float)rows_all, (float)(p.O + p.I)),
                                      __fmul_rn((float)nonempty, 2.f * (float)p.O * (float)p.I));
        const float t_mem = __fdiv_rn(bytes, p.tune.mem_bytes_per_us);
        float t[kNumConfigs];
        float best = 3.4e38f;
#pragma unroll
        for (int c = 0; c < kNumConfigs; ++c) {
          const ConfigGeom gc = T::geom_of(c);
          const int nt = (p.I + gc.BN - 1) / gc.BN;
          const int tiles = ((p.O + gc.BM - 1) / gc.BM + gc.CM - 1) / gc.CM * gc.CM *
                            ((nt + gc.CN - 1) / gc.CN * gc.CN);
          const float slots = (float)(p.sm_count * (gc.pingpong ? 2 : 1));
          const float per_tile_sum =
              __fadd_rn(__fmul_rn(p.tune.per_round[c], (float)nonempty),
                        __fmul_rn(p.tune.per_kblock[c], (float)kb_sum));
          const float balanced = __fdiv_rn(__fmul_rn((float)tiles, per_tile_sum), slots);
          // (no tile at all when every group is empty: the call costs its fixed part)
          const float one_tile =
              nonempty > 0
                  ? __fadd_rn(p.tune.per_round[c], __fmul_rn(p.tune.per_kblock[c], (float)kb_max))
                  : 0.f;
          t[c] = __fadd_rn(p.tune.fixed[c], fmaxf(fmaxf(balanced, one_tile), t_mem));
          best = fminf(best, t[c]);
        }
        int pick = 0;
        const float window = __fmul_rn(best, __fadd_rn(1.f, p.tune.tie_tol));
#pragma unroll
        for (int c = kNumConfigs - 1; c >= 0; --c)
          if (t[c] <= window) pick = c;  // the lowest index in the window
        *p.chosen = pick;
      }
      return;
    }
    for (int g = threadIdx.x - 32; g < p.G; g += blockDim.x - 32) {
      const int rows = s_rows[g];
      // LPT position: the groups with more rows, or as many and a lower index, run before g
      int pos = 0;
      for (int h = 0; h < p.G; ++h) {
        const int rh = s_rows[h];
        pos += (rh > rows) || (rh == rows && h < g);
      }
      const bool home = g < p.epn;
      const long long e = home ? g : g - p.epn;
      const long long t0 = (long long)(s_start[g] / kTile) + g;  // the group's first token tile
      p.shapes[pos] = rows > 0 ? UShape(p.O, p.I, rows) : UShape(0, p.I, 0);
      p.ptr_a[pos] = p.A + t0 * kTile;
      p.ptr_b[pos] = p.B + t0 * kTile;
      p.ptr_d[pos] = (home ? p.DL : p.DS) + e * p.O * p.I;
      p.ptr_sfa[pos] = p.SA + t0 * p.O;   // MN-major: [tiles of g, O] from row t0
      p.ptr_sfb[pos] = p.SB + t0 * p.I;
      StrideA sa{};
      cute::get<0>(sa) = (int64_t)p.Mp;   // a row of dyT: all Mp columns (not packed)
      StrideB sb{};
      cute::get<0>(sb) = (int64_t)p.Mp;
      p.stride_a[pos] = sa;
      p.stride_b[pos] = sb;
      p.stride_d[pos] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(p.O, p.I, 1));
      // Not read by this mainloop (it rebuilds the same layouts from the shapes); written so
      // that the arrays CUTLASS is handed hold what they claim to.
      p.lay_sfa[pos] = Sc::Config::tile_atom_to_shape_SFA(make_shape(p.O, p.I, rows, 1));
      p.lay_sfb[pos] = Sc::Config::tile_atom_to_shape_SFB(make_shape(p.O, p.I, rows, 1));
    }
    return;
  }
  // zeroing blocks: O * I is a multiple of 8 (I % 16 == 0), so a dW is whole uint4 units
  const long long per = (long long)p.O * p.I / 8;
  const long long nthr = (long long)(gridDim.x - 1) * blockDim.x;
  const long long first = (long long)(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  for (int k = 0; k < s_nempty; ++k) {
    const int g = s_empty[k];
    ElementD* d = (g < p.epn ? p.DL : p.DS) + (long long)(g < p.epn ? g : g - p.epn) * p.O * p.I;
    uint4* out = reinterpret_cast<uint4*>(d);
    for (long long i = first; i < per; i += nthr) out[i] = make_uint4(0, 0, 0, 0);
  }
}

// The family of every config as one fused kernel.
using Family0 = T::Family<0, 0, 1>;
static_assert(kNumConfigs == 2, "Family0 lists every config");

}  // namespace fp8w
}  // namespace moonep

using namespace moonep;

extern "C" {

int moonep_gemm_fp8_wgrad_num_configs(void) { return fp8w::kNumConfigs; }

int moonep_gemm_fp8_wgrad_config_info(int config, int* out8) {
  return fp8w::T::config_info(config, out8);
}

size_t moonep_gemm_fp8_wgrad_workspace_bytes(int G, int sm_count) {
  return fp8w::T::workspace_bytes(G, sm_count);
}

int moonep_grouped_gemm_fp8_wgrad(const void* a_t, const float* a_t_scale, const void* b_t,
                                  const float* b_t_scale, void* d_local, void* d_slot,
                                  const int* cu_seqlens, int G, int epn, int n_tiles, int m,
                                  int n, int config, const float* tuning, int flags,
                                  void* workspace, size_t workspace_bytes, int sm_count,
                                  void* stream) {
  gemm_clear_error();
  if (epn < 1 || G != 2 * epn || G > fp8w::kMaxGroups)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: G must be 2*epn, epn >= 1, G <= 1024");
  if (n_tiles < G || n_tiles > (1 << 30) / fp8w::kTile)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: n_tiles must be floor(M/128) + G >= G "
                     "(the token tiles of moonep::quantize_fp8_tokens) and < 2^23");
  if (m <= 0 || n <= 0 || m % 16 || n % 16)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: m (O) and n (I) must be positive multiples "
                     "of 16");
  if (config < -1 || config >= fp8w::kNumConfigs)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: config must be -1 (chosen on the device) "
                     "or in [0, moonep_gemm_fp8_wgrad_num_configs())");
  if (config == -1 && !tuning)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: config -1 needs the tuning table");
  if (flags & ~(MOONEP_GEMM_PDL | MOONEP_GEMM_KEEP_EMPTY_SLOTS))
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: flags other than MOONEP_GEMM_PDL and "
                     "MOONEP_GEMM_KEEP_EMPTY_SLOTS");
  if (sm_count <= 0 || sm_count > fp8w::kMaxSms)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: sm_count must be in [1, 1024]");
  const fp8w::T::Layout L = fp8w::T::layout(G, sm_count);
  if (!workspace || workspace_bytes < L.total)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: workspace missing or smaller than "
                     "moonep_gemm_fp8_wgrad_workspace_bytes(G, sm_count)");
  if (!a_t || !a_t_scale || !b_t || !b_t_scale || !d_local || !d_slot || !cu_seqlens)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: a NULL operand pointer");
  if (!fp8w::aligned16(a_t) || !fp8w::aligned16(b_t) || !fp8w::aligned16(d_local) ||
      !fp8w::aligned16(d_slot))
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: a_t, b_t, d_local and d_slot must be "
                     "16-byte aligned (TMA)");
  if ((reinterpret_cast<uintptr_t>(workspace) & (fp8w::kAlign - 1)) != 0)
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: the workspace must be 256-byte aligned");
  if (!fp8w::aligned4(a_t_scale) || !fp8w::aligned4(b_t_scale) || !fp8w::aligned4(cu_seqlens))
    return gemm_fail("moonep_grouped_gemm_fp8_wgrad: scales and cu_seqlens must be 4-byte "
                     "aligned");

  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  fp8w::PrepParams p{};
  p.cu = cu_seqlens;
  p.G = G;
  p.epn = epn;
  // The largest M whose token tiles are n_tiles (n_tiles = floor(M/128) + G): clamping the
  // offsets to it keeps every group's tiles inside [0, n_tiles) (floor(s/128) + g + ceil(m/128)
  // <= floor(M/128) + G for s + m <= M), whatever cu_seqlens holds.
  p.M = (n_tiles - G) * fp8w::kTile + fp8w::kTile - 1;
  p.O = m;
  p.I = n;
  p.Mp = n_tiles * fp8w::kTile;
  p.config = config;
  p.sm_count = sm_count;
  p.zero_groups = (flags & MOONEP_GEMM_KEEP_EMPTY_SLOTS) ? epn : G;
  if (tuning) p.tune = fp8w::read_tuning(tuning);  // the FP8 GEMM's table layout
  p.A = static_cast<const fp8w::ElementA*>(a_t);
  p.SA = a_t_scale;
  p.B = static_cast<const fp8w::ElementB*>(b_t);
  p.SB = b_t_scale;
  p.DL = static_cast<fp8w::ElementD*>(d_local);
  p.DS = static_cast<fp8w::ElementD*>(d_slot);
  static_cast<fp8w::T::Problems&>(p) = fp8w::T::problems(ws, L);

  // Zeroing blocks sized to one dW (the empty groups are known on the device only; at most
  // kMaxZeroBlocks, grid-strided over every empty group's dW); at least one, which finds
  // nothing to do when no group is empty.
  const long long vec = (long long)m * n / 8;
  long long zb = (vec + fp8w::kPrepThreads - 1) / fp8w::kPrepThreads;
  if (zb > fp8w::kMaxZeroBlocks) zb = fp8w::kMaxZeroBlocks;
  if (zb > sm_count - 1) zb = sm_count - 1;
  if (zb < 1) zb = 1;
  const bool pdl = (flags & MOONEP_GEMM_PDL) != 0;
  return fp8w::T::run<fp8w::Family0>("moonep_grouped_gemm_fp8_wgrad", p.chosen, G, sm_count, ws,
                                     L, s, pdl, [&] {
    fp8w::prep_fp8_wgrad<<<1 + (int)zb, fp8w::kPrepThreads, 0, s>>>(p);
  });
}

}  // extern "C"
