// wgrad_lp: dW = dy^T x written once in bf16.  Config order = configs.h MOONEP_GEMM_CONFIGS
// (checked at registration).
#include "gemm_kernel.cuh"
MOONEP_DEFINE_KIND(wgrad_lp, GroupedGemm<3, 128, 256, 64, 1, 2, false, 64>,
                   GroupedGemm<3, 128, 128, 64, 1, 2, false, 64>,
                   GroupedGemm<3, 128, 128, 64, 1, 2, true>)
