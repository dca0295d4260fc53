// wgrad_lp: dW = dy^T x written once in bf16, family 1: torch._grouped_mm's two sm90 kernels
// (cluster 2 x 1: adjacent O tiles share one multicast x^T tile).  Config order = configs.h
// MOONEP_GEMM_CONFIGS (checked at registration).
#include "gemm_kernel.cuh"
MOONEP_DEFINE_KIND(wgrad_lp_2x1, GroupedGemm<3, 128, 256, 64, 2, 1, false>,
                                 GroupedGemm<3, 64, 128, 128, 2, 1, true>)
