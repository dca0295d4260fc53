// dgrad: dx = dy W, family 1: torch._grouped_mm's two sm90 kernels (cluster 2 x 1), on our
// per-group pointers.  Config order = configs.h MOONEP_GEMM_CONFIGS (checked at registration).
#include "gemm_kernel.cuh"
MOONEP_DEFINE_KIND(dgrad_2x1, GroupedGemm<1, 128, 256, 64, 2, 1, false>,
                              GroupedGemm<1, 64, 128, 128, 2, 1, true>)
