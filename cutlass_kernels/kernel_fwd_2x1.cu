// fwd: y = x W^T, family 1: torch._grouped_mm's two sm90 kernels (cluster 2 x 1: the two CTAs of
// a cluster are adjacent M tiles sharing one multicast weight tile), on our per-group pointers.
// Config order = configs.h MOONEP_GEMM_CONFIGS (checked at registration).
#include "gemm_kernel.cuh"
MOONEP_DEFINE_KIND(fwd_2x1, GroupedGemm<0, 128, 256, 64, 2, 1, false>,
                            GroupedGemm<0, 64, 128, 128, 2, 1, true>)
