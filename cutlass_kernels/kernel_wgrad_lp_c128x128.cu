#include "gemm_kernel.cuh"
MOONEP_DEFINE_CONFIG(3, wgrad_lp, c128x128, 128, 128, 64, 1, 2, 0)
