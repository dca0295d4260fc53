// The compiled configurations, listed here in the order of the config index of the C ABI and of
// moonep_ops/gemm/cost_model.py::CONFIGS.  The configs of one kind that share a cluster shape
// are one FAMILY: they are fused into one kernel in one translation unit, which must list them
// in this order (checked at load):
//   family 0, cluster 1 x 2 (along N): kernel_<kind>.cu, the configs the device cost model
//     chooses among per call (every kind);
//   family 1, cluster 2 x 1 (along M): kernel_<kind>_2x1.cu, torch._grouped_mm's own two sm90
//     kernels (aten/src/ATen/native/cuda/GroupMM.cu: cooperative 128x256x64 and ping-pong
//     64x128x128, both 2 x 1), fwd, dgrad and wgrad_lp.  A cluster along M rounds every group's
//     M-tile count up to 2 (padding tiles run the full mainloop), but the two CTAs of a cluster
//     then share (multicast) the weight tile; the host picks the family from static shapes
//     (moonep_ops/gemm/cost_model.py never-lose rule) and the configs of a family follow one
//     after the other in the config index.
// One call runs one family: its candidates (or its forced config) are configs of one family.
#pragma once

namespace moonep {

constexpr int kNumKinds = 4;  // fwd, dgrad, wgrad (fp32 +=), wgrad_lp (bf16 out)
constexpr int kMaxConfigs = 8;
constexpr int kMaxFamilies = 2;

// EN: the epilogue subtile's width (0: CUTLASS's choice, 32 columns; see gemm_kernel.cuh).
// swap = 1: the config computes the transposed product (swap-AB: D^T = B A^T), so the weight
// rows take the BM-row M tiles and a group's token rows the N tiles (BN any multiple of 8 up
// to 256).  fwd: A = W_g [n_out, K] RowMajor, B = x rows ColumnMajor (K contiguous), D = y^T
// ColumnMajor; dgrad: A = W_g^T [K, N] ColumnMajor, B = dy rows ColumnMajor, D = dx^T
// ColumnMajor.  Its cluster (1 x CN) pairs token tiles that share one weight tile (TMA
// multicast), and a group's token-tile count rounds up to CN.
struct ConfigGeom {
  int BM, BN, BK, CM, CN, pingpong, EN, swap;
};

// X(kind, name, BM, BN, BK, CM, CN, pingpong, EN, swap)
#define MOONEP_GEMM_CONFIGS(X)                         \
  X(fwd, c128x256, 128, 256, 64, 1, 2, 0, 64, 0)       \
  X(fwd, p128x128, 128, 128, 64, 1, 2, 1, 0, 0)        \
  X(fwd, s256x80, 256, 80, 64, 1, 2, 0, 0, 1)          \
  X(fwd, s256x96, 256, 96, 64, 1, 2, 0, 0, 1)          \
  X(fwd, p64x256, 64, 256, 64, 1, 2, 1, 0, 0)          \
  X(fwd, s256x128, 256, 128, 64, 1, 2, 0, 0, 1)        \
  X(fwd, t128x256, 128, 256, 64, 2, 1, 0, 0, 0)        \
  X(fwd, t64x128, 64, 128, 128, 2, 1, 1, 0, 0)         \
  X(dgrad, c128x256, 128, 256, 64, 1, 2, 0, 0, 0)      \
  X(dgrad, p128x128, 128, 128, 64, 1, 2, 1, 0, 0)      \
  X(dgrad, s256x80, 256, 80, 64, 1, 2, 0, 0, 1)        \
  X(dgrad, s256x96, 256, 96, 64, 1, 2, 0, 0, 1)        \
  X(dgrad, p64x256, 64, 256, 64, 1, 2, 1, 0, 0)        \
  X(dgrad, s256x128, 256, 128, 64, 1, 2, 0, 0, 1)      \
  X(dgrad, t128x256, 128, 256, 64, 2, 1, 0, 0, 0)      \
  X(dgrad, t64x128, 64, 128, 128, 2, 1, 1, 0, 0)       \
  X(wgrad, c128x256, 128, 256, 64, 1, 2, 0, 0, 0)      \
  X(wgrad, c128x128, 128, 128, 64, 1, 2, 0, 0, 0)      \
  X(wgrad, p128x128, 128, 128, 64, 1, 2, 1, 64, 0)     \
  X(wgrad_lp, c128x256, 128, 256, 64, 1, 2, 0, 64, 0)  \
  X(wgrad_lp, c128x128, 128, 128, 64, 1, 2, 0, 64, 0)  \
  X(wgrad_lp, p128x128, 128, 128, 64, 1, 2, 1, 0, 0)   \
  X(wgrad_lp, t128x256, 128, 256, 64, 2, 1, 0, 0, 0)   \
  X(wgrad_lp, t64x128, 64, 128, 128, 2, 1, 1, 0, 0)

// Everything one kernel launch needs; the arrays live in the call's device workspace and are
// filled by the prep kernel (prep.cu) from cu_seqlens, so nothing about group sizes is on the host.
struct RunArgs {
  int G;
  void* shapes;            // cute::Shape<int,int,int>[G] (M, N, K per group; swap: N, M, K)
  const void** ptr_A;
  const void** ptr_B;
  const void** ptr_C;      // wgrad only (== ptr_D: accumulate in place)
  void** ptr_D;
  void* stride_A;
  void* stride_B;
  void* stride_C;
  void* stride_D;
  void* cutlass_ws;
  int sm_count;
  int raster;              // 0 along M (co-resident CTAs share a weight slice), 1 along N
  void* stream;
};

// Host-computed strides of one kind (same for all groups), as raw bytes for the prep kernel.
struct StrideBytes {
  unsigned char a[32], b[32], c[32], d[32];
  int size_a, size_b, size_c, size_d;
};

// What prep.cu sees of one family of a kind: its configs, fused into one kernel (gemm_kernel.cuh
// FusedKind, defined by kernel_<kind>.cu as moonep::kind_entry_<kind> and kernel_<kind>_2x1.cu as
// moonep::kind_entry_<kind>_2x1).  Config c of the entry is config first + c of the kind.
struct KindEntry {
  int n;
  const ConfigGeom* geoms;
  size_t (*workspace_bytes)(int c, int G, int sm_count);
  // Config c's strides for the unswapped problem (M rows, N, K); a swap config transposes.
  void (*strides)(int c, int M, int N, int K, StrideBytes* out);
  // r[c]: config c's problem arrays and CUTLASS workspace; chosen: the device word with the kind's
  // index of the config to run (written by the prep kernel), `first` that of the entry's config
  // 0.  One launch on r[0].stream.
  // pdl: launch as a programmatic dependent of the prep kernel (moonep_gemm.h MOONEP_GEMM_PDL).
  int (*run)(RunArgs const* r, const int* chosen, int first, int pdl, char* err, int err_len);
};

}  // namespace moonep
