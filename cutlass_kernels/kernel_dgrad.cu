// dgrad: dx = dy W, family 0 (cluster 1 x 2; the device cost model chooses among these per call).
// Config order = configs.h MOONEP_GEMM_CONFIGS (checked at registration).
#include "gemm_kernel.cuh"
MOONEP_DEFINE_KIND(dgrad, GroupedGemm<1, 128, 256, 64, 1, 2, false>,
                          GroupedGemm<1, 128, 128, 64, 1, 2, true>,
                          GroupedGemm<5, 256, 80, 64, 1, 2, false>,
                          GroupedGemm<5, 256, 96, 64, 1, 2, false>,
                          GroupedGemm<1, 64, 256, 64, 1, 2, true>,
                          GroupedGemm<5, 256, 128, 64, 1, 2, false>)
