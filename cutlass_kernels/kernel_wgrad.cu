// wgrad: dW += dy^T x in fp32.  Config order = configs.h MOONEP_GEMM_CONFIGS (checked at
// registration).
#include "gemm_kernel.cuh"
MOONEP_DEFINE_KIND(wgrad, GroupedGemm<2, 128, 256, 64, 1, 2, false>,
                   GroupedGemm<2, 128, 128, 64, 1, 2, false>,
                   GroupedGemm<2, 128, 128, 64, 1, 2, true, 64>)
